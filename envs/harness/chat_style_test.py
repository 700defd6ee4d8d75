"""Tests for chat_style: the code read from chat answers, the solution.py built from it, and
HumanEval graded through the single-turn path with the chat style (a scripted sampler writes the
answers; the sandbox and the official check program are real)."""

import ast
import sys

import pytest

from envs.harness import attempts
from envs.harness import chat_style
from envs.harness import inprocess_policy
from envs.harness import scripted_sampler
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_humaneval
from envs.tasks import task_format

TOK = scripted_sampler.TOK


def _task(prompt: str, entry_point: str = "inc") -> task_format.Task:
  return task_format.from_dict({
      "task_id": "t", "instructions": "x", "files": {}, "hidden_tests": {"test_t.py": "pass\n"},
      "prompt": prompt, "entry_point": entry_point})


@pytest.mark.parametrize("answer, code", [
    ("Sure:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```py\nx = 1\n```", "x = 1\n"),
    ("```Python\nx = 1\n```", "x = 1\n"),
    # A Python block wins over an earlier untagged one; an untagged one over the raw text.
    ("```\n$ run it\n```\nthen\n```python\nx = 2\n```", "x = 2\n"),
    ("Output:\n```\nx = 3\n```\n", "x = 3\n"),
    # Only the first Python block.
    ("```python\na = 1\n```\nand a test\n```python\nassert a == 2\n```", "a = 1\n"),
    # Reasoning is dropped first, code in it too.
    ("<think>\n```python\nreturn None\n```\n</think>\n\n```python\nreturn 4\n```", "return 4\n"),
    # A fence left open (out of tokens) runs to the end.
    ("Here:\n```python\ndef f():\n    return", "def f():\n    return"),
    # No fence: the answer is the code.
    ("    return x + 1\n", "    return x + 1\n"),
])
def test_extract_code(answer, code):
  assert chat_style.extract_code(answer) == code


def test_a_full_definition_replaces_the_prompts_and_drops_what_is_not_a_definition():
  task = _task("from typing import List\n\n\ndef inc(x: int) -> int:\n    \"\"\"x + 1\"\"\"\n")
  answer = ("```python\nfrom __future__ import annotations\nimport functools\n\nSTEP = 1\n\n\n"
            "@functools.lru_cache(maxsize=None)\ndef helper():\n    return STEP\n\n\n"
            "def inc(x: int) -> int:\n    return x + helper()\n\n\n"
            "print(inc(1))\nassert inc(1) == 3\nif __name__ == '__main__':\n    inc(0)\n```")
  sol = chat_style.solution_file(task, answer)
  assert sol == (task.prompt + "\n\nimport functools\n\nSTEP = 1\n\n"
                 "@functools.lru_cache(maxsize=None)\ndef helper():\n    return STEP\n\n"
                 "def inc(x: int) -> int:\n    return x + helper()\n")
  namespace = {}
  exec(compile(sol, "solution.py", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["inc"](1) == 2


def test_a_definition_indented_as_a_whole_is_a_definition():
  task = _task("def inc(x):\n    \"\"\"x + 1\"\"\"\n")
  answer = "1. The code:\n\n    ```python\n    def inc(x):\n        return x + 1\n    ```\n"
  sol = chat_style.solution_file(task, answer)
  assert sol.endswith("\n\ndef inc(x):\n    return x + 1\n")


def test_a_definition_that_does_not_parse_is_graded_as_written():
  task = _task("def inc(x):\n    \"\"\"x + 1\"\"\"\n")
  sol = chat_style.solution_file(task, "```python\ndef inc(x):\n    return x +\n```")
  assert sol == task.prompt + "\n\ndef inc(x):\n    return x +\n"
  with pytest.raises(SyntaxError):
    ast.parse(sol)


@pytest.mark.parametrize("answer, body", [
    # A body at column 0 is indented into the function; an indented one is kept as written.
    ("```python\ny = x + 1\nif y:\n    return y\n```",
     "    y = x + 1\n    if y:\n        return y\n"),
    ("```python\n    return x + 1\n```", "    return x + 1\n"),
    ("return x + 1", "    return x + 1"),
])
def test_anything_else_is_a_body(answer, body):
  task = _task("def inc(x):\n    \"\"\"x + 1\"\"\"\n")
  assert chat_style.solution_file(task, answer) == task.prompt + body


def test_the_user_message_and_the_prompt_ids():
  task = _task("def inc(x):\n    \"\"\"x + 1\"\"\"\n\n")
  seen = []

  def render_ids(messages):
    seen.append(messages)
    return [7, 8]

  style = chat_style.ChatStyle(render_ids)
  want = ("Complete the following Python function. Reply with the complete function, signature "
          "included, in one ```python code block.\n\n"
          "```python\ndef inc(x):\n    \"\"\"x + 1\"\"\"\n```")
  assert chat_style.user_message(task) == want
  # The template holds the whole prompt: no BOS from the policy in front.
  policy = inprocess_policy.InProcessPolicy(None, TOK, add_bos=True)
  assert style.prompt_ids(task, policy) == [7, 8]
  assert seen == [[{"role": "user", "content": want}]]
  assert style.stop(task) == ()


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


@pytest.mark.parametrize("index", [0, 38])  # 38: the test calls a helper the prompt defines
def test_humaneval_answers_graded_through_the_single_turn_path(index, pool):
  """Three chat answers to one problem in one request: the canonical body in a fence, the
  canonical solution as a full definition with prose and a usage example around it, and a wrong
  full definition; the first two pass the official check, the third fails it. The prompt sent is
  the rendered user message, and no stop string cuts the answers."""
  problem = suite_humaneval.read_problems()[index]
  task = suite_humaneval.to_task(problem)
  entry = problem["entry_point"]
  answers = [
      f"Here is the body:\n```python\n{problem['canonical_solution']}```",
      (f"Sure.\n\n```python\n{problem['prompt']}{problem['canonical_solution']}\n\n"
       f"print({entry}.__name__)\n```\n\nIt works because..."),
      f"```python\ndef {entry}(*args):\n    return None\n```",
  ]
  gen = scripted_sampler.scripted_generate(answers)
  policy = inprocess_policy.InProcessPolicy(gen, TOK, stop_strings=False)

  def render_ids(messages):
    return TOK.encode("<user>" + messages[0]["content"] + "<assistant>")

  settings = attempts.AttemptSettings(max_tokens=4096,
                                      single_turn_style=chat_style.ChatStyle(render_ids))
  trajs = attempts.run_attempts(task, policy, pool=pool, n=3, seed=0, settings=settings)
  assert gen.calls[0]["prompt"] == render_ids([{"role": "user",
                                                "content": chat_style.user_message(task)}])
  assert [t.completion_text for t in trajs] == answers  # whole: no stop string cut them
  verdicts = [(t.status, t.reward, t.test_outcomes) for t in trajs]
  passed = {suite_humaneval.TEST_ID: "passed"}
  assert verdicts == [("ok", 1.0, passed), ("ok", 1.0, passed),
                      ("ok", 0.0, {suite_humaneval.TEST_ID: "failed"})], trajs[2].infra_error
  assert trajs[0].final_files["solution.py"] == problem["prompt"] + problem["canonical_solution"]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
