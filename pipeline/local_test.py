"""The in-process pipeline end to end, and its faults: a sampler dies, the learner dies,
environments fail. Every test checks that no group is lost or consumed twice."""

import os
import sys
import threading

import pytest

from envs import reward as reward_lib
from envs.sandbox import pool as pool_lib
from pipeline import local
from pipeline import testing
from rl import checkpointing
from rl import testing as rl_testing
from rl import trajectory_io


@pytest.fixture(scope="module")
def pool():
  p = pool_lib.WarmPool(size=2)
  yield p
  p.close()


def _record(steps_log):
  def on_step(step, metrics, info):
    steps_log.append((step, dict(info), dict(metrics, trained_episodes=info["trained_episodes"])))
  return on_step


def _assert_trained(res, records, workdir, *, steps, episodes_per_step=None):
  """Every step trained episodes (the config's count where known) with a finite loss and a non-zero gradient,
  the policy version went 1..steps, and the returned learner's weights differ from the
  initial weights the run published as version 0."""
  rl_testing.assert_steps_trained(records, steps=steps, episodes_per_step=episodes_per_step)
  assert res.learner.policy_version == steps
  initial, v0 = testing.published_weights(workdir, 0)
  final, version = res.learner.sampler_weights()
  assert v0 == 0 and version == steps
  rl_testing.assert_weights_changed(initial, final)


def _written_groups(workdir):
  d = os.path.join(workdir, "trajectories")
  gids = []
  for name in trajectory_io.list_shards(d):
    gids += [r["group_id"] for r in trajectory_io.read_shard(os.path.join(d, name))]
  return gids


def test_async_run_bounded_staleness_and_weight_swaps(pool, tmp_path):
  cfg = testing.config(max_staleness=1)
  steps, groups = [], []
  res = local.run(learner=testing.learner(1), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path), config=cfg, num_steps=3, engine_config=testing.ENGINE,
                  on_step=_record(steps), on_group=groups.append)
  assert res.steps == 3 and [s for s, _, _ in steps] == [1, 2, 3]
  # Each step consumed exactly its 2 groups x 4 attempts, in release order, none twice.
  consumed = [g for _, info, _ in steps for g in info["group_ids"]]
  assert len(consumed) == len(set(consumed)) == 6
  assert consumed == [f"g{i:06d}-{groups[i].task_id}" for i in range(6)]
  assert all(info["episodes"] == 8 for _, info, _ in steps)
  assert max(info["max_lag"] for _, info, _ in steps) <= 1
  # Groups started no more than k versions behind the step they feed.
  assert all(g.start_version >= g.step - 1 for g in groups)
  # Weights moved to the samplers through the sync channel as deltas.
  assert [s["version"] for s in res.swaps][:2] == [1, 2]
  assert all(s["steps"][-1][0] in ("delta", "snapshot") for s in res.swaps)
  assert res.batcher["trained_episodes"] == 24 and res.batcher["stale_episodes"] == 0
  _assert_trained(res, [r for _, _, r in steps], str(tmp_path), steps=3,
                  episodes_per_step=cfg.episodes_per_step)


def test_synchronous_mode_has_zero_lag(pool, tmp_path):
  steps, groups = [], []
  cfg = testing.config(max_staleness=0)
  res = local.run(learner=testing.learner(0), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path), config=cfg, num_steps=2,
                  engine_config=testing.ENGINE, on_step=_record(steps), on_group=groups.append)
  assert [info["max_lag"] for _, info, _ in steps] == [0, 0]
  # k = 0: the rollouts of step s start only once the samplers serve version s.
  assert [g.start_version for g in groups] == [g.step for g in groups]
  _assert_trained(res, [r for _, _, r in steps], str(tmp_path), steps=2,
                  episodes_per_step=cfg.episodes_per_step)


