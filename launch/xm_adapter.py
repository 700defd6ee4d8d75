"""The same Experiment on the real `xmanager` package (xm_local executor), when it is installed.

`plan(...)` is pure: it maps our Experiment onto what XManager needs, one packageable per distinct
executable (XManager packages -- for Bazel targets, builds -- each once) and one job group per
work unit whose jobs carry the args and the discovery environment. `to_xm(...)` turns a plan into
`xm.Packageable`s (`xm.bazel_binary` for Bazel targets, `xm.binary` for Python modules and
commands, all with `xm_local.LocalSpec()`) and `launch(...)` packages them and adds one
`xm.JobGroup` per work unit to an `xm_local` experiment.

Services (`spec.Job.service`: jobs that serve until the rest of their work unit has ended, such
as tools/configs/launch/rl.gin's samplers and relays) are refused (`plan` raises
XManagerUnsupported, naming the executors that stop them): an xm job group has no notion of a
job stopped when the others end, so under xm_local the work unit would never end.

Discovery: xm_local gives jobs no address map, so ports are reserved here (every xm_local job runs
on this machine) and written to the same `jobs.json` files the local executor writes; jobs get
the same LAUNCH_* variables (`launch.discovery`), so job code cannot tell the executors apart.

How far this works offline (xmanager 0.8.5.post1, Bazel 4.2.3, checked here; launch/README.md):
  * xmanager is a test requirement installed without pip's dependency resolution
    (requirements-xm.txt: it and only what xm_local imports; its full requirements pull Google
    Cloud and Kubernetes clients and protobuf<7), and launch/xm_adapter_test.py runs an
    experiment of `xm.binary` jobs under xm_local with it, the jobs finding each other by name.
  * With no network, docker or gcloud, xm_local also ran a work unit of `xm.bazel_binary` jobs
    (its `bazel build --build_event_binary_file` and `cquery --output=starlark` work with Bazel
    4.2.3; by hand, not in the test: a nested Bazel build).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Optional, Sequence

from launch import discovery
from launch import spec
from launch import targets


class XManagerUnavailable(RuntimeError):
  """`import xmanager` failed."""


class XManagerUnsupported(spec.SpecError):
  """The experiment needs what the XManager adapter cannot give it (services)."""


def available() -> bool:
  try:
    importlib.import_module("xmanager.xm")
    importlib.import_module("xmanager.xm_local")
    return True
  except ImportError:
    return False


def _require():
  try:
    xm = importlib.import_module("xmanager.xm")
    xm_local = importlib.import_module("xmanager.xm_local")
  except ImportError as e:
    raise XManagerUnavailable(
        f"the xmanager package is not importable ({e}). Install it with "
        "`pip install xmanager==0.8.5.post1` (heavy: it pulls Google Cloud and Kubernetes "
        "clients; `pip install --no-deps -r requirements-xm.txt` is enough for xm_local, "
        "and `scripts/bootstrap.sh --test` does it) or use the local executor "
        "(--executor=local).") from e
  return xm, xm_local


@dataclasses.dataclass(frozen=True)
class PackagePlan:
  """One xm packageable: kind "bazel_binary" (target = label) or "binary" (target = path),
  with fixed leading args (e.g. ["-u", "-m", module] for a Python module)."""
  kind: str
  target: str
  args: tuple = ()
  bazel_args: tuple = ()


@dataclasses.dataclass(frozen=True)
class JobPlan:
  name: str
  package: int  # index into Plan.packages
  args: tuple
  env: dict


@dataclasses.dataclass(frozen=True)
class Plan:
  packages: tuple
  work_units: tuple  # of tuples of JobPlan
  jobs_files: tuple  # jobs.json path per work unit


def _package_of(exe: spec.Executable, bazel_args: Sequence[str]) -> PackagePlan:
  if isinstance(exe, spec.BazelBinary):
    return PackagePlan("bazel_binary", exe.label, (), tuple(bazel_args))
  if isinstance(exe, spec.PyModule):
    return PackagePlan("binary", sys.executable, ("-u", "-m", exe.module))
  return PackagePlan("binary", exe.argv[0], tuple(exe.argv[1:]))


def plan(experiment: spec.Experiment, exp_dir: str, *, host: str = "127.0.0.1",
         repo_root: Optional[str] = None, bazel_args: Sequence[str] = ()) -> Plan:
  """Maps the experiment; reserves ports and writes each work unit's jobs.json under exp_dir.

  Raises:
    XManagerUnsupported: a job is a service (see the module docstring), before anything is
      written or reserved.
  """
  services = sorted({j.name for wu in experiment.work_units for j in wu.jobs if j.service})
  if services:
    raise XManagerUnsupported(
        f"experiment {experiment.name!r}: jobs {', '.join(services)} are services (they serve "
        "until the rest of their work unit ends, then the executor stops them); the xm "
        "executor cannot stop them, so the work unit would never end. Run it with the local "
        "executor (--executor=local) or on a Ray cluster (--executor=ray).")
  repo_root = os.path.abspath(repo_root or targets.workspace_root())
  packages: dict[spec.Executable, int] = {}
  ordered: list[PackagePlan] = []
  units, files = [], []
  for i, wu in enumerate(experiment.work_units):
    table = {j.name: {"host": host, "port": discovery.free_port(host) if j.port else None}
             for j in wu.jobs}
    path = os.path.join(exp_dir, f"wu{i}", "jobs.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    discovery.write_jobs_file(path, table, work_unit=i, experiment=experiment.name,
                              params={k: v for k, v in wu.params.items()})
    files.append(path)
    jobs = []
    for j in wu.jobs:
      if j.executable not in packages:
        packages[j.executable] = len(ordered)
        ordered.append(_package_of(j.executable, bazel_args))
      pkg = ordered[packages[j.executable]]
      env = {discovery.JOBS_JSON: path, discovery.JOB_NAME: j.name, discovery.WORK_UNIT: str(i),
             discovery.EXPERIMENT_DIR: exp_dir}
      if not isinstance(j.executable, spec.Command):
        # Python programs import from the workspace root, as under the local executor.
        env["PYTHONPATH"] = repo_root
        env["PYTHONUNBUFFERED"] = "1"
      env.update(j.env)
      jobs.append(JobPlan(j.name, packages[j.executable], pkg.args + tuple(j.argv_args), env))
    units.append(tuple(jobs))
  return Plan(tuple(ordered), tuple(units), tuple(files))


def to_xm(p: Plan) -> tuple[list[Any], list[Any]]:
  """(packageables, per-work-unit job factories) as real xm objects.

  Each factory takes the list of packaged executables and returns an `xm.JobGroup`.
  """
  xm, xm_local = _require()
  spec_ = xm_local.LocalSpec()
  packageables = []
  for pk in p.packages:
    if pk.kind == "bazel_binary":
      packageables.append(xm.bazel_binary(executor_spec=spec_, label=pk.target,
                                          bazel_args=list(pk.bazel_args)))
    else:
      packageables.append(xm.binary(executor_spec=spec_, path=pk.target))

  def group_factory(jobs):
    def make(executables):
      return xm.JobGroup(**{
          jp.name: xm.Job(executable=executables[jp.package], executor=xm_local.Local(),
                          args=list(jp.args), env_vars=dict(jp.env))
          for jp in jobs})
    return make

  return packageables, [group_factory(u) for u in p.work_units]


def launch(experiment: spec.Experiment, exp_dir: str, *, bazel_args: Sequence[str] = (),
           repo_root: Optional[str] = None) -> Any:
  """Runs the experiment under xm_local; returns the xm experiment (its work units are async)."""
  _, xm_local = _require()
  from absl import flags  # pylint: disable=g-import-not-at-top  (an xmanager dependency)
  if not flags.FLAGS.is_parsed():  # xm_local reads its flags (e.g. --xm_bazel_command)
    flags.FLAGS.mark_as_parsed()  # defaults, when not started by `xmanager launch`/absl.app
  os.makedirs(exp_dir, exist_ok=True)
  p = plan(experiment, exp_dir, repo_root=repo_root, bazel_args=bazel_args)
  packageables, groups = to_xm(p)
  with xm_local.create_experiment(experiment_title=experiment.name) as xp:
    executables = xp.package(packageables)
    for make in groups:
      xp.add(make(executables))
  return xp
