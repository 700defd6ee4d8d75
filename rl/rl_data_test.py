"""RL pipeline: trajectory files, validation, grouping/advantages, packing, checkpointed state."""

import json
import os
import sys

import numpy as np
import pytest

from rl import rl_data
from rl import trajectory_io
from rl.episodes import Episode, ValidationSpec

VOCAB, LAYERS, K, EXPERTS = 32, 2, 2, 4
SPEC = ValidationSpec(vocab_size=VOCAB, max_len=16, routing_shape=(LAYERS, K),
                      num_experts=EXPERTS, require_routing=True)


def make_episode(gid, reward=1.0, *, prompt=3, completion=3, version=0, group_size=4, seed=0,
                 **overrides):
  rng = np.random.default_rng(seed)
  n = prompt + completion
  kw = dict(group_id=gid, reward=float(reward), group_size=group_size,
            tokens=rng.integers(0, VOCAB, n).astype(np.int32),
            loss_mask=np.r_[np.zeros(prompt), np.ones(completion)].astype(np.int8),
            behaviour_logprobs=np.r_[np.zeros(prompt), -rng.random(completion)].astype(np.float32),
            policy_versions=np.full(n, version, np.int32),
            routing=rng.integers(0, EXPERTS, (LAYERS, n, K)).astype(np.uint8))
  kw.update(overrides)
  return Episode(**kw)


def _collect(ds):
  return list(iter(ds))


def test_record_round_trip_and_shards(tmp_path):
  ep = make_episode("g", 1.0)
  back = Episode.from_record(ep.to_record())
  np.testing.assert_array_equal(back.tokens, ep.tokens)
  np.testing.assert_array_equal(back.routing, ep.routing)
  assert back.reward == 1.0 and back.group_id == "g"
  with trajectory_io.TrajectoryWriter(str(tmp_path), "w0", records_per_shard=2) as w:
    w.write_all([make_episode("g", i) for i in range(5)])
  assert trajectory_io.list_shards(str(tmp_path)) == [
      "w0-00000000.msgpack", "w0-00000001.msgpack", "w0-00000002.msgpack"]
  # A second writer with the same id continues the sequence instead of overwriting.
  with trajectory_io.TrajectoryWriter(str(tmp_path), "w0") as w:
    w.write(make_episode("g", 9))
  assert trajectory_io.list_shards(str(tmp_path))[-1] == "w0-00000003.msgpack"
  with pytest.raises(ValueError):
    trajectory_io.TrajectoryWriter(str(tmp_path), "bad id")


def test_grouping_advantages_rejections_and_packing(tmp_path):
  d = str(tmp_path)
  eps = [make_episode("a", r, seed=i) for i, r in enumerate([1, 0, 0, 1])]
  # Group b: one infrastructure failure (excluded from the statistics), three scored attempts.
  eps += [make_episode("b", 1, seed=10), make_episode("b", 0, seed=11),
          make_episode("b", 0, seed=12), make_episode("b", float("nan"), infra_failure=True)]
  bad = [
      make_episode("c", group_size=5, tokens=np.array([], np.int32),
                   loss_mask=np.array([], np.int8),
                   behaviour_logprobs=np.array([], np.float32),
                   policy_versions=np.array([], np.int32),
                   routing=np.zeros((LAYERS, 0, K), np.uint8)),
      make_episode("c", group_size=5, tokens=np.full(6, VOCAB + 3, np.int32)),
      make_episode("c", group_size=5, behaviour_logprobs=None),
      make_episode("c", group_size=5, routing=np.zeros((LAYERS + 1, 6, K), np.uint8)),
      make_episode("c", group_size=5, reward=float("nan")),
  ]
  with trajectory_io.TrajectoryWriter(d, "w", records_per_shard=3) as w:
    w.write_all(eps[:6] + bad + eps[6:])
  # An undecodable shard, next in the writer's sequence (13 records in shards 0-4; a hole in
  # the sequence would be missing data, see trajectory_io_test): counted, not fatal.
  with open(os.path.join(d, "w-00000005.msgpack"), "wb") as f:
    f.write(b"\xc1\xc1garbage")
  stats = rl_data.PipelineStats()
  ds = rl_data.rl_dataset(d, spec=SPEC, seq_len=16, batch_rows=2, version_fn=lambda: 0,
                          stats=stats)
  batches = _collect(ds)
  assert stats.rejections == {"empty": 1, "token_out_of_range": 1, "missing_logprobs": 1,
                              "routing_shape": 1, "nan_reward": 1, "undecodable": 1}
  assert stats.infra_failures == 1 and stats.groups == 2
  assert stats.small_groups == 1  # group c: every attempt rejected
  assert stats.episodes == 7
  rows = [(b["tokens"][r], b["segment_ids"][r], b["positions"][r], b["advantages"][r],
           b["loss_mask"][r], b["routing"][r]) for b in batches for r in range(2)]
  assert batches[0]["routing"].shape == (2, 16, LAYERS, K)
  advs = []
  for tokens, seg, pos, adv, mask, _ in rows:
    for s in range(1, seg.max() + 1):
      idx = np.where(seg == s)[0]
      np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart
      np.testing.assert_array_equal(mask[idx], [0, 0, 0, 1, 1, 1])  # only completions train
      advs.append(float(adv[idx[0]]))
  # Group a: rewards 1,0,0,1 -> +-1. Group b: rewards 1,0,0 -> (2/3, -1/3, -1/3) / std.
  std_b = np.std([1.0, 0.0, 0.0])
  want = sorted([1, -1, -1, 1] + [(2 / 3) / std_b, (-1 / 3) / std_b, (-1 / 3) / std_b])
  np.testing.assert_allclose(sorted(advs), want, rtol=1e-5)


