"""OpenAIPolicy: episodes over HTTP against a scripted server, and the parsing of one choice.

The scripted `replay_server` drives what a random-weights model cannot: multi-turn tool
calls that solve a task, and the behaviour of other OpenAI-compatible servers (no extra fields,
text prompts, stop strings dropped). The project's own server is tested for real in
`tests/openai_policy_server_test.py`.
"""

import json
import sys

import numpy as np
import pytest

from envs.harness import agent_loop
from envs.harness import openai_policy
from envs.harness import policy as policy_lib
from envs.harness import replay_server
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc
from envs.tasks import suite_swe
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def call(name, **args):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def _script(task):
  fixed = task.metadata["gold_files"]["textkit/text.py"]
  return [call("read_file", path="textkit/text.py") + "\nignored tail",
          call("write_file", path="textkit/text.py", content=fixed),
          call("run_tests"),
          call("submit")]


def test_episode_over_http_keeps_sampler_fields(pool):
  task = suite_swe.generate()[1]
  with replay_server.ReplayServer(_script(task), TOK, moe_layers=3, top_k=2) as srv:
    # As vLLM does when asked to keep the stop string in the output.
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK,
                                     extra_body={"include_stop_str_in_output": True})
    tr = agent_loop.run_episode(task, pol, pool=pool)
    reqs = srv.requests
  assert tr.status == "ok" and tr.reward == 1.0, (tr.infra_error, tr.test_outcomes)
  assert len(reqs) == 4
  assert isinstance(reqs[0]["prompt"], list) and reqs[0]["stop"] == ["</tool_call>",
                                                                     "<|im_end|>"]
  assert reqs[0]["include_stop_str_in_output"] is True
  # Each request's prompt is exactly the trajectory so far: no re-tokenization drift.
  seg = tr.segments[0]
  assert seg.token_ids[:len(reqs[-1]["prompt"])] == reqs[-1]["prompt"]
  mask = np.array(seg.model_mask)
  assert np.all(np.array(seg.logprobs)[mask] == -0.25)
  assert set(np.array(seg.policy_versions)[mask]) == {7}
  assert set(np.array(seg.policy_versions)[~mask]) == {-1}
  routing = seg.routing
  assert routing.shape == (3, len(seg.token_ids), 2)
  # Row j of a completion's routing is the step whose input was the token before token j.
  ids = np.array(seg.token_ids)
  fed = np.nonzero(mask)[0] - 1
  covered = np.zeros(len(ids), bool)
  covered[fed] = True
  assert np.all(routing[:, ~covered] == -1) and np.all(routing[:, covered] >= 0)
  np.testing.assert_array_equal(routing[1, fed, 0], (ids[mask] + 1) % 8)
  assert "ignored tail" not in TOK.decode(seg.token_ids)


def test_server_that_drops_stop_strings_and_extras(pool):
  task = suite_swe.generate()[1]
  with replay_server.ReplayServer(_script(task), TOK, with_extras=False, drop_stop=True) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK, send_token_ids=False)
    tr = agent_loop.run_episode(task, pol, pool=pool)
    assert isinstance(srv.requests[0]["prompt"], str)
    # Nothing non-standard is sent unless asked: strict servers refuse unknown fields.
    assert "include_stop_str_in_output" not in srv.requests[0]
    assert "stop_token_ids" not in srv.requests[0]
  assert tr.status == "ok" and tr.reward == 1.0
  seg = tr.segments[0]
  model_text = TOK.decode([t for t, m in zip(seg.token_ids, seg.model_mask) if m])
  assert "</tool_call>" not in model_text  # Re-appended by the harness, not the model's.
  assert TOK.decode(seg.token_ids).count("</tool_call>") == 1 + 4  # system prompt example
  assert seg.routing is None


def test_single_turn_over_http_with_n(pool):
  task = next(t for t in suite_pyfunc.generate() if t.entry_point == "add_3")
  with replay_server.ReplayServer(["    return x + 3\n\n# next"], TOK) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK,
                                     extra_body={"include_stop_str_in_output": True})
    trs = single_turn.run_single_turn(task, pol, pool=pool, n=3)
    assert srv.requests[0]["n"] == 3
  assert [t.reward for t in trs] == [1.0, 1.0, 1.0]
  assert trs[0].final_files["solution.py"] == task.prompt + "    return x + 3\n"


def test_stop_token_ids_are_sent_with_the_callers_own():
  with replay_server.ReplayServer(["ab"], TOK) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK)
    pol.complete([1, 2], max_tokens=4, stop_token_ids=[7])
    pol.complete([1, 2], max_tokens=4, stop_token_ids=[7, 9], extra={"stop_token_ids": [9, 3]})
    assert [r["stop_token_ids"] for r in srv.requests] == [[7], [9, 3, 7]]


def test_unreachable_server_is_policy_error():
  pol = openai_policy.OpenAIPolicy("http://127.0.0.1:9", "tiny", TOK, timeout_s=2)
  with pytest.raises(policy_lib.PolicyError):
    pol.complete([1, 2], max_tokens=4)


