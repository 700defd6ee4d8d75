"""The learner as two `jax.distributed` processes of 4 CPU devices each (`rl_part learner
--num_processes=2`, CPU collectives over gloo), on the sharded experiment's (1, 2, 4, 1) mesh, from
the same records and initial checkpoint as one process of 8 devices (issue #20):

  * both processes train every step on the same global batch (the RL objective, router replay)
    and report the one-process learner's losses and gradient norms;
  * process 0 is killed right after publishing version 3 (the `learner.after_publish` fault
    point), process 1 then too; restarted, both restore the newest committed checkpoint together
    (orbax, across processes), replay up to the published version without publishing it again
    and go on with the same step numbers to the end;
  * every version is published sharded (each process its own blocks, sync/sharded.py), never as
    whole weights, and its assembled weights are the one-process learner's;
  * a sampler (`rl_part sampler`) follows the sharded store through the kill and serves the last
    version, and its /health is ok.

Tolerance policy: both learners compile the same partitioned program for the same 8-device
mesh; only the transport of the cross-device reductions differs (gloo between the processes,
in-process otherwise), which does not change float32 sums of the same operands in the same
order, so losses, gradient norms and weights must agree to float32 round-off (rtol 1e-6, as in
rl/multihost_smoke_test.py). Observed gap on this machine: 0.
"""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from moe import build
from moe import checkpoint as moe_checkpoint
from pipeline import processes
from pipeline import testing
from sync import publisher as publisher_lib
from sync import sharded as sharded_lib
from sync import store as store_lib
from testlib import waiting
from tools import rl_part

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
KILL_AFTER_PUBLISH = 3
CFG = testing.config(max_staleness=0)
TIMEOUT_S = 600  # per phase; compiling on a loaded 2-core machine takes a minute or two
# The sharded experiment with the pipeline tests' settings (pipeline.testing.config(
# max_staleness=0)); the model comes from --init_checkpoint (pipeline.testing.MODEL).
FLAGS = ["--gin_file=tools/configs/experiments/sharded.gin",
         "--gin.PipelineConfig.max_staleness=0", "--gin.PipelineConfig.prompts_per_step=2",
         "--gin.PipelineConfig.attempts=4", "--gin.PipelineConfig.max_new_tokens=12",
         "--gin.PipelineConfig.seq_len=96", "--gin.PipelineConfig.batch_rows=8",
         "--gin.OptimizerConfig.learning_rate=1e-3", "--gin.ModelConfig.max_seq_len=128"]


