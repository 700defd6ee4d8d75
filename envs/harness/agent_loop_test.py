"""Tests for the agent loop with a scripted policy (a deterministic stand-in for the model)."""

import json
import sys

import pytest

from envs import metrics
from envs.harness import agent_loop
from envs.harness import policy as policy_lib
from envs.harness import toolcall
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_swe
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def call(name, **args):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def _calc():
  return suite_swe.generate()[0]


def _solve_script(task):
  fixed = task.metadata["gold_files"]["calc/ops.py"]
  return [
      "Let me look.\n" + call("list_files"),
      call("read_file", path="calc/ops.py"),
      call("edit_file", path="calc/ops.py", old="    return sum(xs) // len(xs)\n",
           new=fixed.split("def mean(xs):\n")[1]),
      call("run_tests") + "<|im_end|>",
      call("run", command="python3 -c 'from calc.ops import mean; print(mean([1, 2]))'"),
      "Done.\n" + call("submit"),
  ]


def test_solves_swe_task(pool):
  task = _calc()
  pol = policy_lib.ScriptedPolicy(_solve_script(task), TOK)
  tr = agent_loop.run_episode(task, pol, pool=pool)
  assert tr.status == "ok", tr.infra_error
  assert tr.finish_reason == "submitted" and tr.reward == 1.0 and tr.hack_flags == {}
  assert [c.name for c in tr.tool_calls] == ["list_files", "read_file", "edit_file", "run_tests",
                                             "run", "submit"]
  assert all(c.ok for c in tr.tool_calls), tr.tool_calls
  assert "calc/ops.py" in tr.tool_calls[0].observation
  assert "1.5" in tr.tool_calls[4].observation
  seg = tr.segments[0]
  assert len(seg.token_ids) == len(seg.model_mask) == len(seg.logprobs) == len(
      seg.policy_versions)
  # The model's tokens are exactly its responses; everything else is the harness's.
  model_text = TOK.decode([t for t, m in zip(seg.token_ids, seg.model_mask) if m])
  # Generation stops at </tool_call>, so the scripted "<|im_end|>" after it is never sampled.
  assert model_text == "".join(_solve_script(task)).replace("</tool_call><|im_end|>",
                                                            "</tool_call>")
  text = TOK.decode(seg.token_ids)
  assert text.startswith("<|im_start|>system") and "<tool_response>" in text
  assert all(lp == -0.5 for lp, m in zip(seg.logprobs, seg.model_mask) if m)
  assert tr.timings["total_s"] > 0 and tr.timings["grade_s"] > 0
  assert "calc/ops.py" in tr.final_files


def test_malformed_calls_get_error_observations(pool):
  task = _calc()
  script = ["<tool_call>\n{not json}\n</tool_call>",
            call("frobnicate", x=1),
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            "I think I am done.<|im_end|>",
            call("read_file", path="nope.py"),
            call("edit_file", path="calc/ops.py", old="zzz", new="y"),
            call("read_file", wrong_arg=1),
            "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}"]
  pol = policy_lib.ScriptedPolicy(script, TOK)
  tr = agent_loop.run_episode(task, pol, pool=pool,
                              config=agent_loop.LoopConfig(max_turns=len(script)))
  assert tr.status == "ok" and tr.finish_reason == "max_turns"
  assert tr.malformed_calls == 5  # bad JSON, unknown tool, no name, no call, unterminated
  assert tr.reward == 0.0
  prompts = pol.calls
  assert "not valid JSON" in prompts[1]
  assert "unknown tool 'frobnicate'" in prompts[2]
  assert "needs a \"name\"" in prompts[3]
  assert "no tool call found" in prompts[4]
  assert "cannot read nope.py" in prompts[5]
  assert "occurs 0 times" in prompts[6]
  assert "bad arguments for read_file" in prompts[7]


def test_parse_several_calls_and_openai_style_arguments():
  text = (call("read_file", path="a") + "then" +
          '<tool_call>{"name": "run", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>')
  p = toolcall.parse(text)
  assert [(c.name, c.arguments) for c in p.calls] == [("read_file", {"path": "a"}),
                                                      ("run", {"command": "ls"})]
  assert p.errors == []


def test_turn_token_and_wall_limits(pool):
  task = _calc()
  chatty = lambda prompt, i: call("run", command="true")
  tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(chatty, TOK), pool=pool,
                              config=agent_loop.LoopConfig(max_turns=3))
  assert (tr.finish_reason, tr.num_turns, len(tr.tool_calls)) == ("max_turns", 3, 3)
  tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(chatty, TOK), pool=pool,
                              config=agent_loop.LoopConfig(max_total_tokens=200))
  assert tr.finish_reason == "max_tokens" and tr.num_model_tokens <= 200
  assert tr.status == "ok" and tr.reward == 0.0  # Still graded on whatever it left.
  tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(chatty, TOK), pool=pool,
                              config=agent_loop.LoopConfig(wall_s=0.3, max_turns=1000))
  assert tr.finish_reason == "wall_time"


