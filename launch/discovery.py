"""How a running job finds the other jobs of its work unit by name.

The executor reserves a TCP port for each job, writes the work unit's address map to a JSON file
and starts every job with:

  LAUNCH_JOBS_JSON      path of {"jobs": {name: {"host", "port"}}, "work_unit": i,
                        "experiment": name, "params": {...}}
  LAUNCH_JOB_NAME       this job's name
  LAUNCH_WORK_UNIT      this work unit's index
  LAUNCH_EXPERIMENT_DIR where logs and status go

So a sampler connects to `discovery.address_of("learner")` and the learner listens on
`discovery.my_port()` of `discovery.my_host()`, whatever executor started them. A file (not one
env var per peer) keeps the environment small for large work units and lets any language read it.

The executors fill the file differently, and jobs cannot tell them apart:
  * local (launch.local) and xm_local (launch.xm_adapter): every job on this machine, its port
    reserved before the work unit starts; the file never changes.
  * Ray (launch.ray_executor): each job runs under its own Ray actor on whichever node the
    placement group gave it; the actor reserves a port on its node, registers "host:port" with
    the run's registry actor (a named actor, the one place addresses live) and keeps a
    node-local copy of the registry's table in this file. A job restarted on another node (its
    node died) registers its new address, and every other job's copy follows within a second,
    so a caller that asks again (`address_of` reads the file on every call) reaches the new
    one: a controller re-resolves a sampler that went down before probing it again.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Mapping, Optional

JOBS_JSON = "LAUNCH_JOBS_JSON"
JOB_NAME = "LAUNCH_JOB_NAME"
WORK_UNIT = "LAUNCH_WORK_UNIT"
EXPERIMENT_DIR = "LAUNCH_EXPERIMENT_DIR"


class DiscoveryError(RuntimeError):
  """Not started by a launcher, or the named job does not exist."""


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (the OS picks it; the job binds it soon after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def write_jobs_file(path: str, jobs: Mapping[str, Mapping[str, Any]], **extra) -> None:
  """Writes the address map atomically (jobs may start reading it at once)."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"jobs": {k: dict(v) for k, v in jobs.items()}, **extra}, f, indent=1,
              sort_keys=True)
  os.replace(tmp, path)


def work_unit_info(env: Optional[Mapping[str, str]] = None) -> dict:
  """The whole JSON document of this work unit."""
  env = os.environ if env is None else env
  path = env.get(JOBS_JSON)
  if not path:
    raise DiscoveryError(f"${JOBS_JSON} is not set: this process was not started by a launcher")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise DiscoveryError(f"cannot read ${JOBS_JSON}={path!r}: {e}") from e


def jobs(env: Optional[Mapping[str, str]] = None) -> dict[str, dict]:
  """{job name: {"host", "port"}} of this work unit."""
  return work_unit_info(env)["jobs"]


def _entry(name: str, env) -> dict:
  table = jobs(env)
  if name not in table:
    raise DiscoveryError(f"no job {name!r} in this work unit (have {sorted(table)})")
  e = table[name]
  if e.get("port") is None:
    raise DiscoveryError(f"job {name!r} has no port (its Job was created with port=False)")
  return e


def address_of(name: str, env: Optional[Mapping[str, str]] = None) -> str:
  """"host:port" of the job called `name`."""
  e = _entry(name, env)
  return f"{e['host']}:{e['port']}"


def host_port_of(name: str, env: Optional[Mapping[str, str]] = None) -> tuple[str, int]:
  e = _entry(name, env)
  return e["host"], int(e["port"])


def job_name(env: Optional[Mapping[str, str]] = None) -> str:
  env = os.environ if env is None else env
  if not env.get(JOB_NAME):
    raise DiscoveryError(f"${JOB_NAME} is not set: this process was not started by a launcher")
  return env[JOB_NAME]


def my_port(env: Optional[Mapping[str, str]] = None) -> int:
  """The port reserved for this job (bind it on `my_host()`)."""
  return host_port_of(job_name(env), env)[1]


def my_host(env: Optional[Mapping[str, str]] = None) -> str:
  """The address peers reach this job at (127.0.0.1 locally, the node's IP on a cluster): the
  host a server of this job binds, so that peers on other nodes can connect."""
  return host_port_of(job_name(env), env)[0]


def under_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
  """Whether a launcher started this process (its address map is there to ask)."""
  env = os.environ if env is None else env
  return bool(env.get(JOBS_JSON) and env.get(JOB_NAME))
