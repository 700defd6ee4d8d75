"""compare_evals: paired per-task statistics checked against values worked out by hand, read
from the files `evaluation.evaluate` writes."""

import json
import sys

import pytest

from evaluation import evaluate as evaluate_lib
from tools import compare_evals


def _write(path, counts, n=4):
  """Per-task JSONL as evaluation.evaluate writes it: one TaskResult per (task id, c)."""
  with open(path, "w", encoding="utf-8") as f:
    for task_id, c in counts:
      r = evaluate_lib.TaskResult(task_id=task_id, suite="pyfunc", split="test",
                                  mode="single_turn", n=n, c=c, pass_at_k={1: c / n},
                                  samples=[], flags={})
      f.write(json.dumps(r.to_json()) + "\n")


def test_statistics_match_hand_computed_values(tmp_path):
  # Per-task pass@1 before 0, 1/2, 1 and after 1/2, 1/2, 3/4 (n = 4): gains +1/2, 0, -1/4.
  _write(tmp_path / "eval_before.jsonl", [("a", 0), ("b", 2), ("c", 4)])
  _write(tmp_path / "eval_after.jsonl", [("c", 3), ("a", 2), ("b", 2)])  # any order: paired by id
  out = tmp_path / "s.json"
  assert compare_evals.main([str(tmp_path), "--json", str(out)]) == 0
  s = json.loads(out.read_text())
  assert (s["up"], s["down"], s["unchanged"], s["tasks"]) == (1, 1, 1, 3)
  assert (s["passed_before"], s["passed_after"], s["samples_before"]) == (6, 7, 12)
  assert s["mean_gain"] == pytest.approx(1 / 12)
  # std(gains, ddof=1) / sqrt(3): deviations 5/12, -1/12, -4/12 -> sqrt(42/144 / 2 / 3).
  assert s["task_se"] == pytest.approx((42 / 144 / 6) ** 0.5)
  # Binomial: before 0 + 1/16 + 0, after 1/16 + 1/16 + 3/64 -> sqrt(15/64) / 3.
  assert s["sample_se"] == pytest.approx((15 / 64) ** 0.5 / 3)
  assert s["gain_over_task_se"] == pytest.approx(s["mean_gain"] / s["task_se"])


def test_two_files_and_text(tmp_path, capsys):
  _write(tmp_path / "x.jsonl", [("a", 1), ("b", 1)], n=8)
  _write(tmp_path / "y.jsonl", [("a", 5), ("b", 3)], n=8)
  assert compare_evals.main([str(tmp_path / "x.jsonl"), str(tmp_path / "y.jsonl")]) == 0
  line = capsys.readouterr().out
  assert "before 2/16 -> after 8/16" in line and "2 up, 0 down, 0 unchanged" in line
  assert "mean gain +0.375" in line and "task-level SE 0.125" in line


def test_different_task_sets_are_refused(tmp_path, capsys):
  _write(tmp_path / "eval_before.jsonl", [("a", 1), ("b", 2)])
  _write(tmp_path / "eval_after.jsonl", [("a", 1), ("z", 2)])
  assert compare_evals.main([str(tmp_path)]) == 2
  assert "different tasks" in capsys.readouterr().err
  with pytest.raises(ValueError, match="twice"):
    compare_evals.compare([{"task_id": "a", "c": 1, "n": 2}] * 2, [])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
