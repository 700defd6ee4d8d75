"""Tests for task_format: the format round-trips and bad tasks are rejected with reasons."""

import json
import sys

import pytest

from envs.tasks import suite_pyfunc
from envs.tasks import suite_swe
from envs.tasks import task_format


def _good():
  return {"task_id": "t1", "instructions": "do it", "files": {"a.py": "x = 1\n",
          "test_a.py": "def test_a():\n  pass\n"}, "hidden_tests": {"test_h.py": "def test_h():\n  pass\n"},
          "visible_tests": ["test_a.py"], "limits": {"timeout_s": 3}}


def test_builtin_suites_validate():
  for t in suite_pyfunc.generate() + suite_swe.generate():
    assert task_format.validate(t.to_json()) == [], t.task_id


@pytest.mark.parametrize("fmt", ["jsonl", "dirs"])
def test_round_trip(tmp_path, fmt):
  ts = suite_swe.generate() + suite_pyfunc.generate()[:3]
  if fmt == "jsonl":
    path = str(tmp_path / "t.jsonl")
    task_format.dump_jsonl(ts, path)
  else:
    path = str(tmp_path)
    for t in ts:
      task_format.write_task_dir(t, path)
  loaded = task_format.load_tasks(path)
  assert loaded.rejected == []
  assert sorted(t.task_id for t in loaded.tasks) == sorted(t.task_id for t in ts)
  by_id = {t.task_id: t for t in loaded.tasks}
  for t in ts:
    assert by_id[t.task_id] == t


@pytest.mark.parametrize("mutate,reason", [
    (lambda d: d.pop("instructions"), "instructions"),
    (lambda d: d.update(task_id="bad id!"), "task_id"),
    (lambda d: d["files"].update({"../x.py": ""}), "inside the repository"),
    (lambda d: d["files"].update({"/etc/x": ""}), "inside the repository"),
    (lambda d: d.update(hidden_tests={}), "hidden_tests"),
    (lambda d: d.update(visible_tests=["nope.py"]), "does not exist"),
    (lambda d: d.update(grading="swe"), "fail_to_pass"),
    (lambda d: d.update(grading="vibes"), "grading"),
    (lambda d: d.update(language="cobol"), "language"),
    (lambda d: d.update(limits={"timeout_s": -1}), "positive"),
    (lambda d: d.update(limits={"turns": 3}), "unknown key"),
    (lambda d: d.update(colour="red"), "unknown fields"),
    (lambda d: d["files"].update({"b.py": 3}), "not text"),
])
def test_rejects_with_reasons(tmp_path, mutate, reason):
  bad = _good()
  mutate(bad)
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps(_good()) + "\n" + json.dumps(bad) + "\n{not json\n")
  res = task_format.load_tasks(str(path))
  # A bad task that kept the good one's id is rejected as a duplicate as well; one whose id the
  # mutation changed is not.
  duplicate = any(r.startswith("duplicate task_id") for r in res.rejected[0].reasons)
  assert duplicate == (bad.get("task_id") == "t1"), res.rejected[0].reasons
  assert [t.task_id for t in res.tasks] == ["t1"]
  assert len(res.rejected) == 2
  assert any(reason in r for r in res.rejected[0].reasons), res.rejected[0].reasons
  assert "invalid JSON" in res.rejected[1].reasons[0]


def test_duplicate_ids_rejected(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps(_good()) + "\n" + json.dumps(_good()) + "\n")
  res = task_format.load_tasks(str(path))
  assert len(res.tasks) == 1 and "duplicate" in res.rejected[0].reasons[0]


def test_from_dict_raises_with_reasons():
  with pytest.raises(ValueError, match="hidden_tests"):
    task_format.from_dict({**_good(), "hidden_tests": {}})


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
