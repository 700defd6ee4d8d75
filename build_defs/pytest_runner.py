"""The `main` of every `pytest_test`: runs one test file through pytest itself.

Bazel runs a py_test's `main` as a script. If that were the test file, a file without a
`__main__` block would only define its tests and exit 0, and Bazel would report PASSED for a
target that ran nothing. Running every file through this one runner means the file's own
`__main__` block does not matter, and a file that collects no test fails (pytest exits 5).

pytest writes a JUnit report to `$XML_OUTPUT_FILE` (Bazel's per-target test.xml), which is what
`.ci/run` sums to print how many test cases the suite ran.

Usage (what the macro passes): pytest_runner.py <test file, runfiles-relative> [pytest args...]
"""

import os
import sys

import pytest


def main(argv):
  if len(argv) < 2:
    print("pytest_runner: usage: pytest_runner.py TEST_FILE [PYTEST_ARGS...]", file=sys.stderr)
    return 2
  test_file, extra = argv[1], argv[2:]
  if not os.path.isfile(test_file):
    print(f"pytest_runner: no such test file: {test_file!r} (cwd {os.getcwd()})", file=sys.stderr)
    return 2
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
