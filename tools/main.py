"""The main job: pre-training -> held-out eval -> asynchronous RL -> held-out eval.

  bazel run //tools:main                                   # the default experiment (CPU, ~10 min)
  bazel run //tools:main -- --gin_file=tools/configs/experiments/larger.gin
  bazel run //tools:main -- --gin.RLConfig.steps=100 --run_dir=/tmp/run1

The run directory (default: runs/<date-time> in the workspace) receives metrics.jsonl,
TensorBoard event files, PNG plots, per-task eval results and summary.json. The last line of
output is `held-out pass@1: before X/N -> after Y/N`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

DEFAULT_EXPERIMENT = "tools/configs/experiments/default.gin"


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--gin_file", action="append", default=None,
                 help=f"gin experiment file(s) (default {DEFAULT_EXPERIMENT})")
  p.add_argument("--run_dir", default=None, help="output directory (default runs/<date-time>)")
  p.add_argument("--no_progress", action="store_true", help="no progress bars")
  args, rest = p.parse_known_args(argv)
  bindings = []
  for a in rest:
    if a.startswith("--gin."):
      bindings.append(a[len("--gin."):])
    elif a.startswith("--gin_binding="):
      bindings.append(a[len("--gin_binding="):])
    else:
      p.error(f"unknown argument {a!r} (gin overrides look like --gin.RLConfig.steps=100)")
  return args, bindings


def default_run_dir() -> str:
  root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
  return os.path.join(root, "runs", time.strftime("%Y%m%d-%H%M%S"))


def main(argv=None, *, evaluate: bool = True) -> int:
  args, bindings = parse_args(sys.argv[1:] if argv is None else argv)
  from tools import configs  # pylint: disable=g-import-not-at-top
  try:
    cfg = configs.load_experiment(args.gin_file or [DEFAULT_EXPERIMENT], bindings)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  run_dir = args.run_dir or default_run_dir()
  print(f"run directory: {run_dir}", flush=True)
  summary = run_lib.run(cfg, run_dir, progress=not args.no_progress, evaluate=evaluate)
  if evaluate:
    print(run_lib.final_line(summary), flush=True)
  else:
    print(f"final model: {summary['final_model']}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
