"""Test helper: runs an experiment of sleeper jobs with LocalExecutor.run (for the SIGINT test).

Usage: python -m launch.testdata.run_experiment <root_dir> <pid_file> <work_units> [--ignore_term]
Prints "launched" once every job has recorded its pids, then waits; exit 130 when interrupted.
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
    want = 4 * units
    while True:
      try:
        with open(pid_file, encoding="utf-8") as f:
          if len(f.read().split()) >= want:
            break
      except OSError:
        pass
      time.sleep(0.05)
    print("launched", flush=True)

  threading.Thread(target=announce, daemon=True).start()
  run = executor.run(exp)
  print(run.summary(), flush=True)
  return 130 if run.interrupted else (0 if run.succeeded() else 1)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
