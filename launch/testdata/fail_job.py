"""Test job: prints a line, waits `--delay` seconds and exits with `--code`."""

import argparse
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--delay", type=float, default=0.0)
  p.add_argument("--code", type=int, default=3)
  args = p.parse_args(argv)
  print(f"failing with {args.code} in {args.delay}s", flush=True)
  time.sleep(args.delay)
  print("error: giving up", file=sys.stderr, flush=True)
  return args.code


if __name__ == "__main__":
  sys.exit(main())
