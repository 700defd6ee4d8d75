"""Tests for trajectory.Segment: per-token data stays aligned or the segment refuses it."""

import sys

import numpy as np
import pytest

from envs.harness import policy
from envs.harness import trajectory


def _completion(n, *, logprobs=True, versions=True, routing_shape="ok", start=0):
  ids = list(range(100 + start, 100 + start + n))
  routing = None
  if routing_shape == "ok":
    routing = np.arange(2 * n * 3).reshape(2, n, 3) + start
  elif routing_shape is not None:
    routing = np.zeros(routing_shape, np.int32)
  return policy.Completion(token_ids=ids, text="x" * n,
                           logprobs=[-0.5 - i for i in range(n)] if logprobs else None,
                           routing=routing,
                           policy_versions=[7] * n if versions else None)


def test_segment_aligns_text_and_model_tokens_with_routing():
  seg = trajectory.Segment()
  seg.add_text_tokens([1, 2, 3])
  seg.add_completion(_completion(2))
  seg.add_text_tokens([4])
  seg.add_completion(_completion(3, start=10, versions=False))
  assert seg.token_ids == [1, 2, 3, 100, 101, 4, 110, 111, 112]
  assert seg.model_mask == [False] * 3 + [True] * 2 + [False] + [True] * 3
  assert seg.logprobs == [0.0] * 3 + [-0.5, -1.5] + [0.0] + [-0.5, -1.5, -2.5]
  assert seg.policy_versions == [-1] * 3 + [7, 7] + [-1] + [-1] * 3
  r = seg.routing
  assert r.shape == (2, 9, 3)
  assert np.all(r[:, [0, 1, 2, 5]] == -1)
  np.testing.assert_array_equal(r[:, 3:5], np.arange(12).reshape(2, 2, 3))
  np.testing.assert_array_equal(r[:, 6:9], np.arange(18).reshape(2, 3, 3) + 10)


def test_no_routing_reported_is_none_not_an_error():
  seg = trajectory.Segment()
  seg.add_completion(_completion(2, routing_shape=None, logprobs=False))
  assert seg.routing is None and seg.logprobs == [0.0, 0.0]


@pytest.mark.parametrize("shape,match", [
    ((2, 3, 3), r"shape \(2, 3, 3\), expected \(moe_layers, 2, k\)"),
    ((2, 2), r"expected \(moe_layers, 2, k\)"),
])
def test_routing_of_wrong_length_raises(shape, match):
  seg = trajectory.Segment()
  with pytest.raises(trajectory.ShapeMismatch, match=match):
    seg.add_completion(_completion(2, routing_shape=shape))
  assert seg.token_ids == []  # nothing half-added


def test_routing_with_other_layers_or_k_than_the_segment_raises():
  seg = trajectory.Segment()
  seg.add_completion(_completion(2))
  for shape in ((3, 2, 3), (2, 2, 1)):
    with pytest.raises(trajectory.ShapeMismatch, match="earlier completions"):
      seg.add_completion(_completion(2, routing_shape=shape))
  assert len(seg) == 2


def test_per_token_lists_of_wrong_length_raise():
  seg = trajectory.Segment()
  c = _completion(3)
  c.logprobs = c.logprobs[:2]
  with pytest.raises(trajectory.ShapeMismatch, match="3 tokens but 2 logprobs"):
    seg.add_completion(c)
  c = _completion(3)
  c.policy_versions = [1] * 4
  with pytest.raises(trajectory.ShapeMismatch, match="3 tokens but 4 policy_versions"):
    seg.add_completion(c)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
