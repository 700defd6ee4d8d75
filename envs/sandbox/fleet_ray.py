"""The Ray fleet backend: sandboxes spread over hosts, host failures retried elsewhere.

One `_HostActor` per host, each owning a warm pool on its machine (actors request no CPUs, so
several can share a small test cluster). Hosts are spread over the cluster's nodes (Ray's
SPREAD strategy) among those that have the custom resources each host asks for
(`host_resources`, e.g. a label only worker nodes carry), so a lost node takes few hosts with
it. The driver keeps a bounded number of jobs in flight per host. When a host's actor dies,
every job it held is re-queued for another live host (and a replacement actor is started if
asked); results are keyed by job id and the first result wins, so a job is never
lost and never counted twice.

Two ways in: `run(jobs)` drives a batch to the end from one thread; `call(job)` runs one job
and blocks until its result, safe from many threads at once (the pipeline's controller grades
this way, each grading thread calling it: pipeline/grading.py). Both share the host bookkeeping,
so a host's death is counted and replaced once however many jobs saw it.

Ray is imported lazily so the rest of `envs` does not depend on it.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from typing import Any, Callable, Iterable, Optional

from envs.sandbox import fleet as fleet_lib

# This file is <repo>/envs/sandbox/fleet_ray.py; actors import `envs` from the repository root.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def init_ray(address: Optional[str] = None, **kwargs):
  """Starts Ray (or joins the cluster at `address`) so that its workers import this repository.

  Without `address`, a local Ray with 2 CPUs and no dashboard (kwargs override: num_cpus,
  object_store_memory, ...); with one ("auto", "HOST:PORT", "ray://HOST:PORT"), the cluster's
  own resources. A process the Ray executor started (launch/ray_executor.py) has its cluster in
  $RAY_ADDRESS and joins it without an address: `address=None` means $RAY_ADDRESS when set,
  as for `ray.init()` itself. Either way workers get the repository root on PYTHONPATH, so
  actors import `envs` as the driver does. Returns the `ray` module; an initialised Ray is left
  as it is.
  """
  import ray  # pylint: disable=g-import-not-at-top
  if ray.is_initialized():
    return ray
  address = address or os.environ.get("RAY_ADDRESS") or None
  kw: dict = {"log_to_driver": False,
              "runtime_env": {"env_vars": {"PYTHONPATH": _REPO_ROOT}}}
  if address:
    kw["address"] = address
  else:  # "local": a new instance, never a cluster some other `ray start` left on this machine
    kw.update(address="local", num_cpus=2, include_dashboard=False)
  kw.update(kwargs)
  ray.init(**kw)
  return ray


def _actor_class(ray):
  @ray.remote(num_cpus=0)
  class _HostActor:
    """A host: a warm pool and a thread per concurrent job."""

    def __init__(self, host_id: str, pool_size: int, max_live: int, allow_degraded: bool):
      from envs.sandbox import pool as pool_lib  # pylint: disable=g-import-not-at-top
      self.host = fleet_lib.Host(host_id, pool_lib.WarmPool(
          size=pool_size, max_live=max_live, allow_degraded=allow_degraded))

    def ping(self) -> tuple:
      return self.host.host_id, os.getpid(), ray.get_runtime_context().get_node_id()

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
    host_resources: custom resources each host actor takes ({"grader_node": 1}: only on nodes
      with that label, at most as many hosts per node as it has units).
    address: the Ray cluster to join when Ray is not initialised yet (`init_ray`); None:
      $RAY_ADDRESS's, else a new local one.
    ray_init: more kwargs for `ray.init` then (e.g. num_cpus, object_store_memory).
  """

  def __init__(self, *, num_hosts: int = 2, pool_size: int = 2, concurrency_per_host: int = 2,
               max_attempts: int = 3, replace_dead_hosts: bool = True,
               allow_degraded: bool = False,
               host_resources: Optional[dict[str, float]] = None,
               address: Optional[str] = None, ray_init: dict | None = None):
    self.ray = init_ray(address, **(ray_init or {}))
    self._cls = _actor_class(self.ray)
    self.pool_size = pool_size
    self.concurrency = concurrency_per_host
    self.max_attempts = max_attempts
    self.replace_dead_hosts = replace_dead_hosts
    self.allow_degraded = allow_degraded
    self.host_resources = dict(host_resources or {})
    self._ids = itertools.count()
    self._lock = threading.Condition()
    self.hosts: dict[str, Any] = {}
    self._pings: dict[str, Any] = {}   # host id -> its ping ref (its pid, once resolved)
    self._pids: dict[str, int] = {}
    self._nodes: dict[str, str] = {}   # host id -> its Ray node's id
    self._inflight = collections.Counter()  # host id -> `call` jobs running there
    self.stats = collections.Counter()
    for _ in range(num_hosts):
      self._start_host()
    self.host_pids()  # every host up before the first job

  def _start_host(self) -> str:
    host_id = f"host-{next(self._ids)}"
    h = self._cls.options(max_concurrency=self.concurrency, max_restarts=0, name=None,
                          resources=self.host_resources or None,
                          scheduling_strategy="SPREAD").remote(
        host_id, self.pool_size, 2 * self.concurrency + self.pool_size, self.allow_degraded)
    self.hosts[host_id] = h
    self._pings[host_id] = h.ping.remote()
    return host_id

  def host_pids(self) -> dict[str, int]:
    """{host id: its actor's process id} of every host started so far (the dead included):
    where jobs ran, to tell a Ray actor's work from the driver's."""
    with self._lock:
      waiting = {h: r for h, r in self._pings.items() if h not in self._pids}
    for h, ref in waiting.items():
      try:
        _, pid, node = self.ray.get(ref, timeout=120)
      except Exception:  # pylint: disable=broad-except
        continue  # died before it answered: it ran nothing
      with self._lock:
        self._pids[h] = pid
        self._nodes[h] = node
    with self._lock:
      return dict(self._pids)

  def host_nodes(self) -> dict[str, str]:
    """{host id: the Ray node id it runs (ran) on} of every host that answered so far."""
    self.host_pids()
    with self._lock:
      return dict(self._nodes)

  def kill_host(self, host_id: str) -> None:
    """Kills a host's actor (and with it every sandbox it runs), as a failing machine would."""
    self.ray.kill(self.hosts[host_id], no_restart=True)

  def inflight(self) -> dict[str, int]:
    """{host id: jobs `call` has running there now}."""
    with self._lock:
      return {h: n for h, n in self._inflight.items() if n and h in self.hosts}

  def _host_died(self, host_id: str) -> None:
    """Forgets a dead host (once, whoever saw it first) and starts its replacement."""
    with self._lock:
      if host_id not in self.hosts:
        return
      del self.hosts[host_id]
      self.stats["host_failures"] += 1
      if self.replace_dead_hosts:
        self._start_host()
      self._lock.notify_all()

  # -- one job, from any thread --------------------------------------------------------------
  def call(self, job: fleet_lib.Job) -> fleet_lib.JobResult:
    """Runs `job` on the least busy live host and returns its result, retrying it on another
    host when its host dies (up to `max_attempts` tries; then a JobResult with `error`).

    Thread-safe. A host takes at most 2 x concurrency_per_host jobs at once; callers beyond
    that wait here."""
    actor_errors = (self.ray.exceptions.RayActorError,)
    attempt, avoid = 1, None
    while True:
      with self._lock:
        while True:
          live = list(self.hosts)
          if not live:
            raise RuntimeError("every host died")
          choices = [h for h in live if self._inflight[h] < 2 * self.concurrency
                     and (h != avoid or len(live) == 1)]
          if choices:
            break
          self._lock.wait(0.5)
        h = min(choices, key=lambda x: self._inflight[x])
        self._inflight[h] += 1
        handle = self.hosts[h]
      try:
        r = self.ray.get(handle.run.remote(job, attempt))
      except actor_errors as e:
        self._host_died(h)
        if attempt >= self.max_attempts:
          return fleet_lib.JobResult(job.job_id, None, h, attempt,
                                     error=f"host failures on every attempt: {e}")
        with self._lock:
          self.stats["retried"] += 1
        attempt, avoid = attempt + 1, h
        continue
      finally:
        with self._lock:
          self._inflight[h] -= 1
          self._lock.notify_all()
      with self._lock:
        self.stats["completed"] += 1
      return r

  # -- a batch, from one thread --------------------------------------------------------------
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
    cap = 2 * self.concurrency  # Bounded backlog per host: memory stays flat for any burst.
    while pending or inflight:
      with self._lock:
        live = dict(self.hosts)
      if not live:
        raise RuntimeError("every host died")
      for _ in range(len(pending)):
        job, attempt, avoid = pending[0]
        choices = [h for h in live if per_host[h] < cap and (h != avoid or len(live) == 1)]
        if not choices:
          break
        pending.popleft()
        h = min(choices, key=lambda x: per_host[x])
        ref = live[h].run.remote(job, attempt)
        inflight[ref] = (job, attempt, h)
        per_host[h] += 1
      ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
      for ref in ready:
        job, attempt, h = inflight.pop(ref)
        per_host[h] -= 1
        try:
          r = ray.get(ref)
        except actor_errors as e:
          self._host_died(h)
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
        self.stats["completed"] += 1
        if on_result:
          on_result(r)
    return results

  def close(self) -> None:
    with self._lock:
      handles = list(self.hosts.values())
      self.hosts.clear()
    try:
      self.ray.get([h.shutdown.remote() for h in handles], timeout=30)
    except Exception:  # pylint: disable=broad-except
      pass  # A host that is already gone has nothing to shut down.
    for h in handles:
      try:
        self.ray.kill(h, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass
    time.sleep(0.1)
