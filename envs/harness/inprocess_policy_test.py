"""Tests for InProcessPolicy and single-turn episodes, over a scripted `generate` callable."""

import sys

import numpy as np
import pytest

from envs import metrics
from envs.harness import inprocess_policy
from envs.harness import policy as policy_lib
from envs.harness import scripted_sampler
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def test_adapter_cuts_at_stop_strings_and_eos():
  gen = scripted_sampler.scripted_generate(["abc</tool_call>tail", "xyz"])
  pol = inprocess_policy.InProcessPolicy(gen, TOK, add_bos=True)
  assert pol.start_ids() == [TOK.bos_id]
  prompt = pol.start_ids() + TOK.encode("hi")
  a, b = pol.complete(prompt, max_tokens=50, stop=["</tool_call>"], n=2)
  assert gen.calls[0]["prompt"] == prompt  # sent exactly as given: the harness adds BOS
  assert gen.calls[0]["stop_token_ids"] == [TOK.eos_id]
  assert a.text == "abc</tool_call>" and a.finish_reason == "stop"
  assert len(a.logprobs) == len(a.token_ids) == a.routing.shape[1] == len(a.policy_versions)
  assert a.policy_versions == [3] * len(a.token_ids)
  assert b.token_ids[-1] == TOK.eos_id and b.text == "xyz"
  c = pol.complete(TOK.encode("hi"), max_tokens=2, n=1)[0]
  assert c.finish_reason == "length" and len(c.token_ids) == 2


def test_stop_token_ids_reach_generate_and_end_the_completion():
  """A chat model's end-of-turn id (asked for by the harness) goes to generate with the EOS, and
  a sampler that ran past it is cut just after it, with every per-token field."""
  end = TOK.encode("|")[0]
  gen = scripted_sampler.scripted_generate(["ab|cd"])
  pol = inprocess_policy.InProcessPolicy(gen, TOK)
  a = pol.complete(TOK.encode("hi"), max_tokens=50, stop_token_ids=[end, TOK.eos_id])[0]
  assert gen.calls[0]["stop_token_ids"] == [TOK.eos_id, end]
  assert a.text == "ab|" and a.token_ids[-1] == end and a.finish_reason == "stop"
  assert len(a.logprobs) == len(a.policy_versions) == a.routing.shape[1] == 3


def test_stop_strings_reach_a_generate_that_takes_them():
  """With stop_strings=True the request's stop strings go to generate (so it can stop decoding
  there); without stop strings, or with stop_strings=False, generate gets no `stop` at all."""
  inner = scripted_sampler.scripted_generate(["abc</tool_call>tail"])
  seen = []

  def generate(prompt_token_ids, *, stop=None, **kw):
    seen.append(stop)
    out = inner(prompt_token_ids, **kw)
    if stop:  # a sampler that ends at stop strings: keeps up to the completing token
      c = out[0]
      cut, _ = policy_lib.truncate_at_stop(c.token_ids, TOK.decode, stop)
      c.token_ids, c.logprobs, c.routing = c.token_ids[:cut], c.logprobs[:cut], c.routing[:, :cut]
    return out

  pol = inprocess_policy.InProcessPolicy(generate, TOK, stop_strings=True)
  a = pol.complete(TOK.encode("hi"), max_tokens=50, stop=("</tool_call>", "<|im_end|>"))[0]
  assert seen == [["</tool_call>", "<|im_end|>"]]
  assert a.text == "abc</tool_call>" and a.finish_reason == "stop"
  assert len(a.logprobs) == len(a.token_ids) == a.routing.shape[1] == len(a.policy_versions)
  pol.complete(TOK.encode("hi"), max_tokens=50)
  assert seen[1] is None
  # A plain callable without the keyword keeps working: no stop strings, or stop_strings=False.
  plain = scripted_sampler.scripted_generate(["abc</tool_call>tail"])
  assert inprocess_policy.InProcessPolicy(plain, TOK, stop_strings=True).complete(
      TOK.encode("hi"), max_tokens=50)[0].text == "abc</tool_call>tail"
  b = inprocess_policy.InProcessPolicy(plain, TOK).complete(TOK.encode("hi"), max_tokens=50,
                                                           stop=["</tool_call>"])[0]
  assert b.token_ids == a.token_ids and b.logprobs == a.logprobs


def test_truncate_at_stop_multibyte():
  ids = TOK.encode("héllo STOP after")
  cut, hit = policy_lib.truncate_at_stop(ids, TOK.decode, ["STOP"])
  assert hit == "STOP" and TOK.decode(ids[:cut]) == "héllo STOP"


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def test_single_turn_group_rewards(pool):
  task = next(t for t in suite_pyfunc.generate() if t.entry_point == "reverse")
  bodies = ["    return s[::-1]\n", "    return s\n", "    return ''.join(reversed(s))\n",
            "    return s[::-1]\n\ndef extra():\n    pass\n", "    retur (\n"]
  pol = inprocess_policy.InProcessPolicy(scripted_sampler.scripted_generate(bodies), TOK,
                                         add_bos=True)
  trs = single_turn.run_single_turn(task, pol, pool=pool, n=5, seed=1)
  assert [t.reward for t in trs] == [1.0, 0.0, 1.0, 1.0, 0.0]
  seg = trs[0].segments[0]
  assert TOK.decode([t for t, m in zip(seg.token_ids, seg.model_mask) if not m]) == task.prompt
  assert seg.routing.shape[0] == 2 and seg.routing.shape[2] == 2
  assert trs[3].final_files["solution.py"] == task.prompt + "    return s[::-1]\n"
  m = metrics.summarize(trs)
  assert m["solved_rate"] == 0.6 and m["infra_failures"] == 0


def test_generate_raising_is_infra_failure(pool):
  def broken(*a, **k):
    raise RuntimeError("device lost")
  task = suite_pyfunc.generate()[0]
  pol = inprocess_policy.InProcessPolicy(broken, TOK)
  trs = single_turn.run_single_turn(task, pol, pool=pool, n=2)
  assert [t.status for t in trs] == ["infra_error"] * 2 and trs[0].reward is None


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
