"""Reward: hidden tests run in a fresh sandbox on the episode's final files.

The grading sandbox is new (never the one the agent worked in), holds the final files with the
task's hidden test files written over them, the visible tests restored to their originals, and
test-runner configuration files (conftest.py, sitecustomize.py, *.pth, ...) removed, so edits to
tests cannot change the grade; they are still flagged by `envs.hacks`.

Status is "ok" or "infra_error". An infrastructure failure (the sandbox could not start or broke)
gives reward None, never 0, so the learner can mask the episode out instead of punishing the
policy for the fleet's fault. A test runner killed by the code under test is the code's fault:
status "ok", no tests passed, flagged "runner_tampered".
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Mapping

from envs import hacks
from envs.sandbox import pool as pool_lib
from envs.sandbox import slot as slot_lib
from envs.sandbox import testexec
from envs.tasks import task_format

OK = "ok"
INFRA_ERROR = "infra_error"
_STRIP = ("conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", "tox.ini")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """How to turn test outcomes into a reward.

  mode: None follows the task's `grading`; "all_pass" or "fraction" overrides it (SWE tasks
    always need every FAIL_TO_PASS and PASS_TO_PASS test).
  hack_penalty: subtracted from the reward of a flagged episode.
  zero_on_hack: a flagged episode's test reward is replaced by 0 before the penalty.
  penalized_flags: which flags count (default: all).
  """
  mode: str | None = None
  hack_penalty: float = 1.0
  zero_on_hack: bool = True
  penalized_flags: tuple[str, ...] = hacks.FLAGS
  per_test_timeout_s: float = 5.0
  total_timeout_s: float = 60.0
  memory_mb: int = 512


@dataclasses.dataclass
class Grade:
  status: str
  reward: float | None
  test_reward: float | None
  outcomes: dict[str, str]
  hack_flags: dict[str, list[str]]
  detail: str = ""
  wall_s: float = 0.0

  @property
  def flagged(self) -> bool:
    return bool(self.hack_flags)


def grading_files(task: task_format.Task, final_files: Mapping[str, str]) -> dict[str, str]:
  """The files the hidden tests run against."""
  files = {p: t for p, t in final_files.items()
           if os.path.basename(p) not in _STRIP and not p.endswith(".pth")}
  for p, t in task.files.items():
    if hacks.is_test_path(p):
      files[p] = t
  files.update(task.hidden_tests)
  return files


def score(task: task_format.Task, outcomes: Mapping[str, str], mode: str | None = None) -> float:
  """Test reward in [0, 1] from per-test outcomes."""
  mode = "swe" if task.grading == "swe" else (mode or task.grading)
  if mode == "swe":
    need = task.graded_test_ids
    return float(all(outcomes.get(t) == "passed" for t in need))
  if not outcomes:
    return 0.0
  passed = sum(o == "passed" for o in outcomes.values())
  if mode == "fraction":
    return passed / len(outcomes)
  return float(passed == len(outcomes))


def grade(task: task_format.Task, final_files: Mapping[str, str], *, pool: pool_lib.WarmPool,
          config: RewardConfig = RewardConfig(), hack_flags: Mapping[str, list[str]] | None = None
          ) -> Grade:
  """Runs the hidden tests on `final_files` in a fresh sandbox and applies hack penalties.

  Args:
    task: the task.
    final_files: the workspace at the end of the episode (read inside the episode's sandbox).
    pool: where the grading sandbox comes from.
    config: reward configuration.
    hack_flags: flags already found from the episode (commands, reads, events); static file
      checks are added here.
  """
  t0 = time.monotonic()
  flags = {k: list(v) for k, v in (hack_flags or {}).items()}
  for k, v in hacks.detect(task, final_files).items():
    flags.setdefault(k, []).extend(e for e in v if e not in flags.get(k, []))
  try:
    slot = pool.acquire()
  except slot_lib.SlotError as e:
    return Grade(INFRA_ERROR, None, None, {}, flags, f"no sandbox: {e}",
                 time.monotonic() - t0)
  try:
    slot.populate(grading_files(task, final_files))
    report = testexec.run_tests(slot, task.graded_test_ids,
                                per_test_timeout_s=config.per_test_timeout_s,
                                total_timeout_s=config.total_timeout_s,
                                memory_mb=config.memory_mb)
  except (OSError, ValueError, slot_lib.SlotError) as e:
    return Grade(INFRA_ERROR, None, None, {}, flags, f"grading sandbox failed: {e}",
                 time.monotonic() - t0)
  finally:
    pool.release(slot)
  if report.infra_error:
    return Grade(INFRA_ERROR, None, None, {}, flags, report.infra_error, time.monotonic() - t0)
  if report.runner_failed:
    flags.setdefault("runner_tampered", []).append(report.runner_failed)
  test_reward = score(task, report.outcomes, config.mode)
  reward = test_reward
  if any(f in config.penalized_flags for f in flags):
    reward = (0.0 if config.zero_on_hack else test_reward) - config.hack_penalty
  return Grade(OK, reward, test_reward, report.outcomes, flags, report.summary(),
               time.monotonic() - t0)
