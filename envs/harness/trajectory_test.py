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
  # Row j of a completion's routing is the step whose input was the token before it: the first
  # completion (prompt of 3) covers positions 2..3, the second (prompt of 6) 5..7; the last
  # token (8) was never fed to the sampler, and no prefill routing was reported.
  assert np.all(r[:, [0, 1, 4, 8]] == -1)
  np.testing.assert_array_equal(r[:, 2:4], np.arange(12).reshape(2, 2, 3))
  np.testing.assert_array_equal(r[:, 5:8], np.arange(18).reshape(2, 3, 3) + 10)


def test_prompt_routing_covers_harness_text_and_decode_routing_wins():
  seg = trajectory.Segment()
  seg.add_text_tokens([1, 2, 3])
  c = _completion(2)
  c.prompt_routing = np.full((2, 2, 3), 50)  # positions 0, 1
  seg.add_completion(c)
  seg.add_text_tokens([4, 5])
  c2 = _completion(1, start=10)
  # The second prompt has 7 tokens: its prefill covers positions 0..5; its rows for 2..3
  # (decoded earlier) and 0..1 (covered by the first prefill) are ignored, 4..5 are new.
  c2.prompt_routing = np.full((2, 6, 3), 60)
  seg.add_completion(c2)
  r = seg.routing
  assert r.shape == (2, 8, 3)
  assert np.all(r[:, 0:2] == 50)
  np.testing.assert_array_equal(r[:, 2:4], np.arange(12).reshape(2, 2, 3))
  np.testing.assert_array_equal(r[:, 6], (np.arange(6) + 10).reshape(2, 3))  # decode of c2
  assert np.all(r[:, 4:6] == 60)
  assert np.all(r[:, 7] == -1)  # the last token: never processed


def test_prompt_routing_of_wrong_length_raises():
  seg = trajectory.Segment()
  seg.add_text_tokens([1, 2, 3])
  c = _completion(2)
  c.prompt_routing = np.zeros((2, 3, 3))  # the prompt has 3 tokens: 2 positions expected
  with pytest.raises(trajectory.ShapeMismatch, match="prompt_routing has shape"):
    seg.add_completion(c)
  assert len(seg) == 3


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