def test_killed_sampler_requests_are_retried_elsewhere(pool, tmp_path):
  steps = []

  seen = {}

  def kill_first_sampler_on_its_first_request(parts):
    seen.update(parts)
    sampler = parts["samplers"].samplers[0]
    original = sampler.submit
    fired = threading.Event()

    def submit(*a, **kw):
      fut = original(*a, **kw)
      if not fired.is_set():
        fired.set()
        threading.Thread(target=sampler.engine.stop).start()  # dies with the request in flight
      return fut

    sampler.submit = submit

  res = local.run(learner=testing.learner(1), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path), config=testing.config(), num_steps=2,
                  num_samplers=2, engine_config=testing.ENGINE, on_step=_record(steps),
                  after_start=kill_first_sampler_on_its_first_request)
  assert res.sampler_retries >= 1
  dead, alive = seen["samplers"].samplers
  assert not dead.alive() and seen["samplers"].live() == [alive]
  consumed = [g for _, info, _ in steps for g in info["group_ids"]]
  assert len(consumed) == len(set(consumed)) == 4
  assert res.batcher["infra_failures"] == 0  # retried, not lost
  written = _written_groups(str(tmp_path))
  assert len(set(written)) == len(written) // 4  # every group written once, 4 attempts each
  # Retried, not lost: every step trained all its episodes.
  _assert_trained(res, [r for _, _, r in steps], str(tmp_path), steps=2,
                  episodes_per_step=testing.config().episodes_per_step)


def test_learner_restarts_from_checkpoint_and_pipeline_continues(pool, tmp_path):
  steps = []
  crashed = []

  def on_step(step, metrics, info):
    steps.append((step, info["group_ids"],
                  dict(metrics, trained_episodes=info["trained_episodes"])))
    if step == 2 and not crashed:
      crashed.append(step)
      raise RuntimeError("learner process killed")

  ckpt = checkpointing.CheckpointManager(str(tmp_path / "ckpt"), max_to_keep=2)
  res = local.run(learner=testing.learner(1), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path / "run"), config=testing.config(), num_steps=4,
                  engine_config=testing.ENGINE, checkpoints=ckpt, checkpoint_every=1,
                  on_step=on_step, learner_factory=lambda: testing.learner(1, seed=7))
  ckpt.close()
  assert res.learner_restarts == 1 and res.steps == 4
  assert [s for s, _, _ in steps] == [1, 2, 3, 4]
  consumed = [g for _, gids, _ in steps for g in gids]
  assert len(consumed) == len(set(consumed)) == 8  # nothing repeated or skipped
  assert res.learner.policy_version == 4
  # The restarted learner (another seed) restored the trained state and trained on from it.
  _assert_trained(res, [r for _, _, r in steps], str(tmp_path / "run"), steps=4,
                  episodes_per_step=testing.config().episodes_per_step)


def test_environment_failures_are_masked_not_scored_zero(pool, tmp_path):
  calls = []

  def flaky_grade(task, files, pool, config):
    calls.append(task.task_id)
    if len(calls) % 3 == 0:
      return reward_lib.Grade(reward_lib.INFRA_ERROR, None, None, {}, {}, "host lost")
    return reward_lib.grade(task, files, pool=pool, config=config)

  groups, steps = [], []
  res = local.run(learner=testing.learner(1), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path), config=testing.config(), num_steps=2,
                  engine_config=testing.ENGINE, grade_fn=flaky_grade, on_group=groups.append,
                  on_step=_record(steps))
  injected = sum(g.infra_failures for g in groups[:4])
  assert injected >= 2
  assert res.batcher["infra_failures"] == injected
  assert res.batcher["trained_episodes"] == 16 - injected
  # Masked episodes are left out of their step; the rest of each step still trains.
  _assert_trained(res, [r for _, _, r in steps], str(tmp_path), steps=2)
  assert sum(r["trained_episodes"] for _, _, r in steps) == 16 - injected
  for g in groups:
    for ep, r in zip(g.episodes, g.rewards):
      assert ep.infra_failure == (r is None)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
