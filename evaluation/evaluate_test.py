"""End-to-end tests of evaluation.evaluate with real sandboxes.

  * Scripted samplers that write the known solutions (and some wrong ones) prove grading works
    end to end: pass@1 == 1.0 when every sample is right, and exact hand-computed pass@k values
    when some are wrong.
  * A tiny random model through the real sampling engine checks the report's structure, the
    per-task JSONL, and that a fixed seed reproduces the file exactly (deterministic engine).
"""

import contextlib
import dataclasses
import json
import os
import sys

import pytest

from envs.harness import chat_style
from envs.harness import scripted_sampler
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_humaneval
from envs.tasks import suite_pyfunc
from evaluation import evaluate as evaluate_lib
from evaluation import sources
from moe import chat_template
from moe import tokenizer as tokenizer_lib
from rollout import testing as rollout_testing
from rollout.engine import Engine, EngineConfig

TOK = tokenizer_lib.ByteTokenizer()


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


@pytest.fixture(scope="module")
def heldout():
  return suite_pyfunc.split(suite_pyfunc.generate(), "test")[:4]


def _by_prompt(bodies_of):
  """A generate callable answering each task's prompt with envs.harness.scripted_sampler."""
  gens = {prompt: scripted_sampler.scripted_generate(bodies)
          for prompt, bodies in bodies_of.items()}

  def generate(prompt_token_ids, **kw):
    assert prompt_token_ids[0] == TOK.bos_id  # add_bos, as the models are pre-trained
    return gens[TOK.decode(prompt_token_ids)](prompt_token_ids, **kw)
  return generate


def test_known_solutions_pass(pool, heldout, tmp_path):
  gen = _by_prompt({t.prompt: [t.solution] for t in heldout})
  out = str(tmp_path / "eval.jsonl")
  rep = evaluate_lib.evaluate(gen, heldout, n=2, k_list=(1, 2), temperature=0.0, max_tokens=64,
                              seed=0, pool=pool, out_path=out)
  assert rep.pass_at_k == {1: 1.0, 2: 1.0} and rep.tasks_scored == {1: 4, 2: 4}
  assert rep.solved == 4 and rep.pass1_count == 4.0 and rep.infra_errors == 0
  rows = evaluate_lib.read_results(out)
  assert [r["task_id"] for r in rows] == [t.task_id for t in heldout]
  assert all((r["n"], r["c"]) == (2, 2) for r in rows)
  assert rows[0]["samples"][0]["completion"] == heldout[0].solution
  assert rows[0]["samples"][0]["test_outcomes"]  # the hidden tests really ran
  with open(evaluate_lib.summary_path(out), encoding="utf-8") as f:
    assert json.load(f)["pass_at_k"] == {"1": 1.0, "2": 1.0}


def test_wrong_samples_give_exact_pass_at_k(pool, heldout):
  a, b, c, d = heldout
  wrong = "    return None\n"
  gen = _by_prompt({a.prompt: [a.solution], b.prompt: [b.solution, wrong, wrong],
                    c.prompt: [wrong], d.prompt: ["    retur (\n", d.solution, wrong]})
  rep = evaluate_lib.evaluate(gen, heldout, n=3, k_list=(1, 2, 3), temperature=1.0,
                              max_tokens=64, seed=1, pool=pool)
  per_task = {r.task_id: (r.c, r.pass_at_k) for r in rep.results}
  assert per_task[a.task_id] == (3, {1: 1.0, 2: 1.0, 3: 1.0})
  assert per_task[c.task_id] == (0, {1: 0.0, 2: 0.0, 3: 0.0})
  # c = 1 of n = 3: pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3, pass@3 = 1.
  for t in (b, d):
    assert per_task[t.task_id][0] == 1
    assert per_task[t.task_id][1] == pytest.approx({1: 1 / 3, 2: 2 / 3, 3: 1.0}, rel=1e-12)
  assert rep.pass_at_k[1] == pytest.approx((1 + 1 / 3 + 0 + 1 / 3) / 4, rel=1e-12)
  assert rep.solved == 3
  assert [s["passed"] for s in rep.results[3].samples] == [False, True, False]


