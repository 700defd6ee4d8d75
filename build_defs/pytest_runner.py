"""The `main` of every `pytest_test`: runs one test file through pytest itself.

Bazel runs a py_test's `main` as a script. If that were the test file, a file without a
`__main__` block would only define its tests and exit 0, and Bazel would report PASSED for a
target that ran nothing. Running every file through this one runner means the file's own
`__main__` block does not matter, and a file that collects no test fails (pytest exits 5).

pytest writes a JUnit report to `$XML_OUTPUT_FILE` (Bazel's per-target test.xml), which is what
`.ci/run` sums to print how many test cases the suite ran.

Tests compile with XLA's backend (LLVM) optimisation level 0 and with XLA:CPU's older elemental
emitters instead of its fusion emitters (`TEST_XLA_FLAGS`, each appended to `XLA_FLAGS` unless
the caller set that flag; the test's own processes inherit them): the suite's programs are
tiny and most of its CPU time went to compiling them, which both flags cut, while the compiled
programs run somewhat slower; XLA's HLO passes (fusion decisions, sharding, collectives, buffer
assignment: what the tests assert on) are untouched, and every program a test compares
against another is compiled under the same flags. `bazel test
--test_env=MOE_RL_TEST_FULL_OPT=1 ...` runs tests as the entry points compile.
"""

import os
import sys

import pytest

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_environment(environ) -> dict:
  """The variables the runner sets before pytest imports the test (and JAX reads XLA_FLAGS)."""
  if environ.get("MOE_RL_TEST_FULL_OPT") == "1":
    return {}
  flags = environ.get("XLA_FLAGS", "")
  missing = [f for f in TEST_XLA_FLAGS if f.split("=")[0] + "=" not in flags]
  if not missing:
    return {}
  return {"XLA_FLAGS": " ".join([flags, *missing]).strip()}


def main(argv):
  if len(argv) < 2:
    print("pytest_runner: usage: pytest_runner.py TEST_FILE [PYTEST_ARGS...]", file=sys.stderr)
    return 2
  test_file, extra = argv[1], argv[2:]
  if not os.path.isfile(test_file):
    print(f"pytest_runner: no such test file: {test_file!r} (cwd {os.getcwd()})", file=sys.stderr)
    return 2
  os.environ.update(xla_environment(os.environ))
  args = [test_file, "-q", "-rfEs", "-p", "no:cacheprovider"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append(f"--junitxml={xml}")
  # Bazel's sharding/filter protocol: honour --test_filter through pytest's -k.
  test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
  if test_filter:
    args += ["-k", test_filter]
  code = pytest.main(args + extra)
  if code == pytest.ExitCode.NO_TESTS_COLLECTED:
    print(f"pytest_runner: {test_file} collected no test; a test target must run at least one",
          file=sys.stderr)
  return int(code)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
