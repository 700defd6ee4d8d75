"""RolloutController restarts and write faults, in-process (#17 items 6 and 7).

The task of group g is a function of g (so a restarted controller neither repeats nor skips a
task), `resume` accepts only written groups that match that order, failed trajectory writes are
retried without duplicating a record, a write that keeps failing stops the run with a message
naming the path and the error, and the summary counts what was generated, written, retried and
lost. The multi-process kill-and-restart scenario is pipeline/part_restarts_test.py; the
operator's view of a persistent write error (`rl_part controller` exits 1) is
tools/rl_part_errors_test.py.
"""

import logging
import os
import random
import sys
import tempfile

import pytest

from envs import reward as reward_lib
from envs.sandbox import pool as pool_lib
from moe import build
from moe import params as moe_params
from moe.tokenizer import ByteTokenizer
from pipeline import controller as controller_lib
from pipeline import samplers as samplers_lib
from pipeline import testing
from pipeline.local import group_sink
from pipeline.step_batches import StepBatcher
from rl import trajectory_io
from rl.episodes import ValidationSpec
from rollout.engine import Engine


def _controller(tasks, **kw):
  return controller_lib.RolloutController(tasks, None, None, lambda eps: None,
                                          config=testing.config(seed=7), **kw)


def test_the_task_of_a_group_depends_only_on_its_index():
  tasks = testing.tasks(5)
  # The order a single pass-by-pass stream gives: a seeded reshuffle of the tasks every pass.
  rng, expect = random.Random(7), []
  for _ in range(3):
    order = list(tasks)
    rng.shuffle(order)
    expect += [t.task_id for t in order]
  assert [_controller(tasks).task_for(i).task_id for i in range(15)] == expect
  # Asked out of order (as a controller restarted at group 12 does), the answers are the same.
  late = _controller(tasks)
  assert [late.task_for(i).task_id for i in (12, 3, 14, 0)] == [expect[i] for i in (12, 3, 14, 0)]
  for p in range(3):
    assert sorted(expect[5 * p:5 * p + 5]) == sorted(t.task_id for t in tasks)


def test_resume_continues_after_the_written_groups_and_refuses_inconsistent_ones():
  tasks = testing.tasks(5)
  ctl = _controller(tasks)
  ids = lambda idx: [f"g{i:06d}-{ctl.task_for(i).task_id}" for i in idx for _ in range(4)]
  assert ctl.resume(ids(range(7))) == 7 and ctl.groups_written == 7
  assert _controller(tasks).resume([]) == 0
  with pytest.raises(ValueError, match=r"missing \[2\]"):
    _controller(tasks).resume(ids([0, 1, 3]))
  with pytest.raises(ValueError, match="other than 4 records"):
    _controller(tasks).resume(ids([0, 1]) + ids([1]))
  wrong = f"g000000-{ctl.task_for(1).task_id}"
  assert ctl.task_for(0).task_id != ctl.task_for(1).task_id
  with pytest.raises(ValueError, match="other tasks or another seed"):
    _controller(tasks).resume([wrong] * 4)
  with pytest.raises(ValueError, match="not g<index>-<task_id>"):
    _controller(tasks).resume(["group-7"])


@pytest.fixture(scope="module")
def sampler():
  engine = Engine.from_flat(moe_params.flatten(build.create(testing.MODEL, seed=0)),
                            testing.MODEL, tokenizer=ByteTokenizer(), config=testing.ENGINE)
  yield samplers_lib.SamplerSet([samplers_lib.EngineSampler(engine)])
  engine.stop()


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=1) as p:
    yield p


_MKSTEMP = tempfile.mkstemp


class _FailingMkstemp:
  """tempfile.mkstemp for the trajectory writer that raises PermissionError `times` times (as an
  unwritable or briefly unavailable directory does), then creates the file for real."""

  def __init__(self, times):
    self.times = times
    self.calls = 0

  def __call__(self, *args, dir=None, **kw):  # pylint: disable=redefined-builtin
    self.calls += 1
    if self.calls <= self.times:
      raise PermissionError(13, "Permission denied", os.path.join(dir, ".tmp-x"))
    return _MKSTEMP(*args, dir=dir, **kw)


def _records(directory):
  return [r for n in trajectory_io.list_shards(directory)
          for r in trajectory_io.read_shard(os.path.join(directory, n))]


