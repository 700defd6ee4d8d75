"""Pipeline parts killed with SIGKILL and restarted as separate processes (#17 items 5 and 6).

A sampler process killed and started again at the same address rejoins the controller's sampler
set and serves requests again (before, it stayed marked dead and the run went on at half its
capacity). A controller killed right after its K-th group write (pipeline.faults,
RL_FAULTS=controller.after_write@K) and restarted resumes at group K: every task of the order
is written exactly once, none twice, none missed (before, the restart drew the order from its
start). The samplers serve weights published here as version 0; no learner runs, so versions
stay at 0 and the kill points are the only events (max_staleness covers every step).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from moe import build
from moe import params as moe_params
from pipeline import controller as controller_lib
from pipeline import faults
from pipeline import processes
from pipeline import samplers as samplers_lib
from pipeline import testing
from pipeline.local import WeightChannel
from rl import trajectory_io
from rollout.sampling import SamplingParams

STEPS, NUM_TASKS = 3, 6  # 3 steps of 2 groups: one pass over the 6 tasks


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(code: str, log_path: str, env=None) -> subprocess.Popen:
  env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             PYTHONUNBUFFERED="1")
  with open(log_path, "a") as f:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=f,
                            stderr=subprocess.STDOUT, start_new_session=True)


PRELUDE = """
import logging
logging.basicConfig(level=logging.INFO)
from testlib import jax_cache
jax_cache.enable({cache!r})
from pipeline import processes, testing
"""


def _tail(path):
  return open(path).read()[-3000:]


def _wait_http(url, proc, log, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"sampler exited: {_tail(log)}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2):
        return
    except OSError:
      time.sleep(0.2)
  raise AssertionError(f"sampler did not come up in {timeout}s: {_tail(log)}")


def _requests_served(url) -> float:
  with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
    for line in r.read().decode().splitlines():
      if line.startswith("rollout_requests_total"):
        return float(line.split()[-1])
  raise AssertionError(f"{url}/metrics has no rollout_requests_total")


class _Parts:
  """Child processes of one test, killed (whole process group) at the end."""

  def __init__(self, tmp_path, cache):
    self.work = str(tmp_path / "work")
    self.tmp = tmp_path
    self.prelude = PRELUDE.format(cache=cache)
    self.procs = {}
    flat = moe_params.flatten(build.create(testing.MODEL, seed=0))
    WeightChannel(processes.paths(self.work)["weights"], model_cfg=testing.MODEL).publish(flat, 0)

  def log(self, name):
    return str(self.tmp / f"{name}.log")

  def samplers(self, names_ports):
    """Starts a sampler per (name, port), all at once, and waits until each serves."""
    for name, port in names_ports:
      self.procs[name] = _spawn(self.prelude + f"""
processes.run_sampler({self.work!r}, port={port}, max_slots=8, max_len=128)
""", self.log(name))
    for name, port in names_ports:
      _wait_http(f"http://127.0.0.1:{port}", self.procs[name], self.log(name))

  def kill(self, name):
    os.killpg(self.procs[name].pid, signal.SIGKILL)
    self.procs[name].wait(60)

  def close(self):
    for p in self.procs.values():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One compilation cache for the module's processes (testlib.jax_cache): a sampler started
  again loads what the first compiled, as a restarted part of a run does.

  The delta kernels too are readied once, here, in the on-disk kernel cache the samplers share
  (sync.delta.jit's default directory; under Bazel the test's own), by a delta of the test model
  published and applied: samplers started together load them instead of each compiling them."""
  testing.ready_delta_kernels(str(tmp_path_factory.mktemp("kernels")))
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture
def parts(tmp_path, cache):
  ps = _Parts(tmp_path, cache)
  yield ps
  ps.close()


