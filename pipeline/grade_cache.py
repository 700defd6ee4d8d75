"""Memoised grading: an attempt whose files were already graded for the same task reuses the grade.

Why: a sharp policy repeats itself. On the built-in tasks about half of a group's attempts are
byte-identical to another attempt of the same prompt (more as RL sharpens the policy), and each
grade starts a fresh sandbox, the largest CPU cost of an RL step on a small machine. Grading is
a pure function of (task, files) when the hidden tests are deterministic, as the built-in suites'
are (fixed inputs, no clock or randomness), so a repeated attempt gets the very grade a sandbox
would give it. Only successful grades are kept: an infrastructure failure is retried by grading
again, never replayed. Do not use it with tests that are not deterministic.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Mapping

from envs import reward as reward_lib


class GradeCache:
  """Wraps a grade function (task, files, pool, config) -> envs Grade with an LRU memo.

  Args:
    grade_fn: the grading function to memoise.
    max_entries: most grades kept (least recently used ones are forgotten first).
  """

  def __init__(self, grade_fn: Callable, max_entries: int = 65536):
    if max_entries < 1:
      raise ValueError("max_entries must be >= 1")
    self.grade_fn = grade_fn
    self.max_entries = max_entries
    self.hits = 0
    self.misses = 0
    self._lock = threading.Lock()
    self._grades: collections.OrderedDict = collections.OrderedDict()

  @staticmethod
  def key(task, files: Mapping[str, str], config, hack_flags=None) -> tuple:
    flags = tuple(sorted((f, tuple(e)) for f, e in (hack_flags or {}).items()))
    return (task.task_id, tuple(sorted(files.items())), repr(config), flags)

  def __call__(self, task, files: Mapping[str, str], pool, config, hack_flags=None):
    """The grade of `files`; `hack_flags` (found by the agent loop from the episode's commands
    and reads) are part of the key and passed on only when there are some."""
    k = self.key(task, files, config, hack_flags)
    with self._lock:
      if k in self._grades:
        self._grades.move_to_end(k)
        self.hits += 1
        return self._grades[k]
      self.misses += 1
    grade = (self.grade_fn(task, files, pool, config, hack_flags=hack_flags) if hack_flags
             else self.grade_fn(task, files, pool, config))
    if grade.status == reward_lib.OK:
      with self._lock:
        self._grades[k] = grade
        while len(self._grades) > self.max_entries:
          self._grades.popitem(last=False)
    return grade
