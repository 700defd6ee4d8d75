"""A validation split carved from the train tasks, for choosing settings without the held-out set.

The held-out ("test") split may only be evaluated, never used to pick settings. Settings are
chosen instead on a validation subset of the train tasks that the run treats exactly as the
held-out tasks are treated in the real run: kept out of the pre-training corpus (neither prompt
nor solution appears in it), out of RL, and only evaluated. Which train tasks become validation
is decided by a hash of the task id (deterministic, independent of the task order), like the
suite's own held-out split but with a different salt, so the validation tasks are spread over the
families as the held-out ones are.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

VALIDATION = "validation"


def is_validation(task_id: str, fraction: float, salt: str = VALIDATION) -> bool:
  """Whether the task with this id falls into the validation share `fraction`."""
  h = hashlib.sha256(f"{salt}:{task_id}".encode()).digest()
  return int.from_bytes(h[:4], "big") < fraction * 2**32


# Train tasks RL trains on and pre-training never shows (ExperimentConfig.rl_tasks="held_back").
RL_ONLY = "rl_only"


def carve_validation(all_tasks: Sequence, fraction: float) -> tuple[list, list, list]:
  """Moves a `fraction` of the train tasks into a validation split.

  Args:
    all_tasks: every task of the suite (train and held-out).
    fraction: share of the train tasks to move, in (0, 1).

  Returns:
    (all tasks with the chosen ones relabelled split="validation", the remaining train tasks,
    the validation tasks). Held-out tasks are returned unchanged in the first list and appear in
    neither of the others.
  """
  return carve(all_tasks, fraction, VALIDATION)


def carve(all_tasks: Sequence, fraction: float, label: str) -> tuple[list, list, list]:
  """`carve_validation` for any label: moves the train tasks whose hash (salted with `label`,
  so two carves pick independently) falls in `fraction` into split `label`."""
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"{label} fraction must lie in (0, 1), got {fraction}")
  relabelled, train, val = [], [], []
  for t in all_tasks:
    if t.split == "train" and is_validation(t.task_id, fraction, salt=label):
      t = dataclasses.replace(t, split=label)
      val.append(t)
    elif t.split == "train":
      train.append(t)
    relabelled.append(t)
  if not val or not train:
    raise ValueError(f"{label} fraction {fraction} leaves {len(train)} train and {len(val)} "
                     f"{label} tasks; both must be non-empty")
  return relabelled, train, val
