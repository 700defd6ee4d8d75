"""The step reader: exact record counts, validation, staleness, advantages, packing, state."""

import sys
import threading

import numpy as np
import pytest

from pipeline import episodes as episodes_lib
from pipeline.config import PipelineConfig
from pipeline.step_batches import StepBatcher
from rl.episodes import ValidationSpec
from rl.trajectory_io import TrajectoryWriter
from rollout.engine import Completion

SPEC = ValidationSpec(vocab_size=300, max_len=32, routing_shape=(2, 2), num_experts=4,
                      require_routing=True)
CFG = PipelineConfig(max_staleness=1, prompts_per_step=2, attempts=2, seq_len=32, batch_rows=2)


def _episode(gid, j, reward, version=0, gen=3, infra=False):
  prompt = [256, 10, 11, 12]
  comp = Completion(token_ids=list(range(20, 20 + gen)), logprobs=[-0.5] * gen,
                    routing=np.ones((2, gen, 2), np.uint8),
                    policy_versions=[version] * gen, finish_reason="stop",
                    prompt_routing=np.zeros((2, len(prompt) - 1, 2), np.uint8))
  return episodes_lib.from_completion(
      group_id=gid, episode_id=f"{gid}-{j}", group_size=2, prompt_ids=prompt,
      completion=None if infra else comp, reward=None if infra else reward,
      infra_failure=infra)


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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
