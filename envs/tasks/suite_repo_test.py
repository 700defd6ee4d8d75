"""Tests for suite_repo: size, splits, held-out novelty, and in the sandbox: every oracle fix
passes the hidden tests, the untouched repository and the wrong attempts fail them, and the
visible tests fail before the fix showing what the fix needs."""

import collections
import sys

import pytest

from envs import reward
from envs import sandbox as sandbox_lib
from envs.harness import agent_tools
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_repo

TASKS = suite_repo.generate()


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def test_size_split_and_determinism():
  assert len(TASKS) == 400
  assert len({t.task_id for t in TASKS}) == len(TASKS)
  test, train = suite_repo.split(TASKS, "test"), suite_repo.split(TASKS, "train")
  assert len(test) >= 100 and len(train) + len(test) == len(TASKS)
  per = collections.Counter((t.metadata["template"], t.split) for t in TASKS)
  for template in suite_repo.TEMPLATES:
    assert per[(template, "train")] >= 30 and per[(template, "test")] >= 10, per
  assert suite_repo.generate() == TASKS
  other = suite_repo.generate(seed=1)
  assert [t.files for t in other] != [t.files for t in TASKS]
  rest, valid = suite_repo.validation(TASKS)
  assert {t.task_id for t in valid} <= {t.task_id for t in train}
  assert not {t.task_id for t in valid} & {t.task_id for t in rest}
  assert len(rest) + len(valid) == len(train) and 0.08 < len(valid) / len(train) < 0.25
  with pytest.raises(ValueError, match="split must be"):
    suite_repo.split(TASKS, "valid")


def test_heldout_tasks_are_new_combinations():
  train = suite_repo.split(TASKS, "train")
  train_keys = {tuple(t.metadata["key"]) for t in train}
  train_texts = {text for t in train for text in t.files.values()}
  train_asserts = {l.strip() for t in train for l in t.files[t.visible_tests[0]].splitlines()
                   if "assert " in l}
  train_fixes = {tuple(sorted(t.metadata["fix"].items())) for t in train}
  for t in suite_repo.split(TASKS, "test"):
    assert tuple(t.metadata["key"]) not in train_keys, t.task_id
    assert t.files[t.visible_tests[0]] not in train_texts, t.task_id
    assert not {l.strip() for l in t.files[t.visible_tests[0]].splitlines()} & train_asserts
    assert tuple(sorted(t.metadata["fix"].items())) not in train_fixes, t.task_id
  # ... yet made of what the train split shows: every template, and mostly known names.
  train_names = {n for t in train for n in t.files}
  test = suite_repo.split(TASKS, "test")
  assert sum(all(n in train_names for n in t.files) for t in test) > len(test) // 2


def test_tasks_are_tiny():
  for t in TASKS:
    assert len(t.files) >= 2 and t.visible_tests and t.hidden_tests, t.task_id
    assert sum(len(v) for v in t.files.values()) < 320, t.task_id
    assert len(t.instructions) < 70, t.task_id
    assert set(t.visible_tests) <= set(t.files) and not set(t.hidden_tests) & set(t.files)
    steps = [s for k in ("direct", "tests_first", "wrong_first") for s in
             (t.metadata[k] or [])]
    assert {s["tool"] for s in steps} <= set(suite_repo.TOOLS)


RANDOM = suite_repo.generate(seed=1, per_template=12, names="random")


def test_random_names_are_made_up_and_the_suite_unchanged():
  """Made-up-name tasks (pre-training only) share no file name with the suite and are all
  train; the suite's own names still come from its lists (standard mode draws as before)."""
  assert len(RANDOM) == 60 and all(t.split == "train" for t in RANDOM)
  assert all(t.task_id.startswith("repo-random-") for t in RANDOM)
  suite_files = {n for t in TASKS for n in t.files}
  random_files = {n for t in RANDOM for n in t.files}
  assert not random_files & suite_files
  assert len(random_files) > 100  # fresh names, not a small list
  assert {t.task_id for t in TASKS} == {t.task_id for t in suite_repo.generate()}
  assert TASKS[0].files == suite_repo.generate()[0].files
  consts = [t for t in RANDOM if t.metadata["template"] == "const"]
  assert all(t.metadata["fix"]["old"].split(" = ")[0].isupper() for t in consts)
  with pytest.raises(ValueError, match="names must be one of"):
    suite_repo.generate(names="greek")
  # No made-up module is one Python already has (`from time import f` finds the stdlib's).
  many = {n[:-3] for t in suite_repo.generate(seed=1, per_template=100, names="random")
          for n in t.files}
  assert len(many) > 1000 and not many & set(sys.stdlib_module_names)


def test_made_up_names_never_collide_within_a_task():
  """Made-up names are drawn independently, so two roles could get one word: a module named like
  its helper or config module (one file overwrote the other: seed 2's repo-random-helper-058
  had no helper file, and its oracle transcript could not be written). Every role that must
  differ does, for many draws: each task has all its files, and the helper's function is not
  its module's name."""
  files_per_template = {"const": 3, "helper": 3, "op": 2, "imports": 4, "rename": 2}
  for seed in range(1, 5):
    for t in suite_repo.generate(seed=seed, per_template=100, names="random"):
      meta = t.metadata
      assert len(t.files) == files_per_template[meta["template"]], (t.task_id, sorted(t.files))
      if meta["template"] == "helper":
        util, fn = meta["key"][0], meta["key"][4]
        assert util != fn and f"{util}.py" in t.files, t.task_id


