"""Tests for //tools:eval: a project checkpoint scored from the command line, HumanEval with a
random model, and bad flags.

The evaluation library itself (pass@k values, grading, determinism) is tested in
evaluation/evaluate_test.py; this checks the entry point's wiring: checkpoint loading, suite
selection, files written, exit codes.
"""

import json
import sys

import pytest

from envs.tasks import suite_humaneval
from evaluation import evaluate as evaluate_lib
from moe import checkpoint
from moe.hf import testutil
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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