def test_a_restarted_sampler_rejoins_and_serves_again(parts):
  ports = [_free_port(), _free_port()]
  urls = [f"http://127.0.0.1:{p}" for p in ports]
  parts.samplers([(f"s{i}", port) for i, port in enumerate(ports)])
  sset = samplers_lib.SamplerSet([samplers_lib.HttpSampler(u, name=u) for u in urls],
                                 max_lag=1, probe_backoff_s=0.2, max_probe_backoff_s=1.0)
  params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
  assert sset.min_version() == 0 and len(sset.live()) == 2

  parts.kill("s0")
  assert sset.min_version() == 0  # s0 no longer answers: marked dead, s1 carries on
  assert [s.name for s in sset.live()] == [urls[1]]
  assert len(sset.submit([1, 2, 3], params, timeout=60).result(120)) == 2

  parts.samplers([("s0-restarted", ports[0])])  # the same address, a fresh process
  assert _requests_served(urls[0]) == 0
  deadline = time.monotonic() + 120
  while len(sset.live()) < 2:  # probed again with back-off (at most 1s apart here)
    assert time.monotonic() < deadline, "the restarted sampler never rejoined"
    time.sleep(0.1)
    sset.min_version()
  assert sset.rejoins == 1
  # Requests go to both again (least work in flight first): the restarted one serves its share.
  futs = [sset.submit([1, 2, 3, i], params, timeout=60) for i in range(4)]
  assert all(len(f.result(120)) == 2 for f in futs)
  # The first goes to the restarted one (both idle: the tie goes to the first listed).
  assert _requests_served(urls[0]) >= 1
  assert _requests_served(urls[0]) + _requests_served(urls[1]) == 4 + 1


def _written(work):
  d = processes.paths(work)["trajectories"]
  return [r for n in trajectory_io.list_shards(d)
          for r in trajectory_io.read_shard(os.path.join(d, n))]


def _summary(log):
  lines = [l for l in open(log).read().splitlines() if l.startswith("controller summary ")]
  assert lines, _tail(log)
  return json.loads(lines[-1][len("controller summary "):])


def test_a_controller_killed_after_a_write_resumes_its_task_order(parts):
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  parts.samplers([("s0", port)])
  kill_at = 3
  run = parts.prelude + f"""
cfg = testing.config(max_staleness={STEPS})
n = processes.run_controller({parts.work!r}, [{url!r}], cfg, steps={STEPS}, pool_size=2,
                             num_tasks={NUM_TASKS})
print("groups written", n)
"""
  fault_log = str(parts.tmp / "faults.log")
  first = parts.procs["c0"] = _spawn(run, parts.log("c0"), env={
      faults.ENV: f"controller.after_write@{kill_at}", faults.LOG_ENV: fault_log})
  assert first.wait(timeout=600) == -signal.SIGKILL, _tail(parts.log("c0"))
  assert open(fault_log).read().split()[:2] == ["controller.after_write", str(kill_at)]
  assert len(_written(parts.work)) == kill_at * 4  # groups 0..K-1; K.. were in flight, unwritten

  second = parts.procs["c1"] = _spawn(run, parts.log("c1"))
  assert second.wait(timeout=600) == 0, _tail(parts.log("c1"))
  out = open(parts.log("c1")).read()
  assert f"controller resumed at group {kill_at}" in out and "groups written 6" in out

  recs = _written(parts.work)
  by_group = {}
  for r in recs:
    by_group.setdefault(r["group_id"], []).append(r["episode_id"])
  order = controller_lib.RolloutController(testing.tasks(NUM_TASKS), None, None, None,
                                           config=testing.config(max_staleness=STEPS))
  expect = [f"g{i:06d}-{order.task_for(i).task_id}" for i in range(STEPS * 2)]
  assert sorted(by_group) == expect  # groups 0..5, each the task the order gives it
  assert all(sorted(e) == [f"{g}-a{j}" for j in range(4)] for g, e in by_group.items())
  tasks_written = sorted(g.split("-", 1)[1] for g in by_group)
  assert tasks_written == sorted(t.task_id for t in testing.tasks(NUM_TASKS))  # each exactly once
  s = _summary(parts.log("c1"))
  assert (s["resumed_at"], s["groups_written"], s["episodes_written"], s["episodes_lost"]) == (
      kill_at, 6, (6 - kill_at) * 4, 0), s


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
