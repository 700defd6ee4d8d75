"""Tests for the agent's tools: compact test reports for small observation limits, the offered
tool list."""

import sys

import pytest

from envs.harness import agent_tools
from envs.sandbox import testexec
from envs.tasks import task_format

# Messages as envs.sandbox.testrunner reports them (Python 3.11+ tracebacks, last 3 entries).
_ASSERT = ('  File "/opt/envs/testrunner.py", line 76, in _child\n    getattr(module, name)()\n'
           '  File "/workspace/test_app.py", line 5, in test_cap\n'
           '    assert cap(99) == 7, cap(99)\n           ^^^^^^^^^^^^\nAssertionError: 5\n')
_ATTR = ('  File "/workspace/test_app.py", line 8, in test_f\n    assert f(3) == 6, f(3)\n'
         '           ^^^^\n  File "/workspace/main.py", line 4, in f\n'
         '    return util.dbl(x)\n           ^^^^^^^^\n'
         "AttributeError: module 'util' has no attribute 'dbl'\n")
_IMPORT = ('  File "<frozen importlib._bootstrap>", line 241, in _call_with_frames_removed\n'
           '  File "/workspace/test_m.py", line 1, in <module>\n    from m import foo\n'
           "ImportError: cannot import name 'foo' from 'm' (/workspace/m.py)\n")


def _report(**failing):
  outcomes = {"test_app.py::test_ok": "passed"}
  outcomes.update({k: "failed" for k in failing})
  return testexec.TestReport(outcomes, {"test_app.py::test_ok": "", **failing})


def test_large_limit_keeps_the_full_report():
  r = _report(**{"test_app.py::test_cap": _ASSERT})
  assert agent_tools.report_text(r, 4000) == r.summary()


def test_small_limit_gives_the_compact_report():
  r = _report(**{"test_app.py::test_cap": _ASSERT, "test_app.py::test_f": _ATTR,
                 "test_m.py::test_foo": _IMPORT})
  text = agent_tools.report_text(r, 400)
  assert text == (
      "1/4 passed\n"
      "FAILED test_app.py::test_cap\n  test_app.py:5 assert cap(99) == 7, cap(99)\n"
      "  AssertionError: 5\n"
      "FAILED test_app.py::test_f\n  test_app.py:8 assert f(3) == 6, f(3)\n"
      "  main.py:4 return util.dbl(x)\n  AttributeError: module 'util' has no attribute 'dbl'\n"
      "FAILED test_m.py::test_foo\n  test_m.py:1 from m import foo\n"
      "  ImportError: cannot import name 'foo' from 'm' (m.py)")
  assert len(r.summary()) > 400  # The old middle cut would have lost lines here.


def test_tighter_limits_keep_the_key_lines_and_count_the_rest():
  r = _report(**{"test_app.py::test_cap": _ASSERT, "test_app.py::test_f": _ATTR})
  first = ("1/3 passed\nFAILED test_app.py::test_cap\n"
           "  test_app.py:5 assert cap(99) == 7, cap(99)\n  AssertionError: 5")
  assert agent_tools.report_text(r, 130) == first + "\n... 1 more failed"
  # No room for the count: the first failure matters more.
  assert agent_tools.report_text(r, 110) == first
  assert agent_tools.report_text(r, 90) == first[:90]
  # Each failure keeps its last two lines: the frame that failed and the error.
  text = agent_tools.report_text(r, 250)
  assert "  main.py:4 return util.dbl(x)\n  AttributeError: module 'util'" in text
  assert "test_app.py:8" not in text and len(text) <= 250
  for limit in (10, 40, 90):
    assert len(agent_tools.report_text(r, limit)) <= limit


def test_all_passed_is_one_line_when_compact():
  r = testexec.TestReport({"t.py::a": "passed", "t.py::b": "passed"}, {})
  assert agent_tools.report_text(r, 300) == "2/2 passed"
  assert agent_tools.report_text(r, 4000) == r.summary()


def test_offered_tools_only():
  task = task_format.Task("t", "x", {}, {"h.py": ""})
  # The restriction is checked before the sandbox is touched, so no sandbox is needed here.
  box = agent_tools.ToolBox(None, task, tool_names=("read_file", "submit"))
  obs, ok = box.call("run", {"command": "ls"})
  assert not ok and obs == "error: unknown tool 'run'; tools are read_file, submit"
  assert box.call("submit", {}) == ("submitted", True)
  assert agent_tools.ToolBox(None, task).call("submit", {}) == ("submitted", True)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
