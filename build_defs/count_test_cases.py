"""Sums the test cases that pytest ran in each Bazel test target, from the targets' JUnit reports.

Every `pytest_test` writes pytest's JUnit XML to Bazel's per-target `test.xml`
(build_defs/pytest_runner.py). Given Bazel's test summary (the log of `bazel test`), this reads
the report of each target the summary names (all runs of it, with --runs_per_test) and prints one
line: `test cases: P passed, F failed, S skipped (T targets, R reports)`. It exits 1 when a
summarized target has no report or a report counts zero test cases, so a target that ran
nothing cannot hide among the passing ones.

Usage: count_test_cases.py BAZEL_TEST_LOG TESTLOGS_DIR
"""

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

_SUMMARY = re.compile(r"^//([^ :]*):(\S+) +(?:\(cached\) )?(PASSED|FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE)")


def targets(log_text):
  """(package, name) of every target in Bazel's test summary, in order, without repeats."""
  seen = []
  for line in log_text.splitlines():
    m = _SUMMARY.match(line)
    if m and (m.group(1), m.group(2)) not in seen:
      seen.append((m.group(1), m.group(2)))
  return seen


def report_counts(path):
  """(tests, failures + errors, skipped) summed over the <testsuite> elements of one report."""
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
  tests = failed = skipped = 0
  for s in suites:
    tests += int(s.get("tests", 0))
    failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
    skipped += int(s.get("skipped", 0))
  return tests, failed, skipped


def main(argv):
  if len(argv) != 3:
    print(__doc__.strip().splitlines()[-1], file=sys.stderr)
    return 2
  with open(argv[1], encoding="utf-8", errors="replace") as f:
    found = targets(f.read())
  total = failed = skipped = reports = 0
  problems = []
  for pkg, name in found:
    base = os.path.join(argv[2], pkg, name)
    paths = sorted(glob.glob(os.path.join(base, "test.xml"))
                   + glob.glob(os.path.join(base, "run_*_of_*", "test.xml"))
                   + glob.glob(os.path.join(base, "shard_*_of_*", "test.xml")))
    if not paths:
      problems.append(f"//{pkg}:{name}: no test report under {base}")
      continue
    for p in paths:
      try:
        t, f_, s = report_counts(p)
      except (ET.ParseError, OSError, ValueError) as e:
        problems.append(f"//{pkg}:{name}: unreadable report {p}: {e}")
        continue
      reports += 1
      if t == 0:
        problems.append(f"//{pkg}:{name}: report {p} counts no test case")
      total, failed, skipped = total + t, failed + f_, skipped + s
  for p in problems:
    print(f"count_test_cases: {p}", file=sys.stderr)
  passed = total - failed - skipped
  print(f"test cases: {passed} passed, {failed} failed, {skipped} skipped "
        f"({len(found)} targets, {reports} reports)")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
