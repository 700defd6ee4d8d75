"""The fleet: runs many episodes (or any sandbox jobs) over warm sandbox pools.

A job is a picklable, module-level function `fn(host, payload)` plus a unique `job_id`; `host`
(a `Host`) gives it the warm pool of the machine it landed on. Backends:

  * `LocalFleet` (the default): one warm pool on this machine and a bounded thread pool.
  * `fleet_ray.RayFleet`: one actor per host, each with its own warm pool; jobs of a host that
    dies are retried on another; results are keyed by job id, so nothing is lost or counted
    twice.

Both return {job_id: JobResult}. A job function that raises is the job's failure (reported in
`JobResult.error`, not retried); a host that dies is the fleet's (retried).

Ready-made job function: `sandbox_job` (one sandboxed command). The episode jobs, which run the
harness, are in `envs.harness.fleet_jobs`, so the fleet does not import the harness above it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import traceback
from typing import Any, Callable, Iterable

from envs.sandbox import api
from envs.sandbox import pool as pool_lib


@dataclasses.dataclass
class Host:
  """What a job sees of the machine it runs on."""
  host_id: str
  pool: pool_lib.WarmPool


@dataclasses.dataclass(frozen=True)
class Job:
  job_id: str
  fn: Callable[[Host, Any], Any]
  payload: Any = None


@dataclasses.dataclass
class JobResult:
  job_id: str
  value: Any
  host_id: str
  attempts: int = 1
  error: str | None = None


def execute(host: Host, job: Job, attempt: int = 1) -> JobResult:
  """Runs one job on `host`, turning an exception into `JobResult.error`."""
  try:
    return JobResult(job.job_id, job.fn(host, job.payload), host.host_id, attempt)
  except Exception as e:  # pylint: disable=broad-except
    tb = traceback.format_exc(limit=3)
    return JobResult(job.job_id, None, host.host_id, attempt,
                     error=f"{type(e).__name__}: {e}\n{tb}")


class LocalFleet:
  """Jobs on this machine: a warm pool and at most `concurrency` jobs at once.

  Memory is bounded for any burst: jobs wait in the queue, at most `concurrency` run, and the
  pool caps live sandboxes at `max_live`.
  """

  def __init__(self, *, pool_size: int = 4, concurrency: int = 4, max_live: int | None = None,
               allow_degraded: bool = False, pool: pool_lib.WarmPool | None = None):
    self._own_pool = pool is None
    self.pool = pool or pool_lib.WarmPool(size=pool_size, max_live=max_live or 2 * concurrency,
                                          allow_degraded=allow_degraded)
    self.host = Host("local", self.pool)
    self.concurrency = concurrency

  def run(self, jobs: Iterable[Job], *, on_result: Callable[[JobResult], None] | None = None
          ) -> dict[str, JobResult]:
    results: dict[str, JobResult] = {}
    lock = threading.Lock()
    sem = threading.BoundedSemaphore(self.concurrency * 2)

    def one(job):
      try:
        r = execute(self.host, job)
      finally:
        sem.release()
      with lock:
        if job.job_id in results:
          raise ValueError(f"duplicate job id {job.job_id!r}")
        results[job.job_id] = r
      if on_result:
        on_result(r)

    with concurrent.futures.ThreadPoolExecutor(self.concurrency) as ex:
      futures = []
      for job in jobs:
        sem.acquire()  # Back-pressure: the job iterable is consumed as capacity frees up.
        futures.append(ex.submit(one, job))
      for f in futures:
        f.result()
    return results

  def close(self) -> None:
    if self._own_pool:
      self.pool.close()

  def __enter__(self) -> "LocalFleet":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# -- ready-made jobs ------------------------------------------------------------------------------


def sandbox_job(host: Host, payload: dict) -> dict:
  """payload: {"files", "command", **limits} -> the sandbox Result as a dict."""
  kw = dict(payload)
  r = api.run(kw.pop("files", {}), kw.pop("command"), pool=host.pool, **kw)
  return dataclasses.asdict(r)
