"""Test job: starts a child process, records both pids in `--pid_file`, and sleeps forever.

With `--ignore_term` it ignores SIGTERM (so only the launcher's SIGKILL escalation ends it).
"""

import argparse
import os
import signal
import subprocess
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--pid_file", required=True)
  p.add_argument("--ignore_term", action="store_true")
  p.add_argument("--tag", default="", help="ignored; lets sweeps vary an arg")
  args = p.parse_args(argv)
  if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  with open(args.pid_file, "a", encoding="utf-8") as f:
    f.write(f"{os.getpid()}\n{child.pid}\n")
  print(f"sleeping (pid {os.getpid()}, child {child.pid})", flush=True)
  while True:
    time.sleep(1)


if __name__ == "__main__":
  sys.exit(main())
