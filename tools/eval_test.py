"""Tests for //tools:eval: a project checkpoint scored from the command line, HumanEval with a
random model, and bad flags.

The evaluation library itself (pass@k values, grading, determinism) is tested in
evaluation/evaluate_test.py; this checks the entry point's wiring: checkpoint loading, suite
selection, files written, exit codes.
"""

import json
import os
import sys

import pytest

from envs.harness import chat_style
from envs.tasks import suite_humaneval
from evaluation import evaluate as evaluate_lib
from moe import checkpoint
from moe.hf import testutil
from rollout import engine as engine_lib
from rollout import testing as rollout_testing
from tools import eval as eval_tool


def test_checkpoint_from_the_command_line(tmp_path, capsys):
  ckpt = str(tmp_path / "ckpt")
  checkpoint.save_params(rollout_testing.tiny_model(seed=2, max_seq_len=128), ckpt)
  out = str(tmp_path / "res" / "heldout.jsonl")
  rc = eval_tool.main([f"--checkpoint={ckpt}", "--limit=2", "--n=2", "--k_list=(1, 2)",
                       "--temperature=1.0", "--max_tokens=4", "--seed=3", f"--out={out}",
                       "--pool_size=2"])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "evaluating on 2 pyfunc task(s), n=2, k=(1, 2)" in text
  table = text.splitlines()[-4:]  # the summary table ends the output
  assert table[0].startswith("tasks: 2") and table[2].startswith("pass@2:")
  rows = evaluate_lib.read_results(out)
  assert len(rows) == 2 and all(r["split"] == "test" and r["n"] == 2 for r in rows)
  with open(evaluate_lib.summary_path(out), encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["num_tasks"] == 2 and summary["seed"] == 3 and summary["k_list"] == [1, 2]


def test_humaneval_with_a_tiny_random_model(tmp_path, capsys):
  """--suite=humaneval end to end: a random tiny model (byte tokenizer, the tool's default)
  writes gibberish, which the sandboxed HumanEval check must run on and fail, never skip."""
  out = str(tmp_path / "humaneval.jsonl")
  rc = eval_tool.main(["--gin_file=moe/configs/tiny.gin", "--random_init=True",
                       # HumanEval prompts run to 1360 bytes; the tiny model holds 512 tokens.
                       "--gin.ModelConfig.max_seq_len=1024", "--suite=humaneval", "--limit=3",
                       "--n=2", "--k_list=(1, 2)", "--temperature=1.0", "--max_tokens=8",
                       f"--out={out}", "--pool_size=2"])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "evaluating on 3 humaneval task(s), n=2, k=(1, 2)" in text
  table = text.splitlines()[-4:]
  assert table[0].startswith("tasks: 3") and "infra errors: 0" in table[0]
  assert table[1].startswith("pass@1: 0.0000") and table[2].startswith("pass@2: 0.0000")
  rows = evaluate_lib.read_results(out)
  assert [r["task_id"] for r in rows] == ["humaneval-0", "humaneval-1", "humaneval-2"]
  assert all((r["suite"], r["split"], r["mode"], r["n"]) == ("humaneval", "test", "single_turn", 2)
             for r in rows)
  for s in (s for r in rows for s in r["samples"]):
    assert s["status"] == "ok" and s["model_tokens"] >= 1
    assert s["test_outcomes"] == {suite_humaneval.TEST_ID: "failed"}  # the check really ran


@pytest.mark.parametrize("argv, message", [
    (["--limit=1"], "exactly one of"),
    (["--checkpoint=/x", "--random_init=True"], "exactly one of"),
    (["--random_init=True", "--suite=bogus"], "--suite must be one of"),
    (["--random_init=True", "--suite=file"], "needs --task_file"),
    (["--random_init=True", "--split=nope"], "no tasks"),
    (["--random_init=True", "--suite=humaneval", "--split=train"], "no tasks"),
    (["--checkpoint=/definitely/missing"], "does not exist"),
    # HumanEval's longest prompt is 1360 bytes, beyond the tiny byte model's 512 positions.
    (["--gin_file=moe/configs/tiny.gin", "--random_init=True", "--suite=humaneval"],
     "more than the model's max_seq_len of 512"),
    (["--frobnicate=2"], "unknown flag --frobnicate"),
    (["--random_init=True", "--prompt_style=instruct"], "--prompt_style must be one of"),
])
def test_bad_flags(argv, message, capsys):
  assert eval_tool.main(argv) == 2
  assert message in capsys.readouterr().err


def test_a_hugging_face_checkpoint_is_evaluated_with_its_own_tokenizer(tmp_path, capsys,
                                                                      monkeypatch):
  """--hf_checkpoint of a transformers-saved Qwen3-MoE with a BPE tokenizer.json: the evaluation
  (the real one, watched) gets that tokenizer -- prompts encode as transformers encodes them --
  and no BOS, which the checkpoint's tokenizer does not have; without the tokenizer files the
  tool refuses to run rather than read the vocabulary as bytes."""
  import transformers  # pylint: disable=g-import-not-at-top
  ckpt = testutil.save_with_tokenizer(tmp_path / "qwen3", seed=2)
  ref = transformers.AutoTokenizer.from_pretrained(ckpt)
  seen = {}
  real = evaluate_lib.evaluate

  def evaluate(*a, **kw):
    seen.update(kw)
    return real(*a, **kw)

  monkeypatch.setattr(evaluate_lib, "evaluate", evaluate)
  out = str(tmp_path / "res.jsonl")
  rc = eval_tool.main([f"--hf_checkpoint={ckpt}", "--limit=1", "--max_tokens=4",
                       f"--out={out}", "--pool_size=1"])
  assert rc == 0, capsys.readouterr()
  text = "def add(a, b):\n    return a + b\n"
  assert seen["tokenizer"].encode(text) == ref.encode(text, add_special_tokens=False)
  assert seen["add_bos"] is False
  assert len(evaluate_lib.read_results(out)) == 1
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    (tmp_path / "qwen3" / name).unlink()
  assert eval_tool.main([f"--hf_checkpoint={ckpt}", "--limit=1", f"--out={out}"]) == 2
  assert "is not the byte tokenizer's" in capsys.readouterr().err


def test_humaneval_with_chat_prompts_from_the_checkpoints_template(tmp_path, capsys, monkeypatch):
  """--prompt_style=chat on a transformers-saved Qwen3-MoE chat checkpoint: the engine is sent,
  for each HumanEval task, exactly transformers' apply_chat_template ids of the user message that
  asks for the function (no stop strings), it stops at every EOS id of generation_config.json
  (<|im_end|> ends a chat turn), and the random model's answers are graded by the real check
  program. Without a chat template the flag is refused by name."""
  import transformers  # pylint: disable=g-import-not-at-top
  ckpt = testutil.save_with_tokenizer(tmp_path / "qwen3", seed=2, max_position_embeddings=1024)
  ref = transformers.AutoTokenizer.from_pretrained(ckpt)
  im_end, eot = ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id
  gen_config = os.path.join(ckpt, "generation_config.json")
  with open(gen_config, encoding="utf-8") as f:
    cfg = json.load(f)
  with open(gen_config, "w", encoding="utf-8") as f:  # as a chat checkpoint ships it
    json.dump({**cfg, "eos_token_id": [im_end, eot]}, f)
  sent = []
  real = engine_lib.Engine.generate

  def generate(self, prompt_token_ids, **kw):
    sent.append((list(prompt_token_ids), kw, self.config.eos_token_ids))
    return real(self, prompt_token_ids, **kw)

  monkeypatch.setattr(engine_lib.Engine, "generate", generate)
  out = str(tmp_path / "chat.jsonl")
  args = [f"--hf_checkpoint={ckpt}", "--suite=humaneval", "--limit=2", "--prompt_style=chat",
          "--n=2", "--k_list=(1, 2)", "--temperature=1.0", "--max_tokens=8", f"--out={out}",
          "--pool_size=2"]
  rc = eval_tool.main(args)
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "evaluating on 2 humaneval task(s), n=2, k=(1, 2), chat prompts" in text
  tasks = suite_humaneval.generate()[:2]
  want = [ref.apply_chat_template([{"role": "user", "content": chat_style.user_message(t)}],
                                  tokenize=True, add_generation_prompt=True) for t in tasks]
  want = [list(w["input_ids"]) if hasattr(w, "keys") else list(w) for w in want]
  assert sorted(p for p, _, _ in sent) == sorted(want)
  assert all("stop" not in kw and set(eos) == {im_end, eot} for _, kw, eos in sent)
  rows = evaluate_lib.read_results(out)
  assert [r["task_id"] for r in rows] == ["humaneval-0", "humaneval-1"]
  for s in (s for r in rows for s in r["samples"]):
    assert s["status"] == "ok" and s["test_outcomes"] == {suite_humaneval.TEST_ID: "failed"}
  with open(evaluate_lib.summary_path(out), encoding="utf-8") as f:
    assert json.load(f)["prompt_style"] == "chat"
  os.unlink(os.path.join(ckpt, "chat_template.jinja"))
  assert eval_tool.main(args) == 2
  err = capsys.readouterr().err
  assert "--prompt_style=chat needs the checkpoint's chat template" in err and ckpt in err


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