def test_staleness_filter(tmp_path):
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "w") as w:
    w.write_all([make_episode("a", r, version=v, group_size=4, seed=i)
                 for i, (r, v) in enumerate([(1, 9), (0, 9), (1, 2), (0, 9)])])
  stats = rl_data.PipelineStats()
  cfg = rl_data.GroupingConfig(max_staleness=4)
  batches = _collect(rl_data.rl_dataset(d, spec=SPEC, seq_len=16, batch_rows=1,
                                        version_fn=lambda: 10, config=cfg, stats=stats))
  assert stats.stale_episodes == 1 and stats.episodes == 3
  assert sum(int(b["segment_ids"].max()) for b in batches) == 3


def test_iterator_state_resumes_without_repeat_or_skip(tmp_path):
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "w", records_per_shard=5) as w:
    for g in range(6):
      w.write_all([make_episode(f"g{g}", (g + i) % 2, seed=10 * g + i) for i in range(4)])

  def make():
    return rl_data.rl_dataset(d, spec=SPEC, seq_len=16, batch_rows=2, version_fn=lambda: 0)

  full = _collect(make())
  it = iter(make())
  next(it)
  next(it)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON round trip
  resumed = iter(make())
  resumed.set_state(state)
  rest = list(resumed)
  assert len(rest) == len(full) - 2 and rest
  for a, b in zip(full[2:], rest):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_follow_mode_sees_new_shards(tmp_path):
  d = str(tmp_path)
  w = trajectory_io.TrajectoryWriter(d, "w", records_per_shard=4)
  w.write_all([make_episode("a", i % 2, seed=i) for i in range(4)])
  ds = rl_data.rl_dataset(d, spec=SPEC, seq_len=16, batch_rows=1, version_fn=lambda: 0,
                          follow=True, idle_timeout_s=0.2)
  it = iter(ds)
  first = next(it)
  w.write_all([make_episode("b", i % 2, seed=9 + i) for i in range(4)])
  rest = list(it)
  assert int(first["segment_ids"].max()) + sum(int(b["segment_ids"].max()) for b in rest) == 8


def test_each_segment_of_a_summarised_episode_is_its_own_example(tmp_path):
  """Group a: a-0 ran in two context windows of 10 and 12 tokens (22 > seq_len 16), a-1 in
  one. Each segment becomes its own packed sequence (positions from 0) with a-0's advantage;
  the episode counts once. A state saved between a-0's two segments resumes at the second."""
  d = str(tmp_path)
  mask = np.r_[np.zeros(3), np.ones(7), np.zeros(4), np.ones(8)].astype(np.int8)
  seg = make_episode("a", 1.0, prompt=3, completion=19, group_size=2, seed=1, loss_mask=mask,
                     segment_lengths=np.array([10, 12], np.int32))
  with trajectory_io.TrajectoryWriter(d, "w") as w:
    w.write_all([seg, make_episode("a", 0.0, group_size=2, seed=2)])
  stats = rl_data.PipelineStats()

  def make():
    return rl_data.rl_dataset(d, spec=SPEC, seq_len=16, batch_rows=1, version_fn=lambda: 0,
                              stats=stats)

  batches = _collect(make())
  assert stats.episodes == 2 and stats.rejections == {}
  seqs = {}
  for b in batches:
    for s in range(1, int(b["segment_ids"].max()) + 1):
      idx = np.where(b["segment_ids"][0] == s)[0]
      np.testing.assert_array_equal(b["positions"][0, idx], np.arange(len(idx)))
      seqs[tuple(b["tokens"][0, idx])] = (b["loss_mask"][0, idx], b["advantages"][0, idx],
                                          b["routing"][0, idx])
  assert len(seqs) == 3
  for start, end in ((0, 10), (10, 22)):
    m, adv, routing = seqs[tuple(seg.tokens[start:end])]
    np.testing.assert_array_equal(m, seg.loss_mask[start:end])
    np.testing.assert_allclose(adv, 1.0, rtol=1e-5)
    np.testing.assert_array_equal(routing, np.transpose(seg.routing[:, start:end], (1, 0, 2)))
  # The grouping stage alone: the state after a-0's first segment holds its second.
  grouped = rl_data.GroupAndScore(rl_data.TrajectorySource(d), spec=SPEC,
                                  config=rl_data.GroupingConfig(), version_fn=lambda: 0)
  it = iter(grouped)
  first = next(it)
  state = json.loads(json.dumps(it.get_state()))
  resumed = iter(rl_data.GroupAndScore(rl_data.TrajectorySource(d), spec=SPEC,
                                       config=rl_data.GroupingConfig(), version_fn=lambda: 0))
  resumed.set_state(state)
  rest = list(resumed)
  assert [len(x["tokens"]) for x in [first] + rest] == [10, 12, 6]
  np.testing.assert_array_equal(rest[0]["tokens"], seg.tokens[10:])


def test_config_errors(tmp_path):
  with pytest.raises(ValueError, match="max_len"):
    rl_data.rl_dataset(str(tmp_path), spec=SPEC, seq_len=8, batch_rows=1, version_fn=lambda: 0)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