def test_a_transient_write_error_is_retried_and_reported(tmp_path, monkeypatch, sampler, pool,
                                                         caplog):
  d = str(tmp_path / "trajectories")
  writer = trajectory_io.TrajectoryWriter(d, "ctl", records_per_shard=4)
  monkeypatch.setattr(trajectory_io.tempfile, "mkstemp", _FailingMkstemp(2))
  ctl = controller_lib.RolloutController(
      testing.tasks(2), sampler, pool, group_sink(writer), config=testing.config(),
      sink_path=d, write_backoff_s=0.01)
  with caplog.at_level(logging.WARNING, logger=controller_lib.__name__):
    assert ctl.run(num_steps=1) == 2
  recs = _records(d)
  # Every attempt of both groups on disk exactly once: the retries wrote no record twice.
  assert sorted(r["episode_id"] for r in recs) == sorted(
      f"g{g:06d}-{ctl.task_for(g).task_id}-a{a}" for g in range(2) for a in range(4))
  retried = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
  assert len(retried) == 2 and all(d in m and "Permission denied" in m for m in retried)
  s = ctl.summary()
  assert (s["write_retries"], s["episodes_generated"], s["episodes_written"],
          s["episodes_lost"], s["groups_written"]) == (2, 8, 8, 0, 2)


def test_a_persistent_write_error_stops_the_run_naming_path_and_error(tmp_path, monkeypatch,
                                                                       sampler, pool):
  d = str(tmp_path / "trajectories")
  writer = trajectory_io.TrajectoryWriter(d, "ctl", records_per_shard=4)
  mkstemp = _FailingMkstemp(10**9)
  monkeypatch.setattr(trajectory_io.tempfile, "mkstemp", mkstemp)
  ctl = controller_lib.RolloutController(
      testing.tasks(2), sampler, pool, group_sink(writer), config=testing.config(),
      sink_path=d, write_attempts=3, write_backoff_s=0.01)
  with pytest.raises(controller_lib.WriteFailed) as err:
    ctl.run(num_steps=1)
  msg = str(err.value)
  assert d in msg and "PermissionError" in msg and "group 0" in msg, msg
  assert mkstemp.calls == 3 and not trajectory_io.list_shards(d)
  s = ctl.summary()
  assert s["groups_written"] == 0 and s["write_retries"] == 2 and s["episodes_written"] == 0
  assert s["episodes_lost"] == s["episodes_generated"] >= 4


def test_a_hacking_attempt_is_penalised_and_counted_in_its_step(tmp_path, sampler, pool):
  """Group 0's attempts also add a conftest.py (envs.hacks flags conftest_added): real
  grading gives them reward 0 - hack_penalty before any advantage, the records carry the flags,
  and the learner's step counts them. Group 1's solutions are graded as they are."""
  d = str(tmp_path / "trajectories")
  writer = trajectory_io.TrajectoryWriter(d, "ctl", records_per_shard=4)
  tasks, cfg = testing.tasks(2), testing.config()
  hacked_task = controller_lib.RolloutController(
      tasks, None, None, lambda eps: None, config=cfg).task_for(0).task_id

  def grade(task, files, pool, config):
    if task.task_id == hacked_task:
      files = dict(files, **{"conftest.py": "import sys\n"})
    return reward_lib.grade(task, files, pool=pool, config=config)

  ctl = controller_lib.RolloutController(
      tasks, sampler, pool, group_sink(writer), config=cfg, grade_fn=grade,
      reward_config=reward_lib.RewardConfig(hack_penalty=0.5))
  assert ctl.run(num_steps=1) == 2
  writer.close()
  recs = _records(d)
  hacked = [r for r in recs if r["group_id"].endswith(hacked_task)]
  clean = [r for r in recs if not r["group_id"].endswith(hacked_task)]
  assert len(hacked) == len(clean) == 4
  assert all(r["reward"] == -0.5 and "conftest_added" in r["hack_flags"] for r in hacked), hacked
  assert all(0.0 <= r["reward"] <= 1.0 and r["hack_flags"] == [] for r in clean), clean
  spec = ValidationSpec(vocab_size=testing.MODEL.vocab_size, max_len=cfg.seq_len)
  _, info = StepBatcher(d, config=cfg, spec=spec, include_routing=False).next_batch(0)
  assert info["episodes"] == 8 and info["hack_flagged"] == 4
  assert info["zero_variance_groups"] >= 1  # the hacked group's rewards are all -0.5


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