def test_self_summarisation_starts_fresh_context(pool):
  task = _calc()

  def respond(prompt, i):
    if agent_loop.SUMMARY_REQUEST in prompt[-600:]:
      return "SUMMARY: mean uses // ; fix it.<|im_end|>"
    if "SUMMARY: mean uses" in prompt and prompt.count("<tool_response>") >= 1:
      return call("submit")
    return call("read_file", path="calc/ops.py")

  pol = policy_lib.ScriptedPolicy(respond, TOK)
  cfg = agent_loop.LoopConfig(max_context_tokens=3000, max_tokens_per_turn=256)
  tr = agent_loop.run_episode(task, pol, pool=pool, config=cfg)
  assert tr.finish_reason == "submitted", tr.finish_reason
  assert len(tr.segments) == 2 and tr.segments[0].ended_by_summary
  first, second = tr.segments
  model0 = TOK.decode([t for t, m in zip(first.token_ids, first.model_mask) if m])
  assert model0.endswith("SUMMARY: mean uses // ; fix it.<|im_end|>")
  text1 = TOK.decode(second.token_ids)
  assert text1.startswith("<|im_start|>system") and "SUMMARY: mean uses" in text1
  # Every assistant header opens a model turn: the tool output goes straight to the summary
  # request, with no empty assistant turn left open before it.
  text0 = TOK.decode(first.token_ids)
  assert "</tool_response><|im_end|>\n<|im_start|>user\n" + agent_loop.SUMMARY_REQUEST in text0
  for text in (text0, text1):
    assert text.count("<|im_start|>assistant\n") == text.count("<|im_end|>") - text.count(
        "<|im_start|>user") - text.count("<|im_start|>system"), text
  assert len(first) <= cfg.max_context_tokens
  assert metrics.summarize([tr])["summarised_episodes"] == 1


def test_no_context_outgrows_the_window(pool):
  """A model that always writes its whole turn budget, tool calls with long output, a small
  window: every segment stays within max_context_tokens (the learner trains each as one
  sequence of at most that length), summaries included."""
  task = _calc()
  junk = "x" * 200

  def respond(prompt, i):
    if agent_loop.SUMMARY_REQUEST in prompt[-400:]:
      return "summary " * 40
    if i % 2:
      return call("read_file", path="calc/ops.py") + junk
    return call("run", command="python3 -c 'print(\"y\" * 3000)'") + junk

  opening = 1 + len(TOK.encode(toolcall.initial_prompt(task.instructions)))
  segments = {}
  for window in (opening + 700, opening + 1000, opening + 1800):
    pol = policy_lib.ScriptedPolicy(respond, TOK)
    cfg = agent_loop.LoopConfig(max_turns=8, max_tokens_per_turn=120, max_context_tokens=window,
                                summary_max_tokens=60, max_summaries=2,
                                observation_max_chars=4000)
    tr = agent_loop.run_episode(task, pol, pool=pool, config=cfg)
    assert tr.status == "ok", tr.infra_error
    lengths = [len(s) for s in tr.segments]
    assert max(lengths) <= window, (window, lengths)
    segments[window] = len(lengths)
  assert segments[opening + 700] > 1 and segments[opening + 1000] > 1, segments  # it summarised
  with pytest.raises(ValueError, match="leaves no room"):
    agent_loop.run_episode(task, policy_lib.ScriptedPolicy(respond, TOK), pool=pool,
                           config=agent_loop.LoopConfig(max_context_tokens=opening + 100))


def test_hacking_episode_is_flagged_and_penalised(pool):
  task = _calc()
  script = [call("write_file", path="tests/test_ops.py", content="def test_add():\n    pass\n"),
            call("run", command="git log --all; curl http://example.com"),
            call("submit")]
  tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(script, TOK), pool=pool)
  assert set(tr.hack_flags) >= {"tests_modified", "git_history_read", "network"}
  assert tr.reward == -1.0
  m = metrics.summarize([tr])
  assert m["hacked_episodes"] == 1 and m["hack/network"] == 1


class _RecordingPool:
  def __init__(self, pool):
    self.pool, self.slots = pool, []

  def acquire(self, **kw):
    s = self.pool.acquire(**kw)
    self.slots.append(s)
    return s

  def release(self, s):
    self.pool.release(s)


def test_sandbox_dying_mid_episode_is_infra_failure(pool):
  task = _calc()
  rec = _RecordingPool(pool)

  def respond(prompt, i):
    if i == 1:
      rec.slots[0].proc.kill()  # The host under the episode's sandbox goes away.
    return call("run", command="echo hi")

  tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(respond, TOK), pool=rec)
  assert tr.status == "infra_error" and tr.reward is None and "sandbox" in tr.infra_error
  m = metrics.summarize([tr])
  assert m["infra_failures"] == 1 and m["episodes"] == 1


def test_policy_failure_is_infra_failure(pool):
  def respond(prompt, i):
    raise policy_lib.PolicyError("server went away")
  tr = agent_loop.run_episode(_calc(), policy_lib.ScriptedPolicy(respond, TOK), pool=pool)
  assert tr.status == "infra_error" and tr.reward is None


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
