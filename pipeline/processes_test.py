"""The pipeline as separate processes (learner, two samplers, controller) over a shared work
directory and HTTP; one sampler is killed mid-run and its requests go to the other."""

import os
import signal
import sys
import time
import urllib.request

import pytest

from pipeline import processes
from pipeline import testing
from rl import testing as rl_testing
from rl import trajectory_io


PRELUDE = """
import logging
logging.basicConfig(level=logging.WARNING)
from pipeline import processes, testing
cfg = testing.config(max_staleness=1)
"""


def test_separate_processes_with_a_sampler_killed(tmp_path):
  work = str(tmp_path / "work")
  logs = {n: str(tmp_path / f"{n}.log") for n in ("learner", "s0", "s1", "controller")}
  procs = {}
  try:
    procs["learner"] = testing.spawn(PRELUDE + f"""
processes.run_learner({work!r}, testing.MODEL, cfg, testing.LEARNER, steps=3)
""", logs["learner"])
    ports = [testing.free_port(), testing.free_port()]
    for i, port in enumerate(ports):
      procs[f"s{i}"] = testing.spawn(PRELUDE + f"""
processes.run_sampler({work!r}, port={port}, max_slots=8, max_len=128)
""", logs[f"s{i}"])
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for i, u in enumerate(urls):
      testing.wait_http(u, procs[f"s{i}"], logs[f"s{i}"])
    procs["controller"] = testing.spawn(PRELUDE + f"""
n = processes.run_controller({work!r}, {urls!r}, cfg, steps=3, pool_size=2, num_tasks=6)
print("groups written", n)
""", logs["controller"])
    # Kill sampler 0 as soon as the controller has sent it work.
    t0 = time.time()
    while True:
      with urllib.request.urlopen(urls[0] + "/metrics", timeout=5) as r:
        text = r.read().decode()
      if any(l.startswith("rollout_requests_total") and float(l.split()[-1]) > 0
             for l in text.splitlines()):
        break
      assert procs["controller"].poll() is None and time.time() - t0 < 300, (
          "sampler 0 never accepted a request:\n" + open(logs["controller"]).read()[-3000:])
      time.sleep(0.05)
    os.killpg(procs["s0"].pid, signal.SIGKILL)
    assert procs["controller"].wait(timeout=600) == 0, open(logs["controller"]).read()[-3000:]
    assert procs["learner"].wait(timeout=600) == 0, open(logs["learner"]).read()[-3000:]
  finally:
    for p in procs.values():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  out = open(logs["controller"]).read()
  assert "groups written 6" in out
  learner_out = open(logs["learner"]).read()
  # The learner trained on what the samplers produced: every step packed all its episodes
  # (none refused, none lost with the killed sampler), and the weights it published last differ
  # from the initial ones it published as version 0.
  rl_testing.assert_steps_trained(processes.parse_step_lines(learner_out), steps=3,
                                  episodes_per_step=testing.config().episodes_per_step)
  initial, _ = testing.published_weights(work, 0)
  final, version = testing.published_weights(work)
  assert version == 3
  rl_testing.assert_weights_changed(initial, final)
  d = os.path.join(work, "trajectories")
  recs = [r for s in trajectory_io.list_shards(d)
          for r in trajectory_io.read_shard(os.path.join(d, s))]
  gids = [r["group_id"] for r in recs]
  assert len(gids) == 6 * 4 and len(set(gids)) == 6  # every group once, 4 attempts each
  # Sampled over HTTP and graded: the killed sampler's requests were retried on the other one,
  # not written off as infrastructure failures.
  assert not any(r["infra_failure"] for r in recs), out[-3000:]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
