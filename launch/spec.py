"""What to launch: an Experiment holds WorkUnits; a WorkUnit is a group of named Jobs.

This mirrors XManager's model (t5x's xm_launch.py, the xmanager examples) without depending on it:

  * A `Job` is one process: a name unique within its work unit ("learner", "sampler_0",
    "env_worker"), an executable, command-line args and environment variables.
  * An executable is a Bazel target (`BazelBinary("//tools:rl_part")`, the normal case: all
    targets are built once, then run from bazel-bin), a Python module run with the current
    interpreter (`PyModule("launch.testdata.echo_server")`, for tests and machines without Bazel),
    or a plain command (`Command(("/bin/sleep", "1"))`).
  * A `WorkUnit` is the group of jobs that run together and find each other by name
    (`launch.discovery`). Sweeps add one work unit per point of a parameter grid (`sweep`).

Args are a mapping rendered as `--key=value` flags (XManager's convention) or a sequence of
ready-made argv strings. Everything here is plain data: the executors decide how to run it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Mapping, Optional, Sequence, Union

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# //pkg/sub:name or //pkg (name = last package component); no wildcards.
_LABEL_RE = re.compile(r"^//(?P<pkg>[A-Za-z0-9_\-.]+(?:/[A-Za-z0-9_\-.]+)*)?(?::(?P<name>[A-Za-z0-9_\-.+]+))?$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class SpecError(ValueError):
  """An experiment, work unit or job is malformed (a clear message, before anything starts)."""


@dataclasses.dataclass(frozen=True)
class BazelBinary:
  """A Bazel executable target, e.g. "//tools:rl_part" (built once, run from bazel-bin)."""
  label: str

  def __post_init__(self):
    parse_label(self.label)


@dataclasses.dataclass(frozen=True)
class PyModule:
  """`python -m <module>` with the launching interpreter, from the repository root."""
  module: str

  def __post_init__(self):
    if not _MODULE_RE.match(self.module or ""):
      raise SpecError(f"not a Python module name: {self.module!r}")


@dataclasses.dataclass(frozen=True)
class Command:
  """A ready argv (its first element a program on PATH or a path)."""
  argv: tuple

  def __post_init__(self):
    if not self.argv or not all(isinstance(a, str) for a in self.argv):
      raise SpecError(f"Command argv must be a non-empty sequence of strings, got {self.argv!r}")


Executable = Union[BazelBinary, PyModule, Command]


def parse_label(label: str) -> tuple[str, str]:
  """Splits an absolute Bazel label into (package, target name); raises SpecError if malformed."""
  m = _LABEL_RE.match(label or "") if isinstance(label, str) else None
  if m is None or not (m.group("pkg") or m.group("name")):
    raise SpecError(f"not an absolute Bazel label of one target: {label!r} "
                    "(expected //package:name)")
  pkg = m.group("pkg") or ""
  if any(part in (".", "..", "...") for part in pkg.split("/")):
    raise SpecError(f"{label!r}: wildcards and relative components are not one target")
  name = m.group("name") or pkg.rsplit("/", 1)[-1]
  if name == "all":
    raise SpecError(f"{label!r}: ':all' is not one target")
  return pkg, name


def render_args(args: Union[Mapping[str, Any], Sequence[str]]) -> list[str]:
  """A mapping -> ["--k=v", ...] (bools as true/false, lists comma-joined); a sequence as is.

  Gin bindings travel the same way: {"gin.Trainer.lr": 1e-3} -> "--gin.Trainer.lr=0.001", the
  form the tools/ entry points accept.
  """
  if isinstance(args, Mapping):
    out = []
    for k, v in args.items():
      if not isinstance(k, str) or not k:
        raise SpecError(f"arg names must be non-empty strings, got {k!r}")
      if isinstance(v, bool):
        v = "true" if v else "false"
      elif isinstance(v, (list, tuple)):
        v = ",".join(str(x) for x in v)
      out.append(f"--{k}={v}")
    return out
  if isinstance(args, str):
    raise SpecError("args must be a mapping or a sequence of strings, not one string")
  if not all(isinstance(a, str) for a in args):
    raise SpecError(f"args must be strings, got {list(args)!r}")
  return list(args)


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one job needs of a machine, as a cluster executor (launch.ray_executor) places it.

  The local executor runs every job on this machine and does not check them; the Ray executor
  reserves them per job in one placement group, so a part lands only on a node that has them.

  Attributes:
    num_cpus: logical CPUs.
    num_gpus: GPUs (the job sees only its own: CUDA_VISIBLE_DEVICES).
    memory: bytes of memory.
    custom: other named resources (a node's "TPU", or a label such as {"sampler_host": 1}).
  """
  num_cpus: float = 1.0
  num_gpus: float = 0.0
  memory: int = 0
  custom: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    amounts = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "memory": self.memory,
               **dict(self.custom)}
    for k, v in amounts.items():
      if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise SpecError(f"resource {k!r} must be a number >= 0, got {v!r}")
    if not any(amounts.values()):
      raise SpecError("a job must need some resource (a placement group bundle cannot be empty)")

  def bundle(self) -> dict:
    """The job's placement group bundle ({"CPU": 1, "GPU": 0.5, "memory": ..., custom...})."""
    out = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory, **self.custom}
    return {k: v for k, v in out.items() if v}


