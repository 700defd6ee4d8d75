"""The step reader: exact record counts, validation, staleness, advantages, packing, state."""

import logging
import os
import shutil
import sys
import threading

import numpy as np
import pytest

from pipeline import episodes as episodes_lib
from pipeline.config import PipelineConfig
from pipeline.step_batches import StepBatcher
from rl.episodes import ValidationSpec
from rl import trajectory_io
from rl.trajectory_io import TrajectoryWriter
from rollout.engine import Completion

SPEC = ValidationSpec(vocab_size=300, max_len=32, routing_shape=(2, 2), num_experts=4,
                      require_routing=True)
CFG = PipelineConfig(max_staleness=1, prompts_per_step=2, attempts=2, seq_len=32, batch_rows=2)


def _episode(gid, j, reward, version=0, gen=3, infra=False, hack_flags=()):
  prompt = [256, 10, 11, 12]
  comp = Completion(token_ids=list(range(20, 20 + gen)), logprobs=[-0.5] * gen,
                    routing=np.ones((2, gen, 2), np.uint8),
                    policy_versions=[version] * gen, finish_reason="stop",
                    prompt_routing=np.zeros((2, len(prompt) - 1, 2), np.uint8))
  return episodes_lib.from_completion(
      group_id=gid, episode_id=f"{gid}-{j}", group_size=2, prompt_ids=prompt,
      completion=None if infra else comp, reward=None if infra else reward,
      infra_failure=infra, hack_flags=hack_flags)


def test_episode_alignment():
  ep = _episode("g", 0, 1.0, gen=3)
  assert ep.tokens.tolist() == [256, 10, 11, 12, 20, 21, 22]
  assert ep.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1]
  # prompt positions 0..2 from prompt_routing, 3..5 from the generation steps, 6 repeats 5.
  assert ep.routing.shape == (2, 7, 2)
  assert ep.routing[0, :, 0].tolist() == [0, 0, 0, 1, 1, 1, 1]
  with pytest.raises(ValueError, match="infra failure"):
    episodes_lib.from_completion(group_id="g", episode_id="e", group_size=1, prompt_ids=[1],
                                 completion=None, reward=0.0)


def test_step_batches(tmp_path):
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  # Step 1: group a (rewards 1, 0), group b (one infra failure, one 1.0).
  w.write_all([_episode("a", 0, 1.0), _episode("a", 1, 0.0)]); w.flush()
  w.write_all([_episode("b", 0, None, infra=True), _episode("b", 1, 1.0)]); w.flush()
  # Step 2: group c is stale at learner version 3 (sampled by version 1), group d fine.
  w.write_all([_episode("c", 0, 1.0, version=1), _episode("c", 1, 0.0, version=1)]); w.flush()
  w.write_all([_episode("d", 0, 1.0, version=2), _episode("d", 1, 0.0, version=2)]); w.flush()
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  batch, info = b.next_batch(learner_version=0)
  assert info["group_ids"] == ["a", "b"] and info["trained_episodes"] == 3
  assert info["signal_groups"] == 1  # a's rewards differ; b has one valid attempt
  assert b.stats.infra_failures == 1
  # Advantages: group a gets +-1 (normalised), b's lone valid attempt 0 (no signal).
  adv = sorted(set(np.round(batch["advantages"][batch["loss_mask"] == 1], 3).tolist()))
  assert adv == [-1.0, 0.0, 1.0]
  # Packing: 3 episodes of 7 tokens in 2 rows of 32: segments restart positions.
  assert batch["tokens"].shape == (2, 32)
  assert (batch["segment_ids"] > 0).sum() == 21
  row = batch["segment_ids"][0]
  assert row[:7].tolist() == [1] * 7 and row[7:14].tolist() == [2] * 7
  assert batch["positions"][0, 7:14].tolist() == list(range(7))
  assert batch["routing"].shape == (2, 32, 2, 2)
  state = b.get_state()
  batch2, info2 = b.next_batch(learner_version=3)
  assert info2["group_ids"] == ["c", "d"] and b.stats.stale_episodes == 2
  assert info2["trained_episodes"] == 2
  assert info2["signal_groups"] == 1  # c's attempts are stale: only d's advantages count
  # Restoring the state replays step 2 exactly: nothing skipped or repeated.
  b2 = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  b2.set_state(state)
  again, info3 = b2.next_batch(learner_version=3)
  assert info3["group_ids"] == ["c", "d"]
  np.testing.assert_array_equal(again["tokens"], batch2["tokens"])


