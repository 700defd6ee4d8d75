"""Tests for SamplerPolicy: what a harness request becomes in the sampler set's request."""

import concurrent.futures
import sys

import pytest

from envs.harness import policy as policy_lib
from moe import tokenizer as tokenizer_lib
from pipeline import sampler_policy

TOK = tokenizer_lib.ByteTokenizer()


class _Samplers:
  """A sampler set that records each request and answers it at once."""

  def __init__(self):
    self.requests = []

  def submit(self, prompt_ids, params, timeout=None):
    self.requests.append((prompt_ids, params))
    fut = concurrent.futures.Future()
    fut.set_result([policy_lib.Completion(token_ids=[65], text="A")])
    return fut


def test_stop_token_ids_join_the_eos():
  """The harness's stop token ids (a chat model's end of turn) end completions besides EOS."""
  samplers = _Samplers()
  pol = sampler_policy.SamplerPolicy(samplers, TOK, timeout_s=5)
  (c,) = pol.complete([TOK.bos_id, 104], max_tokens=8, stop=("</tool_call>",),
                      stop_token_ids=[7, TOK.eos_id])
  assert c.token_ids == [65]
  prompt, params = samplers.requests[0]
  assert prompt == [TOK.bos_id, 104]
  assert params.stop_token_ids == (TOK.eos_id, 7) and params.stop == ("</tool_call>",)
  pol.complete([104], max_tokens=8)
  assert samplers.requests[1][1].stop_token_ids == (TOK.eos_id,)
  assert pol.requests == 2 and pol.prompt_tokens == 3


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
