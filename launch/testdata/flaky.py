"""Test job: appends its start to `--starts_file`, fails (exit 3) on its first `--fail_times`
starts after `--run_s` seconds, and otherwise exits 0 after `--run_s` seconds."""

import argparse
import os
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--starts_file", required=True)
  p.add_argument("--fail_times", type=int, default=0)
  p.add_argument("--run_s", type=float, default=1.0)
  args = p.parse_args(argv)
  with open(args.starts_file, "a", encoding="utf-8") as f:
    f.write(f"{os.getpid()}\n")
  with open(args.starts_file, encoding="utf-8") as f:
    starts = len(f.read().split())
  print(f"start {starts}", flush=True)
  time.sleep(args.run_s)
  return 3 if starts <= args.fail_times else 0


if __name__ == "__main__":
  sys.exit(main())
