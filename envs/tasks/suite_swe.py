"""Built-in suite 2: SWE-style tasks the project builds itself.

Each task is a small repository with a bug, an issue describing it, the repository's own visible
tests, and hidden tests: FAIL_TO_PASS (fail before the fix, must pass after) and PASS_TO_PASS
(pass before, must still pass). Graded SWE-bench style: reward 1 iff every one passes. Each task
carries its gold patch in `metadata["gold_files"]` so tests can check the task is solvable and
that the unfixed repository fails.
"""

from __future__ import annotations

from envs.tasks import task_format

SUITE = "swe"

_CALC_OPS = '''"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mean(xs):
    return sum(xs) // len(xs)
'''

_CALC_OPS_FIXED = _CALC_OPS.replace(
    "    return sum(xs) // len(xs)\n",
    "    if not xs:\n        raise ValueError(\"mean of empty list\")\n"
    "    return sum(xs) / len(xs)\n")

_CALC_TESTS = '''from calc.ops import add, sub


def test_add():
    assert add(2, 3) == 5


def test_sub():
    assert sub(2, 3) == -1
'''

_CALC_HIDDEN = _CALC_TESTS.replace("from calc.ops import add, sub", "from calc.ops import add, sub, mean") + '''

def test_mean_float():
    assert mean([1, 2]) == 1.5


def test_mean_empty():
    try:
        mean([])
    except ValueError:
        return
    raise AssertionError("mean([]) should raise ValueError")


def test_mean_int():
    assert mean([2, 4]) == 3
'''

_TEXT = '''"""Text helpers."""


def slugify(text):
    """Turns a title into a URL slug."""
    return "-".join(text.strip().split(" "))


def initials(name):
    return "".join(part[0].upper() for part in name.split())
'''

_TEXT_FIXED = _TEXT.replace('return "-".join(text.strip().split(" "))',
                            'return "-".join(text.lower().split())')

_TEXT_TESTS = '''from textkit.text import slugify, initials


def test_slug_simple():
    assert slugify("abc") == "abc"


def test_initials():
    assert initials("ada lovelace") == "AL"
'''

_TEXT_HIDDEN = _TEXT_TESTS + '''

def test_slug_lowercase():
    assert slugify("Hello World") == "hello-world"


def test_slug_collapses_spaces():
    assert slugify("  a   b ") == "a-b"
'''

_PAGER = '''"""Pagination."""


def paginate(items, page, per_page=10):
    """Returns page `page` (1-based) of `items`."""
    if per_page <= 0:
        raise ValueError("per_page must be positive")
    start = page * per_page
    return items[start:start + per_page]


def num_pages(items, per_page=10):
    return (len(items) + per_page - 1) // per_page
'''

_PAGER_FIXED = _PAGER.replace("start = page * per_page", "start = (page - 1) * per_page")

_PAGER_TESTS = '''import pytest_free_helpers as h
from pager.pages import paginate, num_pages


def test_num_pages():
    assert num_pages(list(range(25))) == 3


def test_bad_per_page():
    h.assert_raises(ValueError, paginate, [1], 1, 0)
'''

_PAGER_HELPERS = '''"""Test helpers (the sandbox has no pytest)."""


def assert_raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")
'''

_PAGER_HIDDEN = _PAGER_TESTS + '''

def test_first_page():
    assert paginate(list(range(25)), 1) == list(range(10))


def test_last_partial_page():
    assert paginate(list(range(25)), 3) == list(range(20, 25))
'''


def _task(task_id, issue, files, hidden, f2p, p2p, gold):
  return task_format.Task(
      task_id=task_id, instructions=issue, files=files, hidden_tests=hidden,
      visible_tests=tuple(p.partition("::")[0] for p in p2p[:1]), grading="swe",
      fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p), suite=SUITE, split="test",
      limits=task_format.Limits(timeout_s=10.0, memory_mb=512, max_turns=20, max_tokens=16384),
      metadata={"gold_files": gold})


def generate() -> list[task_format.Task]:
  """The sample SWE-style tasks."""
  t = "tests/test_ops.py"
  calc = _task(
      "swe-calc-mean",
      "Issue: `calc.ops.mean` is wrong. `mean([1, 2])` returns 1, it should return 1.5. Also "
      "`mean([])` raises ZeroDivisionError; it should raise ValueError.",
      {"calc/__init__.py": "", "calc/ops.py": _CALC_OPS, t: _CALC_TESTS,
       "README.md": "# calc\nArithmetic helpers. Run the tests in tests/.\n"},
      {t: _CALC_HIDDEN},
      [f"{t}::test_mean_float", f"{t}::test_mean_empty"],
      [f"{t}::test_add", f"{t}::test_sub", f"{t}::test_mean_int"],
      {"calc/ops.py": _CALC_OPS_FIXED})
  t = "tests/test_text.py"
  text = _task(
      "swe-textkit-slugify",
      "Issue: `textkit.text.slugify(\"Hello World\")` returns \"Hello-World\"; slugs must be "
      "lower case, and runs of spaces should become a single dash (\"  a   b \" -> \"a-b\").",
      {"textkit/__init__.py": "", "textkit/text.py": _TEXT, t: _TEXT_TESTS},
      {t: _TEXT_HIDDEN},
      [f"{t}::test_slug_lowercase", f"{t}::test_slug_collapses_spaces"],
      [f"{t}::test_slug_simple", f"{t}::test_initials"],
      {"textkit/text.py": _TEXT_FIXED})
  t = "tests/test_pages.py"
  pager = _task(
      "swe-pager-offbyone",
      "Issue: pages are documented as 1-based, but `paginate(items, 1)` returns the second "
      "page. `paginate(list(range(25)), 1)` should return items 0..9.",
      {"pager/__init__.py": "", "pager/pages.py": _PAGER, t: _PAGER_TESTS,
       "tests/pytest_free_helpers.py": _PAGER_HELPERS},
      {t: _PAGER_HIDDEN},
      [f"{t}::test_first_page", f"{t}::test_last_partial_page"],
      [f"{t}::test_num_pages", f"{t}::test_bad_per_page"],
      {"pager/pages.py": _PAGER_FIXED})
  return [calc, text, pager]