def _choice(n_tokens=3, **over):
  """A well-formed choice as the project's server writes it (2 MoE layers, k=2)."""
  ids = list(b"abcdefgh"[:n_tokens])
  c = {"index": 0, "text": TOK.decode(ids), "finish_reason": "length", "token_ids": ids,
       "logprobs": {"token_logprobs": [-0.5] * n_tokens}, "policy_version": 4,
       "policy_versions": [4] * n_tokens,
       "routing": [[[t % 4, (t + 1) % 4] for t in ids] for _ in range(2)]}
  c.update(over)
  return c


def test_parse_choice_keeps_every_field():
  comp = openai_policy.parse_choice(_choice(), TOK)
  assert comp.token_ids == list(b"abc") and comp.text == "abc"
  assert comp.logprobs == [-0.5] * 3 and comp.policy_versions == [4] * 3
  assert comp.routing.shape == (2, 3, 2) and comp.routing.dtype == np.int32
  np.testing.assert_array_equal(comp.routing[1, :, 0], np.array(list(b"abc")) % 4)


@pytest.mark.parametrize("routing,got", [
    ([[[0, 1]] * 2] * 2, "(2, 2, 2)"),        # one row short
    ([[[0, 1]] * 4] * 2, "(2, 4, 2)"),        # one row too many
    ([[0, 1]] * 3, "(3, 2)"),  # no layer axis
    ([[[0, 1]] * 3, [[0, 1]] * 2], "not a [moe_layers][tokens][k] array"),  # ragged
])
def test_routing_shape_mismatch_is_an_error(routing, got):
  with pytest.raises(openai_policy.MalformedResponse) as e:
    openai_policy.parse_choice(_choice(routing=routing), TOK)
  assert got in str(e.value)
  if "array" not in got:
    assert "expected (moe_layers, 3, k)" in str(e.value)
  assert isinstance(e.value, policy_lib.PolicyError)  # the episode ends as an infra error


def test_no_routing_is_legitimate():
  assert openai_policy.parse_choice(_choice(routing=None), TOK).routing is None
  plain = _choice()
  del plain["routing"]
  assert openai_policy.parse_choice(plain, TOK).routing is None


@pytest.mark.parametrize("field,value,message", [
    ("logprobs", {"token_logprobs": [-0.5] * 2}, "2 token_logprobs for 3 token_ids"),
    ("policy_versions", [4] * 4, "4 policy_versions for 3 token_ids"),
    ("token_ids", [97, "b"], "'token_ids' must be a list of integers"),
])
def test_other_per_token_mismatches_are_errors(field, value, message):
  with pytest.raises(openai_policy.MalformedResponse, match=message):
    openai_policy.parse_choice(_choice(**{field: value}), TOK)


def test_without_token_ids_mismatched_lists_are_dropped_not_errors():
  """Text re-tokenized here need not split as the server's tokens did: its per-token lists
  cannot be aligned, so they are dropped (the documented fallback), the scalar version kept."""
  c = _choice(routing=None)
  del c["token_ids"]
  c["text"] = "abcd"  # 4 tokens here, 3 logprobs from the server
  comp = openai_policy.parse_choice(c, TOK)
  assert comp.token_ids == list(b"abcd")
  assert comp.logprobs is None and comp.policy_versions == [4] * 4


def test_partial_stop_string_in_the_ids_is_completed_once():
  # The server's text ends before the stop string; its ids hold the stop's first token.
  c = _choice(finish_reason="stop", token_ids=list(b"ab<"), text="ab",
              routing=[[[0, 1]] * 3] * 2)
  comp = openai_policy.parse_choice(c, TOK, stop=["</tool_call>", "<|im_end|>"])
  assert comp.text == "ab<" and comp.stop_appended == "|im_end|>"
  tool = _choice(finish_reason="stop", token_ids=list(b"<tool_call>{}\n<"),
                 text="<tool_call>{}\n", routing=None,
                 logprobs={"token_logprobs": [-0.5] * 15}, policy_versions=[4] * 15)
  comp = openai_policy.parse_choice(tool, TOK, stop=["</tool_call>", "<|im_end|>"])
  assert comp.text + comp.stop_appended == "<tool_call>{}\n</tool_call>"
  # A server that dropped the stop string entirely: all of it is appended.
  whole = _choice(finish_reason="stop", routing=None)
  assert openai_policy.parse_choice(whole, TOK, stop=["\n\n"]).stop_appended == "\n\n"
  kept = _choice(finish_reason="stop", token_ids=list(b"a\n\n"), text="a\n\n", routing=None)
  assert openai_policy.parse_choice(kept, TOK, stop=["\n\n"]).stop_appended == ""
  # The project's server: the ids run to the token that completes the stop string, which may
  # carry text past it; the stop string is there once, nothing is added.
  past = _choice(finish_reason="stop", token_ids=list(b"a\n\nb"), text="a", routing=None,
                 logprobs={"token_logprobs": [-0.5] * 4}, policy_versions=[4] * 4)
  comp = openai_policy.parse_choice(past, TOK, stop=["\n\n"])
  assert comp.text == "a\n\nb" and comp.stop_appended == ""


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