def test_bad_arguments(pool, heldout):
  gen = _by_prompt({t.prompt: [t.solution] for t in heldout})
  with pytest.raises(ValueError, match="outside"):
    evaluate_lib.evaluate(gen, heldout, n=2, k_list=(1, 5), pool=pool)
  with pytest.raises(ValueError, match="no tasks"):
    evaluate_lib.evaluate(gen, [], pool=pool)
  with pytest.raises(ValueError, match="mode"):
    evaluate_lib.evaluate(gen, heldout, mode="chat", pool=pool)
  with pytest.raises(TypeError, match="cannot sample"):
    evaluate_lib.evaluate(42, heldout, pool=pool)


@dataclasses.dataclass(frozen=True)
class ChatBytes(tokenizer_lib.ByteTokenizer):
  """The byte tokenizer with a ChatML-style template (a chat model's tokenizer, without one)."""
  chat_template = chat_template.ChatTemplate(
      "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_prompts_and_answers(pool, tmp_path):
  """prompt_style="chat" on two HumanEval problems: each prompt sent is the user message through
  the tokenizer's chat template (no BOS of the policy's), no stop string cuts an answer, and of
  three answers per problem -- the canonical body in a fence, the canonical solution as a full
  definition between prose, a wrong definition -- two pass: pass@1 = 2/3, pass@3 = 1."""
  tok = ChatBytes()
  tasks = [suite_humaneval.generate()[i] for i in (0, 38)]
  problems = {p["entry_point"]: p for p in suite_humaneval.read_problems()}
  gens = {}
  for t in tasks:
    p = problems[t.entry_point]
    message = [{"role": "user", "content": chat_style.user_message(t)}]
    prompt = tok.encode(tok.chat_template.render(message, add_generation_prompt=True))
    gens[tuple(prompt)] = scripted_sampler.scripted_generate([
        f"```python\n{p['canonical_solution']}```",
        f"Here:\n```python\n{p['prompt']}{p['canonical_solution']}```\nDone.",
        f"```python\ndef {t.entry_point}(*a):\n    return None\n```"])
  seen = []

  def generate(prompt_token_ids, **kw):
    seen.append(kw)
    return gens[tuple(prompt_token_ids)](prompt_token_ids, **kw)

  out = str(tmp_path / "chat.jsonl")
  rep = evaluate_lib.evaluate(generate, tasks, n=3, k_list=(1, 3), temperature=1.0,
                              max_tokens=2048, seed=0, pool=pool, tokenizer=tok, add_bos=False,
                              prompt_style="chat", out_path=out)
  assert len(seen) == 2 and all("stop" not in kw for kw in seen)
  assert [(r.n, r.c) for r in rep.results] == [(3, 2), (3, 2)]
  assert rep.pass_at_k == pytest.approx({1: 2 / 3, 3: 1.0}, rel=1e-12)
  assert rep.results[0].samples[1]["completion"].endswith("```\nDone.")
  with open(evaluate_lib.summary_path(out), encoding="utf-8") as f:
    assert json.load(f)["prompt_style"] == "chat"
  # The byte tokenizer has no chat template; and there are two styles.
  with pytest.raises(ValueError, match="'chat' needs a chat template"):
    evaluate_lib.evaluate(generate, tasks, pool=pool, tokenizer=TOK, add_bos=False,
                          prompt_style="chat")
  with pytest.raises(ValueError, match="prompt_style must be one of"):
    evaluate_lib.evaluate(generate, tasks, pool=pool, tokenizer=tok, add_bos=False,
                          prompt_style="instruct")


def test_tiny_random_model_report_and_determinism(pool, heldout, tmp_path):
  model = rollout_testing.tiny_model(seed=0, max_seq_len=128)
  tasks = heldout[:3]
  engine = Engine(model, config=EngineConfig(max_slots=8, max_len=128, decode_steps=8,
                                             deterministic=True, prefill_rows=4))
  try:
    outs = []
    for rep_i in range(2):
      out = str(tmp_path / f"run{rep_i}.jsonl")
      rep = evaluate_lib.evaluate(engine, tasks, n=2, k_list=(1, 2), temperature=1.0,
                                  max_tokens=12, seed=7, pool=pool, out_path=out)
      outs.append(out)
      assert rep.num_tasks == 3 and rep.n == 2 and rep.k_list == (1, 2)
      # pass@k recounted from the graded samples (n = 2): pass@1 = c / 2, pass@2 = [c >= 1].
      cs = [sum(s["passed"] for s in r.samples) for r in rep.results]
      assert [r.c for r in rep.results] == cs
      assert rep.pass_at_k == pytest.approx({1: sum(c / 2 for c in cs) / 3,
                                             2: sum(c >= 1 for c in cs) / 3}, rel=1e-12)
      assert rep.infra_errors == 0 and rep.tasks_scored == {1: 3, 2: 3}
      assert "pass@1" in rep.table()
    rows = evaluate_lib.read_results(outs[0])
    assert len(rows) == 3
    for r, t in zip(rows, tasks):
      assert r["task_id"] == t.task_id and r["suite"] == "pyfunc" and r["split"] == "test"
      assert r["mode"] == "single_turn" and r["n"] == 2 and len(r["samples"]) == 2
      assert set(r["pass_at_k"]) == {"1", "2"} and set(r["flags"]) == {
          "infra_errors", "hacked", "truncated"}
      for s in r["samples"]:
        assert s["status"] == "ok" and 0 < s["model_tokens"] <= 12
        assert isinstance(s["completion"], str)
    # Same seed, same file, byte for byte.
    with open(outs[0], encoding="utf-8") as f0, open(outs[1], encoding="utf-8") as f1:
      assert f0.read() == f1.read()
    # Another seed samples differently.
    rep = evaluate_lib.evaluate(engine, tasks, n=2, k_list=(1,), temperature=1.0,
                                max_tokens=12, seed=8, pool=pool)
    assert [s["completion"] for r in rep.results for s in r.samples] != [
        s["completion"] for r in rows for s in r["samples"]]
  finally:
    engine.stop()


def test_in_memory_model_builds_and_stops_its_engine(pool, heldout, monkeypatch):
  model = rollout_testing.tiny_model(seed=1, max_seq_len=128)
  opened, calls = [], []
  real_open = sources.open_sampler

  @contextlib.contextmanager
  def open_sampler(*a, **kw):  # the real one, watched: its engine and the requests it gets
    with real_open(*a, **kw) as s:
      opened.append(s)

      def generate(prompt_token_ids, **kw):
        calls.append(kw)
        return s.generate(prompt_token_ids, **kw)
      yield dataclasses.replace(s, generate=generate)

  monkeypatch.setattr(sources, "open_sampler", open_sampler)
  rep = evaluate_lib.evaluate(model, heldout[:1], n=1, temperature=0.0, max_tokens=4, seed=0,
                              pool=pool, tokenizer=TOK)
  assert rep.results[0].n == 1 and rep.results[0].samples[0]["model_tokens"] <= 4
  assert rep.infra_errors == 0
  # The engine it built has the evaluation's tokenizer and is handed the harness's stop strings,
  # so it ends completions at them rather than decoding to max_tokens (sources_test shows it).
  (s,) = opened
  assert s.engine.tokenizer is TOK and s.stop_strings and not s.engine.running
  assert calls and all(c["stop"] == list(single_turn.STOP) for c in calls)
  with pytest.raises(ValueError, match="max_seq_len"):
    evaluate_lib.evaluate(model, heldout[:1], max_tokens=500, pool=pool)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
