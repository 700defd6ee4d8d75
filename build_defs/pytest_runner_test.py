"""Tests for the shared pytest runner and the CI test-case counter.

The runner is what makes `bazel test` honest: it must run a file that has no `__main__` block,
fail a file that collects no test, and write the JUnit report that `count_test_cases` sums.
"""

import os
import subprocess
import sys

import pytest

from build_defs import count_test_cases

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNNER = os.path.join(_HERE, "pytest_runner.py")


def _run(tmp_path, source, *extra):
  test_file = tmp_path / "x_test.py"
  test_file.write_text(source)
  env = dict(os.environ, XML_OUTPUT_FILE=str(tmp_path / "test.xml"))
  env.pop("TESTBRIDGE_TEST_ONLY", None)
  return subprocess.run([sys.executable, _RUNNER, str(test_file), *extra], env=env,
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)


def test_file_without_main_block_runs_its_tests(tmp_path):
  r = _run(tmp_path, "def test_a():\n  pass\n\ndef test_b():\n  pass\n\n"
                     "def test_c():\n  assert 1 == 2\n")
  assert r.returncode == 1, r.stdout + r.stderr  # test_c ran and failed
  assert count_test_cases.report_counts(str(tmp_path / "test.xml")) == (3, 1, 0)


def test_file_with_no_test_fails(tmp_path):
  r = _run(tmp_path, "X = 1\n")
  assert r.returncode == int(pytest.ExitCode.NO_TESTS_COLLECTED), r.stdout + r.stderr
  assert "collected no test" in r.stderr


def test_missing_file_is_a_clear_error(tmp_path):
  r = subprocess.run([sys.executable, _RUNNER, str(tmp_path / "nope_test.py")],
                     capture_output=True, text=True, timeout=60, check=False)
  assert r.returncode == 2 and "no such test file" in r.stderr


def _write_report(path, tests, failures=0, skipped=0):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(f'<testsuites><testsuite name="pytest" errors="0" failures="{failures}" '
            f'skipped="{skipped}" tests="{tests}"/></testsuites>')


def test_counter_sums_reports_of_summarized_targets(tmp_path, capsys):
  logs = tmp_path / "testlogs"
  _write_report(str(logs / "a" / "x_test" / "test.xml"), 5, skipped=1)
  for i in (1, 2):
    _write_report(str(logs / "b" / "hf" / "y_test" / f"run_{i}_of_2" / "test.xml"), 3, failures=i - 1)
  _write_report(str(logs / "c" / "not_in_summary" / "test.xml"), 100)
  log = tmp_path / "bazel.log"
  log.write_text("INFO: noise\n//a:x_test            (cached) PASSED in 1.0s\n"
                 "//b:hf/y_test              FLAKY, failed in 1 out of 2 in 3.0s\n")
  assert count_test_cases.main(["prog", str(log), str(logs)]) == 0
  assert capsys.readouterr().out.strip() == (
      "test cases: 9 passed, 1 failed, 1 skipped (2 targets, 3 reports)")


@pytest.mark.parametrize("tests", [0, None])
def test_counter_fails_a_target_that_ran_nothing(tmp_path, capsys, tests):
  logs = tmp_path / "testlogs"
  _write_report(str(logs / "a" / "ok_test" / "test.xml"), 2)
  if tests is not None:
    _write_report(str(logs / "a" / "empty_test" / "test.xml"), tests)
  log = tmp_path / "bazel.log"
  log.write_text("//a:ok_test   PASSED in 1s\n//a:empty_test   PASSED in 1s\n")
  assert count_test_cases.main(["prog", str(log), str(logs)]) == 1
  err = capsys.readouterr().err
  assert "//a:empty_test" in err


_SEES_FLAGS = ("import os\n\ndef test_flags():\n"
               "  print('XLA_FLAGS=' + repr(os.environ.get('XLA_FLAGS')))\n  assert False\n")


def _flags_seen(tmp_path, **env):
  test_file = tmp_path / "x_test.py"
  test_file.write_text(_SEES_FLAGS)
  full = dict(os.environ, **env)
  full.pop("MOE_RL_TEST_FULL_OPT", None)
  full.update(env)
  r = subprocess.run([sys.executable, _RUNNER, str(test_file)], env=full, capture_output=True,
                     text=True, timeout=120, cwd=tmp_path, check=False)
  line = [l for l in r.stdout.splitlines() if l.startswith("XLA_FLAGS=")]
  assert line, r.stdout + r.stderr
  return line[0][len("XLA_FLAGS="):]


def test_tests_compile_at_backend_level_0_keeping_their_own_flags(tmp_path):
  seen = _flags_seen(tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  assert seen == repr("--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
  # A value the caller chose is kept, the other flag still added; MOE_RL_TEST_FULL_OPT=1 leaves
  # XLA_FLAGS alone.
  assert _flags_seen(tmp_path, XLA_FLAGS="--xla_backend_optimization_level=2") == repr(
      "--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=false")
  assert _flags_seen(tmp_path, XLA_FLAGS="--xla_cpu_use_fusion_emitters=true "
                     "--xla_backend_optimization_level=1") == repr(
      "--xla_cpu_use_fusion_emitters=true --xla_backend_optimization_level=1")
  assert _flags_seen(tmp_path, XLA_FLAGS="", MOE_RL_TEST_FULL_OPT="1") == repr("")
