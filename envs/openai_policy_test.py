"""The HTTP path end to end: OpenAIPolicy against a real local server speaking the protocol."""

import json
import sys

import numpy as np
import pytest

from envs import agent_loop
from envs import openai_policy
from envs import policy as policy_lib
from envs import pool as pool_lib
from envs import replay_server
from envs import single_turn
from envs import suite_pyfunc
from envs import suite_swe
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
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK)
    tr = agent_loop.run_episode(task, pol, pool=pool)
    reqs = srv.requests
  assert tr.status == "ok" and tr.reward == 1.0, (tr.infra_error, tr.test_outcomes)
  assert len(reqs) == 4
  assert isinstance(reqs[0]["prompt"], list) and reqs[0]["stop"] == ["</tool_call>",
                                                                     "<|im_end|>"]
  # Each request's prompt is exactly the trajectory so far: no re-tokenization drift.
  seg = tr.segments[0]
  assert seg.token_ids[:len(reqs[-1]["prompt"])] == reqs[-1]["prompt"]
  mask = np.array(seg.model_mask)
  assert np.all(np.array(seg.logprobs)[mask] == -0.25)
  assert set(np.array(seg.policy_versions)[mask]) == {7}
  assert set(np.array(seg.policy_versions)[~mask]) == {-1}
  routing = seg.routing
  assert routing.shape == (3, len(seg.token_ids), 2)
  assert np.all(routing[:, ~mask] == -1) and np.all(routing[:, mask] >= 0)
  ids = np.array(seg.token_ids)
  np.testing.assert_array_equal(routing[1, mask, 0], (ids[mask] + 1) % 8)
  assert "ignored tail" not in TOK.decode(seg.token_ids)


def test_server_that_drops_stop_strings_and_extras(pool):
  task = suite_swe.generate()[1]
  with replay_server.ReplayServer(_script(task), TOK, with_extras=False, drop_stop=True) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK, send_token_ids=False)
    tr = agent_loop.run_episode(task, pol, pool=pool)
    assert isinstance(srv.requests[0]["prompt"], str)
  assert tr.status == "ok" and tr.reward == 1.0
  seg = tr.segments[0]
  model_text = TOK.decode([t for t, m in zip(seg.token_ids, seg.model_mask) if m])
  assert "</tool_call>" not in model_text  # Re-appended by the harness, not the model's.
  assert TOK.decode(seg.token_ids).count("</tool_call>") == 1 + 4  # system prompt example
  assert seg.routing is None


def test_single_turn_over_http_with_n(pool):
  task = next(t for t in suite_pyfunc.generate() if t.entry_point == "add_3")
  with replay_server.ReplayServer(["    return x + 3\n\n# next"], TOK) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "tiny", TOK)
    trs = single_turn.run_single_turn(task, pol, pool=pool, n=3)
    assert srv.requests[0]["n"] == 3
  assert [t.reward for t in trs] == [1.0, 1.0, 1.0]
  assert trs[0].final_files["solution.py"] == task.prompt + "    return x + 3\n"


def test_unreachable_server_is_policy_error():
  pol = openai_policy.OpenAIPolicy("http://127.0.0.1:9", "tiny", TOK, timeout_s=2)
  with pytest.raises(policy_lib.PolicyError):
    pol.complete([1, 2], max_tokens=4)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
