"""Issue #17 items 1 and 4 as separate learner processes over a work directory (pipeline.processes
.run_learner), with the controller's records written beforehand so that nothing but the fault
decides the outcome:

  * a learner killed right after a publish, before that step's checkpoint commits (the
    `learner.after_publish` fault point, pipeline.faults), restarts, replays to the published
    version and goes on with version == step, every later step training a full batch;
  * a step with no trainable token stops the learner with a clear error, never trains on nothing;
  * a missing trajectory shard is waited for, then counted as lost, and the later steps keep
    their boundaries (the run finishes instead of waiting forever at its last step).

Each record of step s is sampled at version s and the staleness bound is 0, so a learner whose
version ran ahead of its step (the bug) finds every later record stale.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline import processes
from pipeline import testing
from testlib import jax_cache

CFG = testing.config(max_staleness=0)
STEPS = 4
TIMEOUT_S = 600  # per learner process; a learner that waits for data it will never get fails


def _write_steps(traj_dir, steps, versions=None):
  return testing.write_steps(traj_dir, steps, CFG, versions)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One compilation cache for the module's learner processes (testlib.jax_cache): the first
  compiles the learner's programs, the others load them, as a restarted learner does."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _learner(work, log_path, cache, *, faults=None, extra=""):
  """Runs one learner process to its end; returns (exit code, its output)."""
  code = textwrap.dedent(f"""
      import logging
      logging.basicConfig(level=logging.WARNING)
      from testlib import jax_cache
      jax_cache.enable({cache!r})
      from pipeline import processes, testing
      cfg = testing.config(max_staleness=0)
      processes.run_learner({work!r}, testing.MODEL, cfg, testing.LEARNER, steps={STEPS}{extra})
  """)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             PYTHONUNBUFFERED="1")
  env.pop("RL_FAULTS", None)
  if faults:
    env.update(RL_FAULTS=faults, RL_FAULTS_LOG=log_path + ".faults")
  with open(log_path, "w") as f:
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=f,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
      rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      rc = "timeout"
  return rc, open(log_path).read()


def test_learner_killed_after_a_publish_replays_to_the_published_version(tmp_path, cache):
  work = str(tmp_path / "work")
  _write_steps(processes.paths(work)["trajectories"], STEPS)
  log = str(tmp_path / "learner1.log")
  rc, out1 = _learner(work, log, cache, faults="learner.after_publish@2")
  assert rc == -signal.SIGKILL, out1[-3000:]
  assert open(log + ".faults").read().split()[:2] == ["learner.after_publish", "2"]
  # Killed right after publishing version 2, before step 2's checkpoint was saved.
  assert testing.published_weights(work)[1] == 2
  rc, out2 = _learner(work, str(tmp_path / "learner2.log"), cache)
  assert rc == 0, out2[-3000:]
  steps = processes.parse_step_lines(out2)
  replayed = [r["step"] for r in steps if r["replayed"]]
  fresh = [r for r in steps if not r["replayed"]]
  # The restart began at the newest committed checkpoint (step 0 or 1) and replayed up to the
  # published version 2 without publishing it again; then it went on to the end.
  assert replayed and replayed[-1] == 2 and replayed == list(range(replayed[0], 3)), steps
  assert [r["step"] for r in fresh] == [3, 4]
  for r in steps:
    assert r["policy_version"] == r["step"], steps  # version == step, replays included
    assert r["trained_episodes"] == CFG.episodes_per_step and r["stale_episodes"] == 0, steps
    assert r["tokens"] > 0
  summary = processes.parse_summary(out2)
  assert summary["step"] == STEPS
  assert summary["trained_episodes"] == STEPS * CFG.episodes_per_step
  assert (summary["stale_episodes"], summary["lost_episodes"]) == (0, 0)
  assert testing.published_weights(work)[1] == STEPS
  # The restart compiled nothing the killed learner had compiled: it loaded every program.
  cache_counts = jax_cache.parse(out2)
  assert cache_counts["hits"] == cache_counts["requests"] > 0, cache_counts


def test_a_step_with_nothing_to_train_stops_the_learner(tmp_path, cache):
  work = str(tmp_path / "work")
  # Step 2's records come from version 0: every one is staler than the bound 0.
  _write_steps(processes.paths(work)["trajectories"], STEPS, versions=[0, 0, 2, 3])
  rc, out = _learner(work, str(tmp_path / "learner.log"), cache)
  assert rc not in (0, "timeout"), out[-3000:]
  assert "EmptyStepError: learner step 2 has no trainable token" in out, out[-3000:]
  assert "8 stale" in out
  assert [r["step"] for r in processes.parse_step_lines(out)] == [1]
  summary = processes.parse_summary(out)
  assert (summary["step"], summary["trained_episodes"], summary["stale_episodes"]) == (1, 8, 8)


def test_a_missing_shard_is_counted_as_lost_and_later_steps_keep_their_boundaries(tmp_path, cache):
  work = str(tmp_path / "work")
  traj = processes.paths(work)["trajectories"]
  shards = _write_steps(traj, STEPS)
  os.remove(os.path.join(traj, shards[3]))  # step 2's second group
  rc, out = _learner(work, str(tmp_path / "learner.log"), cache, extra=", missing_timeout_s=1.0")
  assert rc == 0, out[-3000:]
  assert f"trajectory shards ['{shards[3]}'] never appeared" in out
  steps = processes.parse_step_lines(out)
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  # Step 2 trained its one remaining group; steps 3 and 4 read exactly their own groups (a
  # shifted boundary would have put a group of version s+1 into step s: stale at bound 0).
  assert [(r["trained_episodes"], r["lost_episodes"], r["stale_episodes"]) for r in steps] == [
      (8, 0, 0), (4, 4, 0), (8, 0, 0), (8, 0, 0)]
  summary = processes.parse_summary(out)
  assert summary["lost_episodes"] == CFG.attempts and summary["lost_shards"] == [shards[3]]
  assert summary["trained_episodes"] == STEPS * CFG.episodes_per_step - CFG.attempts


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
