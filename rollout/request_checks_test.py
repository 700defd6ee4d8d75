"""Tests for rollout.request_checks: what a request must satisfy before it is queued."""

import sys

import pytest

from moe.config import ModelConfig
from rollout.engine_types import EngineConfig
from rollout.request_checks import check_request, check_timeout
from rollout.sampling import SamplingParams

CFG = ModelConfig(vocab_size=100, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=32, max_seq_len=32)
EC = EngineConfig(max_slots=4, eos_token_ids=(2,), max_stop_ids=3)


def check(prompt, tokenizer=None, **params):
  return check_request(prompt, SamplingParams(**params), CFG, EC, 32, tokenizer)


def test_returns_prompt_as_ints_and_stop_ids_with_eos():
  prompt, stop = check((5, 6, 7), max_tokens=4, stop_token_ids=(9, 3))
  assert prompt == [5, 6, 7] and all(type(t) is int for t in prompt)
  assert stop == (2, 3, 9)  # the engine's EOS joins the request's own ids, sorted


def test_ignore_eos_leaves_only_the_requests_stop_ids():
  assert check([1], max_tokens=1, stop_token_ids=(9,), ignore_eos=True)[1] == (9,)
  assert check([1], max_tokens=1, ignore_eos=True)[1] == ()


@pytest.mark.parametrize("prompt,params,message", [
    ([], {}, "the prompt is empty"),
    ("ab", {}, "sequence of integers"),
    ([1.5], {}, "must be integers"),
    ([True], {}, "must be integers"),
    ([float("inf")], {}, "sequence of integers"),
    ({1: 2}, {}, "sequence of integers"),
    ([100], {}, "token id 100 at prompt position 0 is outside the vocabulary"),
    ([-1], {}, "outside the vocabulary"),
    ([1] * 30, {"max_tokens": 3}, "exceeds the context length 32"),
    ([1], {"n": 5}, "n (5) exceeds the engine's slots (4)"),
    ([1], {"stop_token_ids": (100,)}, "stop token id 100 is outside the vocabulary"),
    ([1], {"stop_token_ids": (3, 4, 5)}, "at most 3 stop token ids, got 4"),
    ([1], {"stop": ("\n",)}, "stop strings need a tokenizer"),
])
def test_bad_requests_get_a_clear_message(prompt, params, message):
  with pytest.raises(ValueError) as e:
    check(prompt, **{"max_tokens": 1, **params})
  assert message in str(e.value)


def test_params_must_be_sampling_params():
  with pytest.raises(TypeError, match="SamplingParams"):
    check_request([1], {"max_tokens": 1}, CFG, EC, 32, None)


def test_timeouts_are_positive_seconds_or_none():
  assert check_timeout(None) is None and check_timeout(2) == 2.0
  assert check_timeout(float("inf")) is None and check_timeout(10**400) is None
  for bad in (float("nan"), 0, -1.0, "5", True):
    with pytest.raises(ValueError, match="timeout"):
      check_timeout(bad)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
