"""The pipeline grading in a Ray sandbox fleet (PipelineConfig.grader = "ray", pipeline/grading.py)
on a real local Ray, one instance for the module (Ray starts slowly on 2 cores).

Proof that the grades came from Ray actors: the fleet counts each grade under the host that
returned it, and every such host is an actor process other than the driver's. A host killed
while it grades (in the in-process pipeline, pipeline.local.run): its grades are re-run on
another host, no episode is lost or graded twice, and the run trains every episode. The
multi-process controller (pipeline.processes.run_controller, the `rl_part controller` part)
joins the same Ray cluster by its address and grades there.
"""

import dataclasses
import json
import os
import signal
import sys
import threading
import time

import pytest

from envs.sandbox import fleet_ray
from envs.sandbox import pool as pool_lib
from pipeline import grading
from pipeline import local
from pipeline import testing
from rl import trajectory_io


@pytest.fixture(scope="module")
def ray_module():
  ray = fleet_ray.init_ray(num_cpus=2, object_store_memory=100 * 1024 * 1024)
  yield ray
  ray.shutdown()


@pytest.fixture(scope="module")
def pool():
  p = pool_lib.WarmPool(size=2)  # the agent's tools (single-turn tasks use none)
  yield p
  p.close()


def _written(workdir):
  d = os.path.join(workdir, "trajectories")
  return [r for name in trajectory_io.list_shards(d)
          for r in trajectory_io.read_shard(os.path.join(d, name))]


def _check_every_episode_once(res, workdir, cfg, steps):
  """Each attempt written once, graded once (by the fleet), none lost or masked."""
  n = steps * cfg.episodes_per_step
  c = res.controller
  assert c["episodes_written"] == c["episodes_generated"] == n and c["episodes_lost"] == 0
  assert c["infra_failures"] == 0 and res.batcher["infra_failures"] == 0
  ids = [r["episode_id"] for r in _written(workdir)]
  assert len(ids) == len(set(ids)) == n
  g = res.grading
  assert g["grades"] == n and sum(g["grades_by_host"].values()) == n
  assert g["fleet_errors"] == 0
  assert res.batcher["trained_episodes"] == n


def _slow_grading(tasks, sleep_s=0.4):
  """The tasks with hidden tests that take `sleep_s` longer: a host has grades in flight for
  long enough to be killed while it holds them."""
  out = []
  for t in tasks:
    hidden = {p: f"import time\ntime.sleep({sleep_s})\n{src}" for p, src in t.hidden_tests.items()}
    out.append(dataclasses.replace(t, hidden_tests=hidden))
  return out


def test_a_host_killed_mid_grading_loses_and_repeats_nothing(ray_module, pool, tmp_path):
  cfg = testing.config(grader="ray", grader_hosts=2, grader_pool=1)
  killed = []

  def kill_a_busy_host(parts):
    fleet = parts["sandboxes"].fleet

    def watch():
      deadline = time.monotonic() + 120
      while not parts["stop"].is_set() and time.monotonic() < deadline:
        busy = fleet.inflight()
        if fleet.stats["completed"] >= 2 and busy:
          victim = max(busy, key=busy.get)
          fleet.kill_host(victim)
          killed.append((victim, busy[victim]))
          return
        time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()

  res = local.run(learner=testing.learner(1), tasks=_slow_grading(testing.tasks()), pool=pool,
                  workdir=str(tmp_path), config=cfg, num_steps=2,
                  engine_config=testing.ENGINE, after_start=kill_a_busy_host)
  assert len(killed) == 1, killed
  victim, _ = killed[0]
  g = res.grading
  # The kill was seen once, its host replaced, and the grades it held ran again elsewhere.
  assert g["host_failures"] == 1 and g["hosts_live"] == 2
  assert g["retried_grades"] >= 1 and g["jobs_retried"] >= g["retried_grades"]
  _check_every_episode_once(res, str(tmp_path), cfg, 2)
  # Every grade came from a Ray actor: hosts with their own processes, none of them this one.
  pids = g["host_pids"]
  assert victim in pids and len(pids) == 3 and len(set(pids.values())) == 3  # 2 + replacement
  assert set(g["grades_by_host"]) <= set(pids) and os.getpid() not in pids.values()
  assert g["grader"] == "ray"
  # The fleet was the run's (closed with it); the pool the caller gave is left open.
  pool.release(pool.acquire())


