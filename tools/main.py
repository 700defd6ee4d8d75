"""The main job: pre-training -> held-out eval -> asynchronous RL -> held-out eval.

  bazel run //tools:main                                   # the default experiment (CPU, ~10 min)
  bazel run //tools:main -- --gin_file=tools/configs/experiments/larger.gin
  bazel run //tools:main -- --gin.RLConfig.steps=100 --run_dir=/tmp/run1
  bazel run //tools:main -- --hf_checkpoint=DIR --gin_file=tools/configs/experiments/hf_rl.gin

The run directory (default: runs/<date-time> in the workspace) receives metrics.jsonl,
TensorBoard event files, PNG plots, per-task eval results and summary.json. The last line of
output is `held-out pass@1: before X/N -> after Y/N`.

`--hf_checkpoint=DIR` starts from a Hugging Face checkpoint with its own tokenizer and exports the
final model as one (`--hf_export=DIR`, default <run_dir>/hf_export); `--task_file=PATH` trains
and evaluates on your tasks (envs/tasks/task_format.py) instead of the built-in suite. Each is
the ExperimentConfig field of its name (experiment/config.py), a path relative to the workspace.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

DEFAULT_EXPERIMENT = "tools/configs/experiments/default.gin"


# Flags that set the ExperimentConfig field of their name to a path (relative: to the workspace).
PATH_FLAGS = {
    "hf_checkpoint": "Hugging Face checkpoint directory to start from (its config and tokenizer)",
    "hf_export": "where to export the final model of an --hf_checkpoint run (default "
                 "<run_dir>/hf_export)",
    "task_file": "tasks to train and evaluate on instead of the built-in suite (JSONL or task "
                 "directories, envs/tasks/task_format.py)",
}


def parse_args(argv):
  """(flags, gin files, gin bindings); the gin files default to the default experiment, and
  each PATH_FLAGS flag given becomes the binding of its ExperimentConfig field."""
  from tools import configs  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run_dir", default=None,
                 help="output directory (default runs/<date-time>; relative: to the workspace)")
  p.add_argument("--no_progress", action="store_true", help="no progress bars")
  for name, help_ in PATH_FLAGS.items():
    p.add_argument(f"--{name}", default=None, help=help_)
  args, files, bindings = configs.parse_flags(p, argv)
  for name in PATH_FLAGS:
    if getattr(args, name):
      bindings.append(f"ExperimentConfig.{name} = "
                      f"{configs.workspace_path(getattr(args, name))!r}")
  return args, files or [DEFAULT_EXPERIMENT], bindings


def default_run_dir() -> str:
  root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
  return os.path.join(root, "runs", time.strftime("%Y%m%d-%H%M%S"))


def main(argv=None, *, evaluate: bool = True) -> int:
  args, files, bindings = parse_args(sys.argv[1:] if argv is None else argv)
  from tools import configs  # pylint: disable=g-import-not-at-top
  try:
    cfg = configs.load_experiment(files, bindings)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  run_dir = configs.workspace_path(args.run_dir) if args.run_dir else default_run_dir()
  print(f"run directory: {run_dir}", flush=True)
  # One compilation cache per run: the evaluation engines, the RL samplers and learner compile
  # the same shapes again (each engine its own jit cache); XLA's persistent cache makes the
  # repeats loads. Per run, so every run starts cold and runs compare like with like.
  from tools import compilation_cache  # pylint: disable=g-import-not-at-top
  compilation_cache.enable(os.path.join(run_dir, "xla_cache"), min_compile_time_secs=0.5)
  summary = run_lib.run(cfg, run_dir, progress=not args.no_progress, evaluate=evaluate)
  if "hf_export" in summary:
    print(f"Hugging Face export: {summary['hf_export']}", flush=True)
  if evaluate:
    print(run_lib.final_line(summary), flush=True)
  else:
    print(f"final model: {summary['final_model']}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
