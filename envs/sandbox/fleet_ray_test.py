"""The Ray backend on a local Ray cluster: a host killed mid-run loses and duplicates nothing,
whether jobs come as a batch (`run`) or one per thread (`call`)."""

import sys
import threading
import time

import pytest

from envs.sandbox import fleet
from envs.sandbox import fleet_ray


@pytest.fixture(scope="module")
def ray_fleet():
  f = fleet_ray.RayFleet(num_hosts=3, pool_size=1, concurrency_per_host=2)
  yield f
  f.close()
  f.ray.shutdown()


def _jobs(n, sleep_s):
  code = "import sys, time\ntime.sleep({s})\nprint(sys.argv[1])\n"
  return [fleet.Job(f"j{i}", fleet.sandbox_job,
                    {"files": {"m.py": code.format(s=sleep_s)},
                     "command": ["python3", "m.py", f"out-{i}"]})
          for i in range(n)]


def test_spreads_over_hosts(ray_fleet):
  results = ray_fleet.run(_jobs(12, 0.05))
  assert sorted(results) == sorted(f"j{i}" for i in range(12))
  assert all(r.value["stdout"] == f"out-{r.job_id[1:]}\n" for r in results.values())
  assert len({r.host_id for r in results.values()}) >= 2


def test_killed_host_jobs_retried_elsewhere_exactly_once(ray_fleet):
  seen = []
  victim = sorted(ray_fleet.hosts)[0]

  def on_result(r):
    seen.append(r.job_id)
    if len(seen) == 3:
      ray_fleet.kill_host(victim)

  results = ray_fleet.run(_jobs(30, 0.3), on_result=on_result)
  assert sorted(results) == sorted(f"j{i}" for i in range(30))
  assert len(seen) == len(set(seen)) == 30  # Each result reported once.
  for r in results.values():
    assert r.error is None, r.error
    assert r.value["stdout"] == f"out-{r.job_id[1:]}\n"
  retried = [r for r in results.values() if r.attempts > 1]
  assert retried and all(r.host_id != victim for r in retried)
  assert ray_fleet.stats["host_failures"] == 1 and ray_fleet.stats["retried"] == len(retried)
  assert victim not in ray_fleet.hosts and len(ray_fleet.hosts) == 3  # Replaced.


def test_call_from_many_threads_survives_a_killed_host(ray_fleet):
  """`call` (one job, blocking; the pipeline's grading threads use it): a host killed while it
  holds jobs has them re-run on another host, each caller gets exactly its own result, and
  the death is counted and replaced once however many callers saw it."""
  before = dict(ray_fleet.stats)
  jobs = _jobs(16, 0.3)
  results, killed = {}, []
  lock = threading.Lock()

  def one(job):
    r = ray_fleet.call(job)
    with lock:
      assert job.job_id not in results
      results[job.job_id] = r

  def kill_a_busy_host():
    while len(results) < len(jobs):
      busy = ray_fleet.inflight()
      if len(results) >= 2 and busy:
        victim = max(busy, key=busy.get)
        ray_fleet.kill_host(victim)
        killed.append(victim)
        return
      time.sleep(0.005)

  threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
  threads.append(threading.Thread(target=kill_a_busy_host))
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert len(killed) == 1 and sorted(results) == sorted(j.job_id for j in jobs)
  for r in results.values():
    assert r.error is None, r.error
    assert r.value["stdout"] == f"out-{r.job_id[1:]}\n"
  retried = [r for r in results.values() if r.attempts > 1]
  assert retried and all(r.host_id != killed[0] for r in retried)
  assert ray_fleet.stats["host_failures"] == before.get("host_failures", 0) + 1
  assert ray_fleet.stats["retried"] - before.get("retried", 0) == len(retried)
  assert killed[0] not in ray_fleet.hosts and len(ray_fleet.hosts) == 3
  assert ray_fleet.inflight() == {}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