def _spawn(args, log_path, devices, extra_env=None):
  # Every part of the test shares one compilation cache in the test's directory (never the
  # user's): the restarted learners load what the first ones compiled.
  args = [*args, f"--compilation_cache_dir={os.path.join(os.path.dirname(log_path), 'jax_cache')}"]
  env = {k: v for k, v in os.environ.items() if not k.startswith("RL_FAULTS")}
  env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(extra_env or {}))
  with open(log_path, "w") as f:
    return subprocess.Popen([sys.executable, "-m", "tools.rl_part", *args], cwd=ROOT, env=env,
                            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _learners(work, init, tmp_path, tag, *, fault=None):
  """Starts the two learner processes; returns them with their log paths."""
  port = testing.free_port()
  procs, logs = [], []
  for i in range(2):
    logs.append(str(tmp_path / f"learner{i}-{tag}.log"))
    env = {"RL_FAULTS": fault, "RL_FAULTS_LOG": logs[-1] + ".faults"} if fault and i == 0 else {}
    procs.append(_spawn(["learner", f"--workdir={work}", f"--steps={STEPS}",
                         f"--init_checkpoint={init}", "--num_processes=2", f"--process_id={i}",
                         f"--coordinator=127.0.0.1:{port}", *FLAGS], logs[-1], 4, env))
  return procs, logs


def _wait(proc, log, timeout_s=TIMEOUT_S):
  try:
    return proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise AssertionError(f"{log}: no exit in {timeout_s}s:\n{open(log).read()[-3000:]}")


def _metric(url, name):
  with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
    for line in r.read().decode().splitlines():
      if line.startswith(name + " "):
        return float(line.split()[-1])
  return None


def _sharded_weights(work, version):
  got = {}
  sub = sharded_lib.ShardedSubscriber(store_lib.Store(processes.paths(work)["weights"]),
                                      lambda w, v: got.update(w, version=v))
  sub.poll()
  assert got.pop("version") == version
  return got


def test_two_learner_processes_match_one_and_survive_a_kill(tmp_path):
  init = str(tmp_path / "init")
  moe_checkpoint.save_params(build.create(testing.MODEL, seed=0), init)
  ref_work, work = str(tmp_path / "ref"), str(tmp_path / "multi")
  for w in (ref_work, work):
    testing.write_steps(processes.paths(w)["trajectories"], STEPS, CFG)
  procs = []
  try:
    # The reference (one process, 8 devices) runs beside the first multi-process run.
    ref_log = str(tmp_path / "ref.log")
    ref = _spawn(["learner", f"--workdir={ref_work}", f"--steps={STEPS}",
                  f"--init_checkpoint={init}", *FLAGS], ref_log, 8)
    procs.append(ref)
    first, first_logs = _learners(work, init, tmp_path, "first",
                                  fault=f"learner.after_publish@{KILL_AFTER_PUBLISH}")
    procs += first
    port = testing.free_port()
    url = f"http://127.0.0.1:{port}"
    sampler_log = str(tmp_path / "sampler.log")
    # sharded.gin's sampler is two data-parallel replicas: a device each.
    sampler = _spawn(["sampler", f"--workdir={work}", f"--port={port}", *FLAGS], sampler_log, 2)
    procs.append(sampler)

    # Process 0 kills itself right after publishing version 3; process 1, left waiting for it
    # in a collective, is killed then.
    assert _wait(first[0], first_logs[0]) == -signal.SIGKILL, open(first_logs[0]).read()[-3000:]
    assert open(first_logs[0] + ".faults").read().split()[:2] == [
        "learner.after_publish", str(KILL_AFTER_PUBLISH)]
    if first[1].poll() is None:
      os.killpg(first[1].pid, signal.SIGKILL)
    first[1].wait()
    assert sharded_lib.read_index(store_lib.Store(
        processes.paths(work)["weights"])).latest == KILL_AFTER_PUBLISH
    testing.wait_http(url, sampler, sampler_log, timeout=TIMEOUT_S)

    second, second_logs = _learners(work, init, tmp_path, "second")
    procs += second
    for p, log in zip(second, second_logs):
      assert _wait(p, log) == 0, open(log).read()[-3000:]
    assert _wait(ref, ref_log) == 0, open(ref_log).read()[-3000:]
    waiting.wait_until(lambda: _metric(url, "rollout_policy_version") == STEPS,
                       lambda: f"the sampler never served version {STEPS}: "
                               f"{open(sampler_log).read()[-3000:]}", timeout_s=TIMEOUT_S)
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
      health = json.loads(r.read())
      assert r.status == 200 and health["status"] == "ok", health
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  reference = processes.parse_step_lines(open(ref_log).read())
  assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
  assert all(r["trained_episodes"] == CFG.episodes_per_step for r in reference), reference
  outs = [[open(l).read() for l in logs] for logs in (first_logs, second_logs)]
  for run in outs:
    assert "learner process 0 of 2, mesh {'data': 1, 'fsdp': 2, 'expert': 4, 'tensor': 1} " \
           "over 8 devices (4 here)" in run[0], run[0][-3000:]
  before = processes.parse_step_lines(outs[0][0])
  # Killed after publishing version 3, before step 3's line (printed after the publish).
  assert [r["step"] for r in before] == list(range(1, KILL_AFTER_PUBLISH))
  # Restarted: both processes restored the same committed checkpoint, replayed the steps up to
  # the published version 3 (not publishing them again) and trained on to the end.
  after = [processes.parse_step_lines(o) for o in outs[1]]
  restored = [int(o.split("learner restored at step ")[1].split()[0]) for o in outs[1]]
  assert restored[0] == restored[1] and 1 <= restored[0] < KILL_AFTER_PUBLISH, outs[1][0][-3000:]
  # One global computation: the same figures in both processes (apart from what each published,
  # its own blocks).
  learned = [[{k: v for k, v in r.items() if not k.startswith("publish_")} for r in a]
             for a in after]
  assert learned[0] == learned[1]
  # Each process published its own blocks: together, every weight exactly once.
  whole = {r["step"]: r["publish_raw_bytes"] for r in reference}
  for r0, r1 in zip(*after):
    if not r0["replayed"]:
      assert 0 < r0["publish_raw_bytes"] < whole[r0["step"]]
      assert r0["publish_raw_bytes"] + r1["publish_raw_bytes"] == whole[r0["step"]]
  assert [r["step"] for r in after[0]] == list(range(restored[0] + 1, STEPS + 1))
  assert [r["replayed"] for r in after[0]] == [
      s <= KILL_AFTER_PUBLISH for s in range(restored[0] + 1, STEPS + 1)]
  steps = {r["step"]: r for r in before + after[0]}  # the replayed steps' own records win
  for r in reference:
    got = steps[r["step"]]
    assert got["policy_version"] == r["policy_version"] == r["step"]
    assert got["tokens"] == r["tokens"] and got["trained_episodes"] == r["trained_episodes"]
    assert got["loss"] == pytest.approx(r["loss"], rel=1e-6), (r["step"], got, r)
    assert got["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6), (r["step"], got, r)
  # Published sharded only: each process its own blocks, assembled to the reference's weights.
  store = store_lib.Store(processes.paths(work)["weights"])
  assert publisher_lib.read_index(store).latest is None
  final = _sharded_weights(work, STEPS)
  expect, version = testing.published_weights(ref_work)
  assert version == STEPS and set(final) == set(expect)
  for name, w in expect.items():
    np.testing.assert_allclose(final[name], w, rtol=1e-6, atol=1e-9, err_msg=name)
  assert processes.parse_summary(outs[1][0])["step"] == STEPS
  # Restarted, process 0 compiled nothing: it loaded every program from the cache. Process 1
  # compiles again: JAX writes only process 0's programs (jax._src.compiler._cache_write), and
  # process 1's are keyed by its own devices.
  caches = [_cache_line(out) for out in outs[1]]
  assert all(c["dir"] == str(tmp_path / "jax_cache") for c in caches), caches
  assert caches[0]["hits"] == caches[0]["requests"] > 0, caches
  assert caches[1]["requests"] > 0, caches


def _cache_line(out):
  lines = [l for l in out.splitlines() if l.startswith(rl_part.CACHE_LINE)]
  assert lines, out[-3000:]
  return json.loads(lines[-1][len(rl_part.CACHE_LINE):])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
