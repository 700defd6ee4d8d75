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
from rl.episodes import Episode, ValidationSpec
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


def test_negative_advantage_scale_damps_below_average_attempts(tmp_path):
  _zero_variance_steps(tmp_path)
  cfg = PipelineConfig(max_staleness=1, prompts_per_step=3, attempts=2, seq_len=32,
                       batch_rows=2, filter_zero_variance_groups=True,
                       negative_advantage_scale=0.25)
  batch, info = StepBatcher(str(tmp_path), config=cfg, spec=SPEC).next_batch(0)
  # a's pass keeps +1; its failure's -1 becomes -0.25 (still trained, so still in the batch).
  assert info["trained_episodes"] == 2
  assert sorted(batch["advantages"][batch["loss_mask"] == 1].round(3).tolist()) == \
      [-0.25] * 3 + [1.0] * 3
  with pytest.raises(ValueError, match="negative_advantage_scale"):
    PipelineConfig(negative_advantage_scale=-0.5)


def test_row_buckets_cut_the_batch_to_the_rows_its_episodes_fill(tmp_path):
  """Step 1 filtered: a's two episodes (14 tokens) fill one row of 32; unfiltered, five
  episodes (39 tokens) fill two. With buckets of one row the batch has exactly those rows, the
  same as the first rows of the full batch, whose other rows are empty; with one bucket it is
  always batch_rows rows."""
  _zero_variance_steps(tmp_path)
  base = dict(max_staleness=1, prompts_per_step=3, attempts=2, seq_len=32, batch_rows=4)
  for filtering, want_rows in ((True, 1), (False, 2)):
    full, _ = StepBatcher(str(tmp_path), config=PipelineConfig(
        **base, filter_zero_variance_groups=filtering), spec=SPEC).next_batch(0)
    cut, info = StepBatcher(str(tmp_path), config=PipelineConfig(
        **base, filter_zero_variance_groups=filtering, row_buckets=4), spec=SPEC).next_batch(0)
    assert full["tokens"].shape == (4, 32)
    assert info["trained_episodes"] == (2 if filtering else 5)
    assert info["rows"] == want_rows  # what the learner computes: rows x seq_len positions
    for name, a in cut.items():
      assert a.shape[0] == want_rows, name
      np.testing.assert_array_equal(a, full[name][:want_rows], err_msg=name)
      assert not full[name][want_rows:].any(), name  # nothing trained was cut
  # Two buckets of two rows: the filtered step's one row is rounded up to two.
  half, info = StepBatcher(str(tmp_path), config=PipelineConfig(
      **base, filter_zero_variance_groups=True, row_buckets=2), spec=SPEC).next_batch(0)
  assert half["tokens"].shape == (2, 32) and info["rows"] == 2
  with pytest.raises(ValueError, match="row_buckets"):
    PipelineConfig(**dict(base, batch_rows=6), row_buckets=4)


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


def _segmented(gid, j, reward, lengths, *, first_token=20, model_from=4, versions=None):
  """An attempt in context segments of `lengths`: each opens with `model_from` context tokens
  (prompt, or the summary request that carries the previous segment on) and then has the
  model's tokens; token ids count up from `first_token`, routing is the token's layer-tagged id
  so a misplaced slice shows; versions[i] is the policy version of segment i's tokens."""
  n = int(sum(lengths))
  mask = np.concatenate([np.r_[np.zeros(model_from), np.ones(m - model_from)]
                         for m in lengths]).astype(np.int8)
  versions = versions or [0] * len(lengths)
  routing = np.stack([np.stack([np.arange(n) % 4, (np.arange(n) + l) % 4], -1)
                      for l in range(2)]).astype(np.uint8)
  return Episode(group_id=gid, episode_id=f"{gid}-{j}", group_size=2, reward=reward,
                 tokens=np.arange(first_token, first_token + n, dtype=np.int32), loss_mask=mask,
                 behaviour_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
                 policy_versions=np.repeat(np.array(versions, np.int32), lengths),
                 routing=routing,
                 segment_lengths=(np.array(lengths, np.int32) if len(lengths) > 1 else None))


