"""Test helper: runs an experiment of sleeper jobs with LocalExecutor.run (for the SIGINT test).

Usage: python -m launch.testdata.run_experiment <root_dir> <pid_file> <work_units> [--ignore_term]
Prints "launched" once every job has recorded its pids (or, after 60 s, "not launched: ..."),
then waits; exit 130 when interrupted.
"""

import sys
import threading
import time

from launch import local
from launch import spec


def main(argv) -> int:
  root, pid_file, units = argv[0], argv[1], int(argv[2])
  extra = ["--ignore_term"] if "--ignore_term" in argv else []
  jobs = [spec.Job(f"sleeper_{i}", spec.PyModule("launch.testdata.sleeper"),
                   args=[f"--pid_file={pid_file}"] + extra, port=False) for i in range(2)]
  exp = spec.sweep("sigint", jobs, [{"tag": f"u{u}"} for u in range(units)])
  executor = local.LocalExecutor(root, use_bazel=False, grace_s=1.0, out=None)

  def announce():  # 2 pids (job + its child) per job once all are up
    want, have = 4 * units, 0
    deadline = time.monotonic() + 60  # the test reads this line; it must not wait forever
    while time.monotonic() < deadline:
      try:
        with open(pid_file, encoding="utf-8") as f:
          have = len(f.read().split())
      except OSError:
        pass
      if have >= want:
        print("launched", flush=True)
        return
      time.sleep(0.05)
    print(f"not launched: {have} of {want} pids after 60s", flush=True)

  threading.Thread(target=announce, daemon=True).start()
  run = executor.run(exp)
  print(run.summary(), flush=True)
  return 130 if run.interrupted else (0 if run.succeeded() else 1)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
