"""The pipeline as separate processes (learner, two samplers, controller) over a shared work
directory and HTTP; one sampler is killed mid-run and its requests go to the other (two
data-parallel replicas of an expert-sharded engine behind one server). A sampler
readies the delta kernels at start-up, before any weights exist. The learner publishes in the
sampler's dtype and reports each published version's bytes and compression ratio."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from pipeline import episodes as episodes_lib
from pipeline import processes
from pipeline import testing
from rl import testing as rl_testing
from rl import trajectory_io
from rollout.engine import Completion
from sync import delta
from sync import publisher as publisher_lib
from sync import store as store_lib
from sync import weights
from sync.delta import jit


# Two learner steps of two groups: the sampler is killed at the first request, so most of the
# groups are sampled by the survivor after the kill either way.
STEPS = 2
GROUPS = STEPS * testing.config().prompts_per_step
PRELUDE = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from pipeline import processes, testing
cfg = testing.config(max_staleness=1)
STEPS, GROUPS = {STEPS}, {GROUPS}
"""


@pytest.fixture(scope="module")
def kernels_ready(tmp_path_factory):
  """The delta kernels readied once, here: a delta of the test model published and applied in
  this process compiles them into (or loads them from) the on-disk kernel cache, sync.delta.jit's
  default directory, which the parts share (under Bazel the test's own). The parts, which
  need them at start-up (samplers) or at their first delta (the learner) all at once, then load
  them instead of each compiling them. Returns that directory's base (SYNC_KERNEL_CACHE_DIR)."""
  testing.ready_delta_kernels(str(tmp_path_factory.mktemp("kernels")))
  return os.path.dirname(jit.CACHE_DIR) if jit.CACHE_DIR else ""  # "": each compiles


def test_separate_processes_with_a_sampler_killed(tmp_path, kernels_ready):
  del kernels_ready  # the parts load them
  work = str(tmp_path / "work")
  prelude = PRELUDE
  logs = {n: str(tmp_path / f"{n}.log") for n in ("learner", "s0", "s1", "controller")}
  procs = {}
  try:
    procs["learner"] = testing.spawn(prelude + f"""
processes.run_learner({work!r}, testing.MODEL, cfg, testing.LEARNER, steps=STEPS)
""", logs["learner"])
    ports = [testing.free_port(), testing.free_port()]
    # Sampler 1: two data-parallel replicas, each sharding the experts over two devices.
    layouts = ["", ", replicas=2, expert=2"]
    devices = ["", 'import os\nos.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"']
    for i, port in enumerate(ports):
      procs[f"s{i}"] = testing.spawn(devices[i] + prelude + f"""
processes.run_sampler({work!r}, port={port}, max_slots=8, max_len=128{layouts[i]})
""", logs[f"s{i}"])
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # The controller starts beside the samplers (its imports overlap their start-up) and waits
    # for them itself before its first request; the test fails here if a sampler exits.
    procs["controller"] = testing.spawn(prelude + f"""
from testlib import waiting
for u in {urls!r}:
  waiting.wait_until(lambda: waiting.url_answers(u + "/health"), u, timeout_s=300, poll_s=0.05)
n = processes.run_controller({work!r}, {urls!r}, cfg, steps=STEPS, pool_size=2,
                             num_tasks=GROUPS)
print("groups written", n)
""", logs["controller"])
    for i, u in enumerate(urls):
      testing.wait_http(u, procs[f"s{i}"], logs[f"s{i}"])
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
    # Sampler 1's replicas both served (after sampler 0 died, all of the work was theirs).
    with urllib.request.urlopen(urls[1] + "/metrics", timeout=5) as r:
      served = [float(l.split()[-1]) for l in r.read().decode().splitlines()
                if l.startswith("rollout_replica_requests_total{")]
    assert len(served) == 2 and min(served) >= 1, served
  finally:
    for p in procs.values():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  out = open(logs["controller"]).read()
  assert f"groups written {GROUPS}" in out
  learner_out = open(logs["learner"]).read()
  # The learner trained on what the samplers produced: every step packed all its episodes
  # (none refused, none lost with the killed sampler), and the weights it published last differ
  # from the initial ones it published as version 0.
  rl_testing.assert_steps_trained(processes.parse_step_lines(learner_out), steps=STEPS,
                                  episodes_per_step=testing.config().episodes_per_step)
  initial, _ = testing.published_weights(work, 0)
  final, version = testing.published_weights(work)
  assert version == STEPS
  rl_testing.assert_weights_changed(initial, final)
  d = os.path.join(work, "trajectories")
  recs = [r for s in trajectory_io.list_shards(d)
          for r in trajectory_io.read_shard(os.path.join(d, s))]
  gids = [r["group_id"] for r in recs]
  assert len(gids) == GROUPS * 4 and len(set(gids)) == GROUPS  # each group once, 4 attempts
  # Sampled over HTTP and graded: the killed sampler's requests were retried on the other one,
  # not written off as infrastructure failures.
  assert not any(r["infra_failure"] for r in recs), out[-3000:]