def test_each_segment_of_an_episode_is_its_own_sequence(tmp_path):
  """a-0 summarised itself once: segments of 24 and 16 tokens (40 in all, more than a row of
  32), the second sampled after a weight swap (version 1). Each lands as its own sequence,
  positions from 0, own segment id, the episode's advantage, in whichever row has room."""
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  w.write_all([_segmented("a", 0, 1.0, [24, 16], first_token=100, versions=[0, 1]),
               _segmented("a", 1, 0.0, [7])])
  w.write_all([_episode("b", 0, 1.0), _episode("b", 1, 0.0)])
  w.close()
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  batch, info = b.next_batch(learner_version=1)
  assert info["episodes"] == 4 and info["trained_episodes"] == 4
  assert b.stats.overflow_episodes == 0 and b.stats.trained_episodes == 4
  # The lag is over every model token of the episode: its first segment was sampled by 0.
  assert info["max_lag"] == 1
  ep = _segmented("a", 0, 1.0, [24, 16], first_token=100, versions=[0, 1])
  found, advs = [], []
  for start, end in ((0, 24), (24, 40)):
    r, c = np.argwhere(batch["tokens"] == ep.tokens[start])[0]
    sl = slice(c, c + end - start)
    found.append((r, batch["segment_ids"][r, c]))
    np.testing.assert_array_equal(batch["tokens"][r, sl], ep.tokens[start:end])
    np.testing.assert_array_equal(batch["positions"][r, sl], np.arange(end - start))
    assert (batch["segment_ids"][r, sl] == batch["segment_ids"][r, c]).all()
    assert c + end - start == 32 or batch["segment_ids"][r, c + end - start] != \
        batch["segment_ids"][r, c]  # the sequence ends where the segment does
    np.testing.assert_array_equal(batch["loss_mask"][r, sl], ep.loss_mask[start:end])
    advs.append(batch["advantages"][r, sl])
    np.testing.assert_array_equal(batch["policy_versions"][r, sl],
                                  np.where(ep.loss_mask[start:end], ep.policy_versions[start:end],
                                           0))
    np.testing.assert_array_equal(batch["routing"][r, sl],
                                  np.transpose(ep.routing[:, start:end], (1, 0, 2)))
  assert len(set(found)) == 2  # two sequences (here in different rows: 24 + 16 > 32)
  # Both carry the episode's advantage (a's rewards 1 and 0: +1 once normalised).
  np.testing.assert_array_equal(np.concatenate(advs), advs[0][0])
  np.testing.assert_allclose(advs[0][0], 1.0, rtol=1e-5)
  assert (batch["policy_versions"][batch["tokens"] >= 124] == 1).sum() == 12
  # 3 sequences of the other episodes + 2 of a-0: 5 in the batch, every token placed once.
  assert sum(len(set(row[row > 0])) for row in batch["segment_ids"]) == 5
  assert int((batch["segment_ids"] > 0).sum()) == 40 + 3 * 7


def test_an_episode_whose_segment_does_not_fit_is_dropped_whole(tmp_path):
  """One row of 32: a-0's first segment (20) fits, its second (20) then does not. None of a-0
  is placed, it counts as overflow, and the room its first segment would have taken goes to
  the three 7-token attempts (21 tokens, which would not fit beside it)."""
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  w.write_all([_segmented("a", 0, 1.0, [20, 20], first_token=100), _episode("a", 1, 0.0)])
  w.write_all([_episode("b", 0, 1.0), _episode("b", 1, 0.0)])
  w.close()
  cfg = PipelineConfig(max_staleness=1, prompts_per_step=2, attempts=2, seq_len=32,
                       batch_rows=1)
  b = StepBatcher(str(tmp_path), config=cfg, spec=SPEC)
  batch, info = b.next_batch(learner_version=0)
  assert info["trained_episodes"] == 3 and b.stats.overflow_episodes == 1
  assert not np.isin(batch["tokens"], np.arange(100, 140)).any()  # nothing of a-0 is placed
  assert int((batch["segment_ids"] > 0).sum()) == 21
  assert batch["segment_ids"][0, :21].tolist() == [1] * 7 + [2] * 7 + [3] * 7


def test_a_bad_segmentation_is_rejected_with_its_reason(tmp_path):
  bad = _segmented("a", 0, 1.0, [20, 10])
  bad.segment_lengths = np.array([20, 9], np.int32)  # one token short of the episode
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  w.write_all([bad, _episode("a", 1, 0.0)])
  w.write_all([_episode("b", 0, 1.0), _episode("b", 1, 0.0)])
  w.close()
  b = StepBatcher(str(tmp_path), config=CFG, spec=SPEC)
  _, info = b.next_batch(learner_version=0)
  assert b.stats.rejections == {"segment_lengths_sum": 1}
  assert info["rejected_episodes"] == 1 and info["trained_episodes"] == 3


def test_a_learner_step_trains_on_segmented_episodes(tmp_path):
  """The packed batch of self-summarised episodes drives a real learner step: finite loss,
  weights move, and every trained token of every segment is a target (none is lost at a
  segment boundary, none predicted across one)."""
  from moe import params  # pylint: disable=g-import-not-at-top
  from moe import sharding  # pylint: disable=g-import-not-at-top
  from moe.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from rl import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from rl.train_step import LossConfig  # pylint: disable=g-import-not-at-top
  model = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, max_seq_len=64)
  w = TrajectoryWriter(str(tmp_path), "c", records_per_shard=2)
  w.write_all([_segmented("a", 0, 1.0, [24, 16], first_token=100, versions=[0, 1]),
               _segmented("a", 1, 0.0, [10, 12], first_token=40, versions=[1, 1])])
  w.write_all([_episode("b", 0, 1.0), _episode("b", 1, 0.0)])
  w.close()
  spec = ValidationSpec(vocab_size=model.vocab_size, max_len=32, routing_shape=(2, 2),
                        num_experts=4, require_routing=True)
  cfg = PipelineConfig(max_staleness=1, prompts_per_step=2, attempts=2, seq_len=64,
                       batch_rows=2)
  batch, info = StepBatcher(str(tmp_path), config=cfg, spec=spec).next_batch(learner_version=1)
  assert info["trained_episodes"] == 4
  assert sum(len(set(row[row > 0])) for row in batch["segment_ids"]) == 2 + 2 + 1 + 1
  learner = learner_lib.build_learner(
      learner_lib.LearnerConfig(loss=LossConfig(objective="policy", replay="on")), model,
      mesh=sharding.make_mesh((1, 1, 1, 1)), seed=0, max_staleness=1)
  learner.state = learner.state.replace(
      policy_version=np.asarray(1, np.int32))  # the version the batch was read for
  before = params.flatten(learner.model())
  m = learner.train_step(batch)
  assert np.isfinite(float(m["loss"]))
  assert m["tokens"] == float(batch["loss_mask"].sum())
  after = params.flatten(learner.model())
  assert any(not np.array_equal(before[k], after[k]) for k in before)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
