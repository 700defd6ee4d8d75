"""Episode records: the round trip (segments included, old records readable) and validation."""

import sys

import numpy as np
import pytest

from rl import trajectory_io
from rl.episodes import Episode, ValidationSpec, validate

VOCAB, LAYERS, K, EXPERTS = 32, 2, 2, 4
SPEC = ValidationSpec(vocab_size=VOCAB, max_len=8, routing_shape=(LAYERS, K),
                      num_experts=EXPERTS, require_routing=True)


def _episode(n=7, segment_lengths=None, seed=0, **overrides):
  """An attempt of n tokens whose odd positions are the model's (every segment trains some)."""
  rng = np.random.default_rng(seed)
  mask = (np.arange(n) % 2).astype(np.int8)
  kw = dict(group_id="g", reward=1.0, group_size=2, episode_id="g-0",
            tokens=rng.integers(0, VOCAB, n).astype(np.int32), loss_mask=mask,
            behaviour_logprobs=np.where(mask, -rng.random(n), 0.0).astype(np.float32),
            policy_versions=np.repeat(np.array([3, 4], np.int32), [n // 2, n - n // 2]),
            routing=rng.integers(0, EXPERTS, (LAYERS, n, K)).astype(np.uint8),
            segment_lengths=(None if segment_lengths is None
                             else np.asarray(segment_lengths, np.int32)))
  kw.update(overrides)
  return Episode(**kw)


def _assert_same(a: Episode, b: Episode):
  for name in ("tokens", "loss_mask", "behaviour_logprobs", "policy_versions", "routing"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  assert (a.group_id, a.reward, a.group_size, a.episode_id) == (
      b.group_id, b.reward, b.group_size, b.episode_id)


def test_record_round_trip_with_and_without_segments(tmp_path):
  seg = _episode(12, [5, 7])
  plain = _episode(7)
  rec = seg.to_record()
  assert "segment_lengths" in rec and "segment_lengths" not in plain.to_record()
  # Through the trajectory files too (msgpack), as the learner reads them.
  with trajectory_io.TrajectoryWriter(str(tmp_path), "w") as w:
    w.write_all([seg, plain])
  (shard,) = trajectory_io.list_shards(str(tmp_path))
  back_seg, back_plain = (Episode.from_record(r)
                          for r in trajectory_io.read_shard(str(tmp_path / shard)))
  _assert_same(back_seg, seg)
  assert back_seg.segment_lengths.dtype == np.int32
  assert back_seg.segment_lengths.tolist() == [5, 7]
  assert back_seg.segment_bounds() == [(0, 5), (5, 12)]
  _assert_same(back_plain, plain)
  assert back_plain.segment_lengths is None and back_plain.segment_bounds() == [(0, 7)]
  # A record written before the field existed (no key at all) reads as one segment.
  old = dict(rec)
  del old["segment_lengths"]
  assert Episode.from_record(old).segment_lengths is None


@pytest.mark.parametrize("n, segments, reason", [
    (7, None, None),
    (12, [5, 7], None),          # longer than max_len as a whole: each segment is within it
    (12, [4, 4, 4], None),
    (12, None, "too_long"),      # one segment of 12 > 8
    (12, [3, 9], "segment_too_long"),
    (12, [5, 6], "segment_lengths_sum"),
    (12, [5, 8], "segment_lengths_sum"),
    (12, [0, 12], "bad_segment_lengths"),
    (12, [-2, 14], "bad_segment_lengths"),
    (12, [], "bad_segment_lengths"),
    (12, [[6, 6]], "bad_segment_lengths"),
])
def test_validate_checks_segment_lengths(n, segments, reason):
  ep = _episode(n)
  if segments is not None:
    ep.segment_lengths = np.asarray(segments, np.int32)
  assert validate(ep, SPEC) == reason


def test_validate_rejects_float_segment_lengths_and_routing_of_one_segment():
  ep = _episode(12, [5, 7])
  ep.segment_lengths = np.array([5.0, 7.0])
  assert validate(ep, SPEC) == "bad_segment_lengths"
  # Routing covers the whole episode (every segment), not just one of them.
  ep = _episode(12, [5, 7])
  ep.routing = ep.routing[:, :7]
  assert validate(ep, SPEC) == "routing_shape"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