@dataclasses.dataclass(frozen=True)
class Job:
  """One named process of a work unit.

  Attributes:
    name: unique within the work unit; peers look it up by this name.
    executable: BazelBinary, PyModule or Command.
    args: a mapping (rendered `--key=value`) or a sequence of argv strings.
    env: extra environment variables.
    port: whether the executor reserves a TCP port for this job (published to peers).
    resources: what the job needs of its machine (used by cluster executors).
    max_restarts: times a cluster executor starts the job again after it failed or its node
      died (0: a failure is final, as under the local executor).
    gang: jobs of one gang are restarted together (the processes of one jax.distributed
      learner: one cannot rejoin the others' runtime alone).
    service: the job serves the others (a sampler, a relay) and runs until stopped: once every
      job of its work unit that is not a service has ended, the executor stops it, and a
      service stopped so counts as succeeded.
  """
  name: str
  executable: Executable
  args: Union[Mapping[str, Any], Sequence[str]] = ()
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  port: bool = True
  resources: Resources = dataclasses.field(default_factory=Resources)
  max_restarts: int = 0
  gang: Optional[str] = None
  service: bool = False

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
      raise SpecError(f"job name {self.name!r} must match {_NAME_RE.pattern}")
    if not isinstance(self.executable, (BazelBinary, PyModule, Command)):
      raise SpecError(f"job {self.name!r}: executable must be BazelBinary, PyModule or Command, "
                      f"got {self.executable!r}")
    render_args(self.args)
    if not isinstance(self.resources, Resources):
      raise SpecError(f"job {self.name!r}: resources must be a Resources, got {self.resources!r}")
    if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or \
        self.max_restarts < 0:
      raise SpecError(f"job {self.name!r}: max_restarts must be an int >= 0")
    for k, v in dict(self.env).items():
      if not isinstance(k, str) or not isinstance(v, str):
        raise SpecError(f"job {self.name!r}: env must map strings to strings ({k!r}={v!r})")

  @property
  def argv_args(self) -> list[str]:
    return render_args(self.args)

  def with_overrides(self, args: Mapping[str, Any]) -> "Job":
    """A copy with `args` merged in (mapping args) or appended as flags (sequence args)."""
    if not args:
      return self
    if isinstance(self.args, Mapping):
      return dataclasses.replace(self, args={**self.args, **args})
    return dataclasses.replace(self, args=list(self.args) + render_args(args))


@dataclasses.dataclass(frozen=True)
class WorkUnit:
  """Jobs that run together. `params` records the sweep point that made this unit."""
  jobs: tuple
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.jobs:
      raise SpecError("a work unit needs at least one job")
    names = [j.name for j in self.jobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
      raise SpecError(f"job names must be unique within a work unit; repeated: {dup}")

  def job(self, name: str) -> Job:
    for j in self.jobs:
      if j.name == name:
        return j
    raise KeyError(f"no job {name!r} in this work unit (have {[j.name for j in self.jobs]})")


@dataclasses.dataclass(frozen=True)
class Experiment:
  name: str
  work_units: tuple

  def __post_init__(self):
    if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.\-]+$", self.name):
      raise SpecError(f"experiment name {self.name!r} must match [A-Za-z0-9_.-]+")
    if not self.work_units:
      raise SpecError(f"experiment {self.name!r} has no work units")

  @property
  def bazel_labels(self) -> list[str]:
    """Every Bazel target the experiment runs, once each, in first-use order."""
    seen = {}
    for wu in self.work_units:
      for j in wu.jobs:
        if isinstance(j.executable, BazelBinary):
          seen.setdefault(j.executable.label, None)
    return list(seen)


def grid(axes: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
  """The Cartesian product of `axes` as a list of points (first axis varies slowest)."""
  for k, vs in axes.items():
    if isinstance(vs, (str, bytes)) or not isinstance(vs, Sequence) or not vs:
      raise SpecError(f"sweep axis {k!r} must be a non-empty list of values, got {vs!r}")
  keys = list(axes)
  return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def _target_of(key: str, job_names: Sequence[str]) -> tuple[Optional[str], str]:
  """'learner.lr' -> ('learner', 'lr'); 'lr' -> (None, 'lr') = every job."""
  head, dot, rest = key.partition(".")
  if dot and head in job_names:
    return head, rest
  return None, key


def sweep(name: str, jobs: Sequence[Job], points: Sequence[Mapping[str, Any]] = ({},)
          ) -> Experiment:
  """An experiment with one work unit of `jobs` per sweep point.

  A point maps arg names to values. "job.arg" sets the arg of that job only; a bare "arg" is
  given to every job (e.g. a gin binding shared by learner and samplers). Example: a 2x2 grid
  `grid({"learner.lr": [1e-4, 3e-4], "seed": [0, 1]})` makes 4 work units.
  """
  names = [j.name for j in jobs]
  units = []
  for point in points:
    per_job: dict[Optional[str], dict[str, Any]] = {}
    for k, v in point.items():
      target, arg = _target_of(k, names)
      per_job.setdefault(target, {})[arg] = v
    new_jobs = tuple(j.with_overrides({**per_job.get(None, {}), **per_job.get(j.name, {})})
                     for j in jobs)
    units.append(WorkUnit(jobs=new_jobs, params=dict(point)))
  return Experiment(name=name, work_units=tuple(units))
