"""Runs test ids in a sandbox with `envs.sandbox.testrunner` and parses its report.

Three outcomes are kept apart, because the reward treats them differently:
  * the sandbox broke (`infra_error`): infrastructure, never scored;
  * the sandbox worked but the runner did not report (`runner_failed`): the code under test
    killed or starved it, which is the episode's fault (scored, and flagged);
  * a report: per-test outcomes "passed", "failed", "error" (collection), "timeout".
"""

from __future__ import annotations

import dataclasses
import json
import os

from envs.sandbox import slot as slot_lib


@dataclasses.dataclass
class TestReport:
  outcomes: dict[str, str]
  messages: dict[str, str]
  infra_error: str | None = None
  runner_failed: str | None = None
  result: slot_lib.Result | None = None

  def passed(self, test_id: str) -> bool:
    return self.outcomes.get(test_id) == "passed"

  @property
  def num_passed(self) -> int:
    return sum(o == "passed" for o in self.outcomes.values())

  def summary(self, max_message: int = 400) -> str:
    """A compact, human (and model) readable report."""
    if self.infra_error:
      return f"test run failed (infrastructure): {self.infra_error}"
    if self.runner_failed:
      return f"test run failed: {self.runner_failed}"
    lines = [f"{self.num_passed}/{len(self.outcomes)} passed"]
    for tid, outcome in self.outcomes.items():
      lines.append(f"{outcome.upper()} {tid}")
      if outcome != "passed" and self.messages.get(tid):
        lines.append("  " + self.messages[tid].strip()[-max_message:].replace("\n", "\n  "))
    return "\n".join(lines)


def run_tests(slot: slot_lib.Slot, test_ids: list[str] | tuple[str, ...], *,
              per_test_timeout_s: float = 5.0, total_timeout_s: float = 60.0,
              memory_mb: int = 512) -> TestReport:
  """Runs `test_ids` (paths or path::name) in the slot's workspace."""
  nonce = os.urandom(12).hex()
  argv = ["python3", slot.runner_path, "--nonce", nonce, "--timeout",
          str(per_test_timeout_s)] + list(test_ids)
  r = slot.exec(argv, timeout_s=total_timeout_s, memory_mb=memory_mb,
                cpu_s=total_timeout_s + 1, max_output_bytes=1 << 20)
  if r.infra_error:
    return TestReport({}, {}, infra_error=r.infra_error, result=r)
  for line in r.stdout.splitlines():
    if line.startswith(nonce + " "):
      try:
        tests = json.loads(line[len(nonce) + 1:])["tests"]
      except (ValueError, KeyError) as e:
        return TestReport({}, {}, runner_failed=f"unreadable report: {e}", result=r)
      return TestReport({k: v["outcome"] for k, v in tests.items()},
                        {k: v["message"] for k, v in tests.items()}, result=r)
  why = "timed out" if r.timed_out else f"exited {r.exit_code}"
  return TestReport({}, {}, runner_failed=f"test runner {why} without a report: "
                    f"{r.stderr[-300:]}", result=r)