def test_the_multi_process_controller_grades_in_the_ray_cluster_it_joins(ray_module, tmp_path):
  """pipeline.processes.run_controller (what `rl_part controller` runs) with grader "ray" and
  `ray_address`: it joins this module's Ray cluster as another driver and grades there. One
  step is enough to prove that (the fleet's retries and counts over several steps are
  test_a_host_killed_mid_grading_loses_and_repeats_nothing's)."""
  work = str(tmp_path / "work")
  address = ray_module.get_runtime_context().gcs_address
  prelude = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from pipeline import processes, testing
cfg = testing.config(max_staleness=1, grader="ray", grader_hosts=2, grader_pool=1,
                     ray_address={address!r})
"""
  logs = {n: str(tmp_path / f"{n}.log") for n in ("learner", "sampler", "controller")}
  procs = {}
  port = testing.free_port()
  url = f"http://127.0.0.1:{port}"
  try:
    procs["learner"] = testing.spawn(prelude + f"""
processes.run_learner({work!r}, testing.MODEL, cfg, testing.LEARNER, steps=1)
""", logs["learner"])
    procs["sampler"] = testing.spawn(prelude + f"""
processes.run_sampler({work!r}, port={port}, max_slots=8, max_len=128)
""", logs["sampler"])
    testing.wait_http(url, procs["sampler"], logs["sampler"])
    procs["controller"] = testing.spawn(prelude + f"""
import os
print("controller pid", os.getpid())
n = processes.run_controller({work!r}, [{url!r}], cfg, steps=1, pool_size=1, num_tasks=6)
print("groups written", n)
""", logs["controller"])
    assert procs["controller"].wait(timeout=600) == 0, open(logs["controller"]).read()[-3000:]
    assert procs["learner"].wait(timeout=600) == 0, open(logs["learner"]).read()[-3000:]
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  out = open(logs["controller"]).read()
  assert "groups written 2" in out, out[-3000:]
  controller_pid = int(out.split("controller pid ")[1].split()[0])
  summary = json.loads(out.split("controller summary ")[1].splitlines()[0])
  g = summary["grading"]
  assert g["grader"] == "ray" and g["grades"] == summary["episodes_written"] == 8
  assert summary["episodes_lost"] == 0 and summary["infra_failures"] == 0
  assert set(g["grades_by_host"]) <= set(g["host_pids"]) and len(g["host_pids"]) == 2
  pids = g["host_pids"].values()
  assert controller_pid not in pids and os.getpid() not in pids


def test_the_factory_picks_the_local_pool_or_the_fleet(ray_module, pool):
  local_ = grading.open_sandboxes(testing.config(), pool=pool)
  assert (local_.grader, local_.pool, local_.grade_fn, local_.fleet) == ("local", pool, None,
                                                                          None)
  assert local_.summary() == {"grader": "local"}
  local_.close()  # the caller's pool stays open
  pool.release(pool.acquire())
  ray_ = grading.open_sandboxes(testing.config(grader="ray", grader_hosts=1), pool_size=1)
  try:
    assert isinstance(ray_.fleet, fleet_ray.RayFleet) and len(ray_.fleet.hosts) == 1
    assert isinstance(ray_.grade_fn, grading.FleetGrader)
  finally:
    ray_.close()
  with pytest.raises(ValueError, match="grader must be one of"):
    testing.config(grader="cluster")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