def _zero_variance_steps(directory):
  """Step 1: a (rewards 1, 0: signal), b (1, 1: no signal), c (one infra failure and a 0: no
  signal); step 2: d, e and f, each of rewards 0, 0 (no group with signal). b's attempts have 5
  generated tokens, a's 3, so the trained tokens tell which group was packed."""
  w = TrajectoryWriter(str(directory), "c", records_per_shard=2)
  w.write_all([_episode("a", 0, 1.0), _episode("a", 1, 0.0)])
  w.write_all([_episode("b", 0, 1.0, gen=5), _episode("b", 1, 1.0, gen=5)])
  w.write_all([_episode("c", 0, None, infra=True), _episode("c", 1, 0.0)])
  for gid in "def":
    w.write_all([_episode(gid, 0, 0.0), _episode(gid, 1, 0.0)])
  w.close()


@pytest.mark.parametrize("filtering", [False, True])
def test_zero_variance_groups_are_counted_and_filtered_in_their_own_step(tmp_path, filtering):
  _zero_variance_steps(tmp_path)
  cfg = PipelineConfig(max_staleness=1, prompts_per_step=3, attempts=2, seq_len=32,
                       batch_rows=2, filter_zero_variance_groups=filtering)
  b = StepBatcher(str(tmp_path), config=cfg, spec=SPEC)
  batch, info = b.next_batch(0)
  assert info["group_ids"] == ["a", "b", "c"] and info["episodes"] == 6
  assert (info["signal_groups"], info["zero_variance_groups"]) == (1, 2)
  trained = int(batch["loss_mask"].sum())
  if filtering:
    # Only a's two attempts carry loss: b's and c's tokens are not in the batch at all.
    assert info["zero_variance_filtered"] == 2 and info["trained_episodes"] == 2
    assert trained == 2 * 3 and int((batch["segment_ids"] > 0).sum()) == 2 * 7
    assert sorted(batch["advantages"][batch["loss_mask"] == 1].round(3).tolist()) == \
        [-1.0] * 3 + [1.0] * 3
  else:
    assert info["zero_variance_filtered"] == 0 and info["trained_episodes"] == 5
    assert trained == 2 * 3 + 2 * 5 + 3
  state = b.get_state()
  # Step 2 starts at d whatever step 1 filtered (the record count per step is exact). Its
  # groups are all zero-variance: trained as they are (advantages 0), not left empty.
  batch2, info2 = b.next_batch(0)
  assert info2["group_ids"] == ["d", "e", "f"]
  assert (info2["zero_variance_groups"], info2["zero_variance_filtered"]) == (3, 0)
  assert info2["trained_episodes"] == 6 and not batch2["advantages"].any()
  assert int(batch2["loss_mask"].sum()) == 6 * 3
  assert (b.stats.zero_variance_groups, b.stats.zero_variance_filtered) == \
      (5, 2 if filtering else 0)
  # The counters resume with the reader's state.
  b2 = StepBatcher(str(tmp_path), config=cfg, spec=SPEC)
  b2.set_state(state)
  assert b2.next_batch(0)[1]["group_ids"] == ["d", "e", "f"]
  assert b2.stats.zero_variance_groups == 5


def test_hack_flagged_attempts_are_counted_per_step(tmp_path):
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  w.write_all([_episode("a", 0, -1.0, hack_flags=("exit_patched",)), _episode("a", 1, 1.0)])
  w.write_all([_episode("b", 0, -1.0, hack_flags=("network", "tests_modified")),
               _episode("b", 1, -1.0, hack_flags=("network",))])
  w.write_all([_episode("c", 0, 1.0), _episode("c", 1, 0.0)])
  w.write_all([_episode("d", 0, 1.0), _episode("d", 1, 0.0)])
  w.close()
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  batch, info = b.next_batch(0)
  assert info["hack_flagged"] == 3 and info["zero_variance_groups"] == 1
  # The penalised reward is what the advantage sees: a's hacked attempt gets the negative one.
  assert sorted(batch["advantages"][batch["loss_mask"] == 1].round(3).tolist()) == \
      [-1.0] * 3 + [0.0] * 6 + [1.0] * 3
  assert b.next_batch(0)[1]["hack_flagged"] == 0
  assert b.stats.hack_flagged == 3


