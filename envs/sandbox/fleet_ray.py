"""The Ray fleet backend: sandboxes spread over hosts, host failures retried elsewhere.

One `_HostActor` per host, each owning a warm pool on its machine (actors request no CPUs, so
several can share a small test cluster; on a real cluster pin one per node with resources or a
placement group). The driver keeps a bounded number of jobs in flight per host. When a host's
actor dies, every job it held is re-queued for another live host (and a replacement actor is
started if asked); results are keyed by job id and the first result wins, so a job is never
lost and never counted twice.

Ray is imported lazily so the rest of `envs` does not depend on it.
"""

from __future__ import annotations

import collections
import itertools
import os
import time
from typing import Any, Callable, Iterable

from envs.sandbox import fleet as fleet_lib

# This file is <repo>/envs/sandbox/fleet_ray.py; actors import `envs` from the repository root.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _actor_class(ray):
  @ray.remote(num_cpus=0)
  class _HostActor:
    """A host: a warm pool and a thread per concurrent job."""

    def __init__(self, host_id: str, pool_size: int, max_live: int, allow_degraded: bool):
      from envs.sandbox import pool as pool_lib  # pylint: disable=g-import-not-at-top
      self.host = fleet_lib.Host(host_id, pool_lib.WarmPool(
          size=pool_size, max_live=max_live, allow_degraded=allow_degraded))

    def ping(self) -> str:
      return self.host.host_id

    def pid(self) -> int:
      return os.getpid()

    def run(self, job: fleet_lib.Job, attempt: int) -> fleet_lib.JobResult:
      return fleet_lib.execute(self.host, job, attempt)

    def shutdown(self) -> None:
      self.host.pool.close()

  return _HostActor


class RayFleet:
  """Runs jobs on Ray actors, one warm pool per actor.

  Args:
    num_hosts: actors to start.
    pool_size: warm sandboxes per host.
    concurrency_per_host: jobs running at once on a host (the actor's thread count).
    max_attempts: tries per job across host failures.
    replace_dead_hosts: start a new actor when one dies.
    ray_init: kwargs for `ray.init` when Ray is not initialised yet (default: a local cluster
      with 2 CPUs).
  """

  def __init__(self, *, num_hosts: int = 2, pool_size: int = 2, concurrency_per_host: int = 2,
               max_attempts: int = 3, replace_dead_hosts: bool = True,
               allow_degraded: bool = False, ray_init: dict | None = None):
    import ray  # pylint: disable=g-import-not-at-top
    self.ray = ray
    if not ray.is_initialized():
      kw = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": _REPO_ROOT}}}
      kw.update(ray_init or {})
      ray.init(**kw)
    self._cls = _actor_class(ray)
    self.pool_size = pool_size
    self.concurrency = concurrency_per_host
    self.max_attempts = max_attempts
    self.replace_dead_hosts = replace_dead_hosts
    self.allow_degraded = allow_degraded
    self._ids = itertools.count()
    self.hosts: dict[str, Any] = {}
    self.stats = collections.Counter()
    for _ in range(num_hosts):
      self._start_host()
    ray.get([h.ping.remote() for h in self.hosts.values()])

  def _start_host(self) -> str:
    host_id = f"host-{next(self._ids)}"
    self.hosts[host_id] = self._cls.options(
        max_concurrency=self.concurrency, max_restarts=0, name=None).remote(
            host_id, self.pool_size, 2 * self.concurrency + self.pool_size, self.allow_degraded)
    return host_id

  def kill_host(self, host_id: str) -> None:
    """Kills a host's actor (and with it every sandbox it runs), as a failing machine would."""
    self.ray.kill(self.hosts[host_id], no_restart=True)

  def run(self, jobs: Iterable[fleet_lib.Job], *,
          on_result: Callable[[fleet_lib.JobResult], None] | None = None
          ) -> dict[str, fleet_lib.JobResult]:
    ray = self.ray
    actor_errors = (ray.exceptions.RayActorError,)
    pending = collections.deque((job, 1, None) for job in jobs)  # (job, attempt, avoid host)
    ids = [j.job_id for j, _, _ in pending]
    if len(set(ids)) != len(ids):
      raise ValueError("job ids must be unique")
    inflight: dict[Any, tuple[fleet_lib.Job, int, str]] = {}
    per_host = collections.Counter()
    results: dict[str, fleet_lib.JobResult] = {}
    dead: set[str] = set()
    cap = 2 * self.concurrency  # Bounded backlog per host: memory stays flat for any burst.
    while pending or inflight:
      live = [h for h in self.hosts if h not in dead]
      if not live:
        raise RuntimeError("every host died")
      for _ in range(len(pending)):
        job, attempt, avoid = pending[0]
        choices = [h for h in live if per_host[h] < cap and (h != avoid or len(live) == 1)]
        if not choices:
          break
        pending.popleft()
        h = min(choices, key=lambda x: per_host[x])
        ref = self.hosts[h].run.remote(job, attempt)
        inflight[ref] = (job, attempt, h)
        per_host[h] += 1
      ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
      for ref in ready:
        job, attempt, h = inflight.pop(ref)
        per_host[h] -= 1
        try:
          r = ray.get(ref)
        except actor_errors as e:
          if h not in dead:
            dead.add(h)
            self.stats["host_failures"] += 1
            if self.replace_dead_hosts:
              self._start_host()
          if attempt < self.max_attempts:
            self.stats["retried"] += 1
            pending.appendleft((job, attempt + 1, h))
          else:
            r = fleet_lib.JobResult(job.job_id, None, h, attempt,
                                    error=f"host failures on every attempt: {e}")
            results.setdefault(job.job_id, r)
          continue
        if r.job_id in results:
          self.stats["duplicates_dropped"] += 1
          continue
        results[r.job_id] = r
        if on_result:
          on_result(r)
    for h in dead:
      self.hosts.pop(h, None)
    return results

  def close(self) -> None:
    handles = list(self.hosts.values())
    try:
      self.ray.get([h.shutdown.remote() for h in handles], timeout=30)
    except Exception:  # pylint: disable=broad-except
      pass  # A host that is already gone has nothing to shut down.
    for h in handles:
      try:
        self.ray.kill(h, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass
    self.hosts.clear()
    time.sleep(0.1)
