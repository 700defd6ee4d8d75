"""Tests for //tools:eval: a project checkpoint scored from the command line, and bad flags.

The evaluation library itself (pass@k values, grading, determinism) is tested in
evaluation/evaluate_test.py; this checks the entry point's wiring: checkpoint loading, suite
selection, files written, exit codes.
"""

import json
import sys

import pytest

from evaluation import evaluate as evaluate_lib
from moe import checkpoint
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


@pytest.mark.parametrize("argv, message", [
    (["--limit=1"], "exactly one of"),
    (["--checkpoint=/x", "--random_init=True"], "exactly one of"),
    (["--random_init=True", "--suite=bogus"], "--suite must be one of"),
    (["--random_init=True", "--suite=file"], "needs --task_file"),
    (["--random_init=True", "--split=nope"], "no tasks"),
    (["--checkpoint=/definitely/missing"], "does not exist"),
    (["--frobnicate=2"], "unknown flag --frobnicate"),
])
def test_bad_flags(argv, message, capsys):
  assert eval_tool.main(argv) == 2
  assert message in capsys.readouterr().err


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
