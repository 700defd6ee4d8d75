"""Launches an experiment: the work units of named jobs an experiment gin file binds.

(The Bazel target is //tools:launch; the file is not called launch.py because Bazel puts a
binary's own directory first on sys.path, where tools/launch.py would shadow the launch package.)

Usage (the experiment file states its own command in its first comment):

  bazel run //tools:launch -- --experiment=launch/testdata/echo.gin
  bazel run //tools:launch -- --experiment=tools/configs/launch/rl.gin     # the RL pipeline
  bazel run //tools:launch -- --experiment=tools/configs/launch/rl.gin --executor=ray \
      --ray_address=HEAD:6379          # on a Ray cluster (no address: a local Ray)
  bazel run //tools:launch -- --status=/tmp/launch/rl-<date-time>   # each job's state, counts
  bazel run //tools:launch -- --experiment=EXP.gin --executor=xm      # real xmanager, xm_local
  .venv/bin/python -m tools.launcher --experiment=EXP.gin --use_bazel=False --dry_run
  ... --gin.experiment.sweep='{"learner.lr": [1e-4, 3e-4], "seed": [0, 1]}'   # 4 work units

An experiment file binds `experiment.name`, `experiment.jobs` (a list of `@<scope>/job()` calls,
one scope per job) and optionally `experiment.sweep` (a grid {arg: [values]}, "job.arg" for one
job) or `experiment.points` (an explicit list of {arg: value}). Launcher settings are the
parameters of `launch_main` (`--root_dir`, `--executor`, `--use_bazel`, `--on_failure`, ...).
gin lives only here: launch/ takes plain objects.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import gin

from launch import local
from launch import spec
from launch import xm_adapter
from tools import configs
from tools import rl_launch  # pylint: disable=unused-import  (registers rl_jobs, resources)


@gin.configurable
def job(name: str = gin.REQUIRED, target: Optional[str] = None, module: Optional[str] = None,
        command: Optional[Sequence[str]] = None, args: Any = (),
        env: Optional[Mapping[str, str]] = None, port: bool = True,
        resources: Optional[spec.Resources] = None, max_restarts: int = 0,
        service: bool = False) -> spec.Job:
  """One job: exactly one of a Bazel `target`, a Python `module` or a `command` argv
  (`resources`: @resources(), what a cluster executor reserves for it)."""
  given = [x for x in (target, module, command) if x is not None]
  if len(given) != 1:
    raise spec.SpecError(f"job {name!r}: give exactly one of target, module or command")
  if target is not None:
    exe = spec.BazelBinary(target)
  elif module is not None:
    exe = spec.PyModule(module)
  else:
    exe = spec.Command(tuple(command))
  return spec.Job(name=name, executable=exe, args=args, env=dict(env or {}), port=port,
                  resources=resources or spec.Resources(), max_restarts=max_restarts,
                  service=service)


@gin.configurable
def experiment(name: str = gin.REQUIRED, jobs: Sequence[spec.Job] = gin.REQUIRED,
               sweep: Optional[Mapping[str, Sequence[Any]]] = None,
               points: Optional[Sequence[Mapping[str, Any]]] = None) -> spec.Experiment:
  if sweep and points:
    raise spec.SpecError("bind experiment.sweep (a grid) or experiment.points, not both")
  pts = spec.grid(sweep) if sweep else (list(points) if points else [{}])
  return spec.sweep(name, list(jobs), pts)


@gin.configurable
def launch_main(executor: str = "local", root_dir: str = "/tmp/launch", use_bazel: bool = True,
                bazel_args: Sequence[str] = (), on_failure: str = "stop_work_unit",
                grace_s: float = 5.0, max_parallel: Optional[int] = None,
                dry_run: bool = False, ray_address: Optional[str] = None,
                ray_num_cpus: Optional[int] = None, ray_object_store_mb: int = 100,
                placement_strategy: str = "SPREAD", summary: Optional[str] = None) -> int:
  """Builds the bound experiment and runs it; returns the process exit code.

  `executor`: "local" (processes here), "ray" (actors on the Ray cluster at `ray_address`, or
  on a local Ray started with `ray_num_cpus` and `ray_object_store_mb` when there is none;
  `placement_strategy` of its placement groups) or "xm" (xmanager's xm_local). `summary`:
  "rl" writes the RL run's summary.json and metrics.jsonl when it ends (tools/rl_launch.py).
  """
  exp = experiment()
  root_dir = configs.workspace_path(root_dir)
  if dry_run:
    print(f"experiment {exp.name}: {len(exp.work_units)} work unit(s); Bazel targets: "
          f"{', '.join(exp.bazel_labels) or '-'}")
    for i, wu in enumerate(exp.work_units):
      print(f"work unit {i} {dict(wu.params)}")
      for j in wu.jobs:
        exe = j.executable
        what = getattr(exe, "label", None) or getattr(exe, "module", None) or " ".join(exe.argv)
        print(f"  {j.name}: {what} {' '.join(j.argv_args)}")
    return 0
  if executor == "xm":
    exp_dir = os.path.join(root_dir, f"{exp.name}-xm-{time.strftime('%Y%m%d-%H%M%S')}")
    xm_adapter.launch(exp, exp_dir, bazel_args=bazel_args)
    print(f"launched {len(exp.work_units)} work unit(s) with xm_local; jobs.json under {exp_dir}")
    return 0
  if executor == "ray":
    from launch import ray_executor  # pylint: disable=g-import-not-at-top
    ex = ray_executor.RayExecutor(root_dir, ray_address=ray_address, use_bazel=use_bazel,
                                  bazel_args=tuple(bazel_args), on_failure=on_failure,
                                  grace_s=grace_s, placement_strategy=placement_strategy,
                                  num_cpus=ray_num_cpus,
                                  object_store_memory=int(ray_object_store_mb) << 20)
  elif executor == "local":
    ex = local.LocalExecutor(root_dir, use_bazel=use_bazel, bazel_args=tuple(bazel_args),
                             on_failure=on_failure, grace_s=grace_s, max_parallel=max_parallel)
  else:
    raise spec.SpecError(f"executor must be 'local', 'ray' or 'xm', got {executor!r}")
  run = ex.run(exp)
  print(run.summary())
  if summary == "rl":
    counts = rl_launch.summarize(run.dir)
    for u in counts["work_units"]:
      print(f"work unit {u['index']}: " + json.dumps(
          {k: v for k, v in u.items() if k.startswith("episodes_") or k == "steps"}))
  print(f"experiment directory: {run.dir}")
  if run.interrupted:
    return 130
  return 0 if run.succeeded() else 1


def main(argv: Sequence[str]) -> int:
  try:
    files, bindings, extra = configs.split_flags(argv, launch_main,
                                                 extra_flags=("experiment", "status"))
    if "status" in extra:  # a run's state, from its directory (either executor, running or not)
      path = configs.workspace_path(extra["status"])
      if not os.path.isfile(os.path.join(path, "status.json")):
        raise configs.ConfigError(f"--status: {path} has no status.json (not a run directory)")
      print(rl_launch.status_report(path))
      return 0
    if "experiment" in extra:
      files.insert(0, configs.resolve_path(extra["experiment"]))
    if not files:
      raise configs.ConfigError("give an experiment gin file: --experiment=PATH or "
                                "--gin_file=PATH")
    configs.parse(files, bindings)
    return launch_main()
  except (configs.ConfigError, spec.SpecError, xm_adapter.XManagerUnavailable) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
