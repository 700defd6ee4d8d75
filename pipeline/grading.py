"""Where the controller's sandboxes come from: this machine's warm pool, or a Ray fleet for
grading (`PipelineConfig.grader`).

`open_sandboxes(config, ...)` is the one place that builds them, for the in-process pipeline
(pipeline/local.py, and the experiment through it) and the multi-process controller
(pipeline/processes.py run_controller) alike:

  * grader "local": the warm pool on this machine runs the agent's tools and grades every
    attempt (envs.reward.grade), as before.
  * grader "ray": grading goes to an `envs.sandbox.fleet_ray.RayFleet` -- one actor per host,
    each with its own warm pool, `grader_hosts` of them, on the Ray cluster at `ray_address`
    (or $RAY_ADDRESS's, which the Ray executor sets for the parts it starts, or a local Ray),
    spread over the nodes with `grader_resources`. Each grade is a fleet job
    (`envs.harness.fleet_jobs.grade_job`) submitted from the controller's grading thread
    (`RayFleet.call`); a host that dies mid-grade has its grades re-run on another host (and
    is replaced), and each attempt gets exactly one grade.
    The agent's tool calls still run in the local pool: an episode holds one sandbox for all
    its turns, each a round trip to the sampler, so moving it would put every tool call's
    files and output on the network and lose the episode with its host; grading is a single
    self-contained job (final files in, Grade out), the part that fans out.

The grades' provenance is counted (`Sandboxes.summary()`: grades per host, the hosts' process
ids, retries, host failures), and the pipeline puts it in its summary.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import Any, Callable, Optional

from envs import reward as reward_lib
from envs.harness import fleet_jobs
from envs.sandbox import fleet as fleet_lib
from envs.sandbox import pool as pool_lib
from pipeline.config import PipelineConfig

log = logging.getLogger(__name__)


class FleetGrader:
  """The controller's grade function (`grade_fn(task, files, pool, config, hack_flags=None)`)
  run as fleet jobs. `pool` is ignored: the fleet's host supplies the sandbox.

  A job the fleet could not finish (its hosts died on every attempt) or that raised is an
  infrastructure failure (status INFRA_ERROR, reward None): masked by the learner, never
  scored as a wrong answer.
  """

  def __init__(self, fleet):
    self.fleet = fleet
    self._ids = itertools.count()
    self._lock = threading.Lock()
    self.by_host: collections.Counter = collections.Counter()
    self.job_ids: list[str] = []   # every grade returned, in order (each once)
    self.retried_grades = 0        # grades that needed more than one attempt
    self.infra_errors = 0

  def __call__(self, task, files, pool=None, config=reward_lib.RewardConfig(),
               hack_flags=None) -> reward_lib.Grade:
    del pool
    job_id = f"grade-{next(self._ids)}-{task.task_id}"
    payload = {"task": task, "files": dict(files), "config": config}
    if hack_flags:
      payload["hack_flags"] = {k: list(v) for k, v in hack_flags.items()}
    try:
      r = self.fleet.call(fleet_lib.Job(job_id, fleet_jobs.grade_job, payload))
      error = r.error
    except Exception as e:  # pylint: disable=broad-except
      r, error = None, f"{type(e).__name__}: {e}"
    with self._lock:
      self.job_ids.append(job_id)
      if r is not None:
        self.by_host[r.host_id] += 1
        self.retried_grades += r.attempts > 1
      if error is not None:
        self.infra_errors += 1
    if error is not None:
      log.warning("grade %s failed in the fleet: %s", job_id, error)
      return reward_lib.Grade(reward_lib.INFRA_ERROR, None, None, {},
                              {k: list(v) for k, v in (hack_flags or {}).items()},
                              f"fleet: {error}")
    return r.value

  def summary(self) -> dict:
    with self._lock:
      return {"grades": len(self.job_ids), "grades_by_host": dict(self.by_host),
              "retried_grades": self.retried_grades, "fleet_errors": self.infra_errors}


@dataclasses.dataclass
class Sandboxes:
  """What the controller runs in: `pool` (the agent's tools; grading too when `grade_fn` is
  None) and `grade_fn` (the controller's grade function, or None for envs.reward.grade on
  `pool`). `fleet`: the Ray fleet grading goes to (None when local)."""
  grader: str
  pool: Any
  grade_fn: Optional[Callable] = None
  fleet: Any = None
  _own_pool: bool = False

  def summary(self) -> dict:
    """{"grader": ...}; with a fleet also the grades per host, the hosts' process ids (each a
    Ray actor's, not this process's), retries and host failures."""
    out: dict = {"grader": self.grader}
    if self.fleet is not None:
      out.update(self.grade_fn.summary())
      out["host_pids"] = self.fleet.host_pids()
      out["host_nodes"] = self.fleet.host_nodes()
      out["hosts_live"] = len(self.fleet.hosts)
      out["host_failures"] = int(self.fleet.stats["host_failures"])
      out["jobs_retried"] = int(self.fleet.stats["retried"])
    return out

  def close(self) -> None:
    if self.fleet is not None:
      self.fleet.close()
    if self._own_pool:
      self.pool.close()


def open_sandboxes(config: PipelineConfig, *, pool=None, pool_size: int = 4) -> Sandboxes:
  """The controller's sandboxes as `config.grader` says (see the module docstring).

  Args:
    config: PipelineConfig (grader, grader_hosts, grader_pool, ray_address, grade_workers).
    pool: a warm pool the caller owns (and closes), e.g. the experiment's, shared with
      evaluation; None starts one of `pool_size` sandboxes, closed with the Sandboxes.
    pool_size: warm sandboxes of the pool started here.
  """
  own = pool is None
  if own:
    pool = pool_lib.WarmPool(size=pool_size)
  if config.grader == "local":
    return Sandboxes("local", pool, _own_pool=own)
  try:
    from envs.sandbox import fleet_ray  # pylint: disable=g-import-not-at-top
    # Each host runs up to its share of the controller's grading threads at once (and
    # queues as many again), so the grades spread over every host.
    per_host = -(-config.grade_workers // config.grader_hosts)
    fleet = fleet_ray.RayFleet(num_hosts=config.grader_hosts, pool_size=config.grader_pool,
                               concurrency_per_host=per_host,
                               host_resources=dict(config.grader_resources or {}),
                               address=config.ray_address or None)
  except BaseException:
    if own:
      pool.close()
    raise
  return Sandboxes("ray", pool, FleetGrader(fleet), fleet, _own_pool=own)