def test_waits_for_records_and_stops(tmp_path):
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  stop = threading.Event()
  threading.Timer(0.3, stop.set).start()
  assert b.next_batch(0, stop) is None


def test_bad_records_are_counted(tmp_path):
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=4)
  bad = _episode("a", 1, 0.0)
  bad.tokens[-1] = 999  # out of the vocabulary
  w.write_all([_episode("a", 0, 1.0), bad, _episode("b", 0, 1.0), _episode("b", 1, 0.0)])
  w.flush()
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  _, info = b.next_batch(0)
  assert b.stats.rejections == {"token_out_of_range": 1}
  assert info["trained_episodes"] == 3
  assert info["signal_groups"] == 1  # a's rejected attempt leaves it one: no advantage


def _groups(directory, gids, records_per_shard=2):
  w = TrajectoryWriter(str(directory), "c", records_per_shard=records_per_shard)
  for gid in gids:
    w.write_all([_episode(gid, 0, 1.0), _episode(gid, 1, 0.0)])
  w.close()
  return trajectory_io.list_shards(str(directory))


def test_a_missing_shard_is_lost_in_its_own_step(tmp_path):
  """Shards of 3 groups (6 records), steps of 2 groups: losing shard 1 (groups d, e, f) costs
  step 2 one group and step 3 both, and step 4 still starts at group g."""
  names = _groups(tmp_path, "abcdefghi", records_per_shard=6)
  os.remove(os.path.join(tmp_path, names[1]))
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC, missing_timeout_s=0.1)
  stop = threading.Event()
  timer = threading.Timer(60, stop.set)  # the unfixed reader waits forever for a 5th group
  timer.start()
  try:
    got = [b.next_batch(0, stop) for _ in range(2)]
    state = b.get_state()
    got += [b.next_batch(0, stop) for _ in range(2)]
  finally:
    timer.cancel()
  assert None not in got
  infos = [info for _, info in got]
  assert [i["group_ids"] for i in infos] == [["a", "b"], ["c"], [], ["g", "h"]]
  assert [i["lost_episodes"] for i in infos] == [0, 2, 4, 0]
  assert b.stats.lost_episodes == 6 and b.stats.lost_shards == [names[1]]
  assert int(got[2][0]["loss_mask"].sum()) == 0  # nothing to train: the learner loop refuses it
  # Restored between steps 2 and 3 (the lost records still owed to step 3 included).
  b2 = StepBatcher(str(tmp_path), config=CFG, spec=SPEC, missing_timeout_s=0.1)
  b2.set_state(state)
  again = [b2.next_batch(0)[1] for _ in range(2)]
  assert [(i["group_ids"], i["lost_episodes"]) for i in again] == [([], 4), (["g", "h"], 0)]
  assert b2.stats.lost_episodes == 6


class _Seen(logging.Handler):
  def __init__(self, text):
    super().__init__()
    self.text, self.event = text, threading.Event()

  def emit(self, record):
    if self.text in record.getMessage():
      self.event.set()


def test_a_late_shard_is_waited_for_and_read_in_order(tmp_path):
  names = _groups(tmp_path / "all", "abcd")
  os.makedirs(tmp_path / "live")
  for n in names[:1] + names[2:]:
    shutil.copy(tmp_path / "all" / n, tmp_path / "live" / n)
  seen = _Seen("are missing before")
  logging.getLogger("rl.rl_data").addHandler(seen)
  try:
    b = StepBatcher(str(tmp_path / "live"), config=CFG, spec=SPEC, missing_timeout_s=600)
    out = []
    reader = threading.Thread(target=lambda: out.extend(b.next_batch(0) for _ in range(2)),
                              daemon=True)
    reader.start()
    assert seen.event.wait(60), "the reader never noticed the missing shard"
    os.replace(shutil.copy(tmp_path / "all" / names[1], tmp_path / "live" / ".tmp"),
               tmp_path / "live" / names[1])
    reader.join(60)
    assert not reader.is_alive()
  finally:
    logging.getLogger("rl.rl_data").removeHandler(seen)
  assert [info["group_ids"] for _, info in out] == [["a", "b"], ["c", "d"]]
  assert b.stats.lost_episodes == 0 and b.stats.lost_shards == []


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