FRESH = suite_repo.generate_fresh(TASKS, seed=3, per_template=40,
                                  templates=("helper", "imports", "op", "rename"))


def _parts(t):
  asserts = {l.strip() for l in t.files[t.visible_tests[0]].splitlines() if "assert " in l}
  return ((t.metadata["template"], *map(str, t.metadata["key"])),
          tuple(sorted(t.metadata["fix"].items())), asserts)


def test_fresh_tasks_are_none_of_the_suites_and_use_its_names():
  """RL's extra tasks (experiment rl_fresh_tasks): no combination, visible assertion or fix of
  any suite task, held-out ones included, nor of each other; the suite's names; all train."""
  per = collections.Counter(t.metadata["template"] for t in FRESH)
  assert per["helper"] == per["imports"] == 40  # large spaces: as many as asked
  assert 0 < per["op"] < 40 and 0 < per["rename"] < 40  # spaces the suite nearly used up
  assert "const" not in per
  assert all(t.split == "train" and t.task_id.startswith("repo-fresh-") for t in FRESH)
  assert len({t.task_id for t in FRESH}) == len(FRESH)
  keys, fixes, asserts = set(), set(), set()
  for t in TASKS:
    k, f, a = _parts(t)
    keys.add(k), fixes.add(f), asserts.update(a)
  for t in FRESH:
    k, f, a = _parts(t)
    assert k not in keys and f not in fixes and not a & asserts, t.task_id
    keys.add(k), fixes.add(f), asserts.update(a)  # nor one another's
  suite_names = {n for t in TASKS for n in t.files}
  assert all(set(t.files) <= suite_names for t in FRESH)
  # Deterministic, and the suite itself is unchanged by drawing them.
  assert suite_repo.generate_fresh(TASKS, seed=3, per_template=40,
                                   templates=("helper", "imports", "op", "rename")) == FRESH
  assert suite_repo.generate() == TASKS
  with pytest.raises(ValueError, match="unknown template"):
    suite_repo.generate_fresh(TASKS, seed=3, per_template=1, templates=("nope",))


def test_oracle_plans_use_only_what_the_agent_can_know():
  """A plan opens only files the instructions name (or their tests, test_<name>.py), unless an
  earlier step listed the files or ran the tests: the transcripts must not teach the model to
  guess file names it was never shown."""
  for t in TASKS + RANDOM:
    words = set(t.instructions.replace(",", " ").split())
    named = {w.rstrip(".") for w in words if ".py" in w} | {w.split(".")[0] + ".py" for w in words}
    knowable = named | {"test_" + n for n in named}
    for k in ("direct", "tests_first", "wrong_first"):
      shown = False
      for step in t.metadata[k] or []:
        if step["tool"] in ("list_files", "run_tests"):
          shown = True
        path = step["args"].get("path")
        if path and not shown:
          assert path in knowable, (t.task_id, k, path, t.instructions)


def test_oracle_fix_passes_hidden_tests_untouched_and_wrong_fail(pool):
  for t in TASKS + RANDOM[::3] + FRESH[::8]:
    fixed = reward.grade(t, suite_repo.solved_files(t), pool=pool)
    assert (fixed.status, fixed.reward) == ("ok", 1.0), (t.task_id, fixed.detail,
                                                         fixed.outcomes)
    before = reward.grade(t, dict(t.files), pool=pool)
    assert (before.status, before.reward) == ("ok", 0.0), t.task_id
    wrong = t.metadata["wrong"]
    if wrong:
      files = dict(t.files)
      files[wrong["path"]] = files[wrong["path"]].replace(wrong["old"], wrong["new"], 1)
      assert files != t.files
      g = reward.grade(t, files, pool=pool)
      assert (g.status, g.reward) == ("ok", 0.0), t.task_id


def test_visible_tests_fail_before_the_fix_showing_what_it_needs(pool):
  # The agent's own view: run_tests through its toolbox with a small observation limit.
  for t in TASKS[::2]:
    for files, passes in ((dict(t.files), False), (suite_repo.solved_files(t), True)):
      sb = sandbox_lib.Sandbox(files, pool=pool)
      try:
        obs, ok = agent_tools.ToolBox(sb, t, observation_max_chars=200).call("run_tests", {})
      finally:
        sb.close()
      assert ok == passes, (t.task_id, obs)
      if passes:
        assert obs == "1/1 passed", (t.task_id, obs)
      else:
        assert t.metadata["shows"] in obs, (t.task_id, obs)
        first = t.metadata["tests_first"][0]
        assert first["tool"] == "run_tests" and first["expect"] in obs, (t.task_id, obs)


def test_solved_files_refuses_an_ambiguous_fix():
  t = TASKS[0]
  fix = t.metadata["fix"]
  files = dict(t.files)
  files[fix["path"]] += fix["old"] + "\n"
  with pytest.raises(ValueError, match="occurs 2 times"):
    suite_repo.solved_files(type(t)(**{**t.__dict__, "files": files}))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