def test_a_sampler_readies_the_delta_kernels_at_start_up(tmp_path, kernels_ready):
  # In a fresh process (one that compiled nothing yet): the sampler's start (wait_for_weights)
  # readies the kernels while nothing is published, and restoring a snapshot plus a delta
  # afterwards compiles nothing more. Readied means compiled or loaded from the kernel cache
  # (jit.compiled_signatures counts both): here loaded from the cache the module readied.
  work = str(tmp_path / "work")
  code = f"""
import json
from pipeline import processes
from sync import publisher, store
from sync import testing as sync_testing
from sync.delta import jit
url = processes.paths({work!r})["weights"]
before = jit.compiled_signatures()
try:
  processes.wait_for_weights(url, timeout_s=0.5, name="s")
  raise AssertionError("weights were found before any were published")
except TimeoutError:
  pass
at_start = jit.compiled_signatures()
st = store.Store(url)
pub = publisher.Publisher(st, chunk_elems=sync_testing.CHUNK)
versions = sync_testing.history(2)
pub.publish(versions[0])
pub.publish(versions[1])
_, sub = processes.wait_for_weights(url, timeout_s=60, name="s")
print(json.dumps({{"before": before, "at_start": at_start, "after": jit.compiled_signatures(),
                  "version": sub.version,  # version 1 is a delta only: it was applied
                  "v1_snapshot": publisher.read_manifest(st, 1).snapshot is not None}}))
"""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             SYNC_KERNEL_CACHE_DIR=kernels_ready)
  res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  got = json.loads(res.stdout.strip().splitlines()[-1])
  assert got["before"] == 0 and got["at_start"] > 0, got
  assert got["version"] == 1 and not got["v1_snapshot"], got
  assert got["after"] == got["at_start"], got  # the delta found its kernels ready


def _write_groups(directory: str, cfg, steps: int) -> None:
  """The records of `steps` learner steps, as the controller writes them: step s's groups
  sampled by policy version s, rewards varying within each group (so every step trains)."""
  moe_layers = testing.MODEL.num_moe_layers
  k = testing.MODEL.num_experts_per_tok
  rng = np.random.default_rng(0)
  writer = trajectory_io.TrajectoryWriter(directory, "c", records_per_shard=cfg.attempts)
  for g in range(steps * cfg.prompts_per_step):
    version = g // cfg.prompts_per_step
    prompt = [int(t) for t in rng.integers(1, 250, 6)]
    group = []
    for j in range(cfg.attempts):
      gen = int(rng.integers(3, 8))
      comp = Completion(
          token_ids=[int(t) for t in rng.integers(1, 250, gen)], logprobs=[-1.0] * gen,
          routing=rng.integers(0, testing.MODEL.num_experts, (moe_layers, gen, k)).astype(np.uint8),
          policy_versions=[version] * gen, finish_reason="stop",
          prompt_routing=rng.integers(0, testing.MODEL.num_experts,
                                      (moe_layers, len(prompt) - 1, k)).astype(np.uint8))
      group.append(episodes_lib.from_completion(
          group_id=f"g{g}", episode_id=f"g{g}-{j}", group_size=cfg.attempts,
          prompt_ids=prompt, completion=comp, reward=float(j % 2)))
    writer.write_all(group)
    writer.flush()
  writer.close()


def test_the_learner_publishes_in_the_sampler_dtype_and_reports_each_versions_ratio(
    tmp_path, capsys):
  # The multi-process learner's body (run_learner) with a bf16 sampler: every published version
  # is bf16 (manifests, delta headers, what a sampler restores), and each step's line carries
  # the bytes of the version it published, equal to the delta's size in the store, with the
  # ratio of the bf16 weights' bytes to it; the summary sums them.
  work = str(tmp_path / "work")
  cfg = testing.config()
  steps = 2
  _write_groups(processes.paths(work)["trajectories"], cfg, steps)
  bf16 = dataclasses.replace(testing.LEARNER, sampler_dtype="bfloat16")
  assert processes.run_learner(work, testing.MODEL, cfg, bf16, steps=steps) == steps
  out = capsys.readouterr().out
  lines = processes.parse_step_lines(out)
  summary = processes.parse_summary(out)
  st = store_lib.Store(processes.paths(work)["weights"])
  assert publisher_lib.read_index(st).latest == steps
  raw_total = fetched_total = 0
  for line in lines:
    m = publisher_lib.read_manifest(st, line["step"])
    assert {dt for dt, _ in m.tensors.values()} == {"bfloat16"}, m.tensors
    blob = st.get(m.delta.key)
    assert {t[1] for t in delta.read_header(blob)["tensors"]} == {"bfloat16"}
    raw = sum(weights.dtype_from_name(dt).itemsize * int(np.prod(shape))
              for dt, shape in m.tensors.values())
    assert line["publish_bytes"] == m.delta.size == len(blob), (line, m.delta)
    assert line["publish_raw_bytes"] == raw
    assert line["publish_ratio"] == pytest.approx(raw / len(blob), rel=1e-12)
    assert line["publish_delta"] == 1 and line["publish_s"] > 0
    raw_total += raw
    fetched_total += len(blob)
  assert [line["step"] for line in lines] == list(range(1, steps + 1))
  assert summary["published_versions"] == steps + 1  # version 0, then one per step
  assert summary["delta_versions"] == steps
  assert summary["publish_bytes"] == fetched_total and summary["publish_raw_bytes"] == raw_total
  assert summary["publish_ratio"] == pytest.approx(raw_total / fetched_total, rel=1e-12)
  # What a sampler starting now holds: the newest version, in bf16, its digest verified.
  _, sub = processes.wait_for_weights(processes.paths(work)["weights"], timeout_s=60)
  assert sub.version == steps
  assert {a.dtype.name for a in sub.weights.values()} == {"bfloat16"}
  assert weights.digest(sub.weights) == publisher_lib.read_manifest(st, steps).digest


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
