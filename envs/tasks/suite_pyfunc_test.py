"""Tests for suite_pyfunc: size, splits, solutions pass, corpus excludes held-out tasks."""

import ast
import sys

import pytest

from envs import reward
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc


def test_size_and_split():
  ts = suite_pyfunc.generate()
  assert 200 <= len(ts) <= 400
  assert len({t.task_id for t in ts}) == len(ts)
  test = suite_pyfunc.split(ts, "test")
  assert 0.08 < len(test) / len(ts) < 0.3
  # Held-out tasks share templates with train tasks (same family, other parameter).
  train_families = {t.metadata["family"] for t in suite_pyfunc.split(ts, "train")}
  assert sum(t.metadata["family"] in train_families for t in test) > len(test) // 2
  assert suite_pyfunc.generate() == ts  # Deterministic.


def test_prompts_are_compact_and_solutions_short():
  for t in suite_pyfunc.generate():
    assert len(t.prompt) + len(t.solution) < 120, t.task_id
    assert t.prompt.startswith("# ") and t.prompt.endswith("):\n")
    ast.parse(t.prompt + t.solution)
    assert t.solution.count("\n") == 1


def test_reference_solutions_pass_in_sandbox():
  ts = suite_pyfunc.generate()
  sample = ts[::25]
  with pool_lib.WarmPool(size=2) as pool:
    for t in sample:
      files = dict(t.files, **{"solution.py": t.prompt + t.solution})
      g = reward.grade(t, files, pool=pool)
      assert (g.status, g.reward) == ("ok", 1.0), (t.task_id, g.detail)


def test_corpus_excludes_heldout():
  ts = suite_pyfunc.generate()
  docs = suite_pyfunc.pretraining_corpus(ts, n_snippets=3000)
  text = "\n".join(docs)
  train = suite_pyfunc.split(ts, "train")
  for t in train[:20]:
    assert t.prompt + t.solution in docs
  for t in suite_pyfunc.split(ts, "test"):
    assert t.prompt not in text, t.task_id
    assert f"def {t.entry_point}(" not in text, t.task_id
  for d in docs:
    ast.parse(d)
    assert d.startswith("# ")
  assert len(docs) > len(train) + 2000


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
