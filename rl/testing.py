"""Checks that a training run trained, for the end-to-end tests (test-only helpers).

An end-to-end run can finish cleanly, write every file and log every step while learning nothing:
if every sampling request is refused, every episode is an infrastructure failure, the learner's
batches hold no trained token and its steps still run: the policy version advances and, with
the router's auxiliary loss on, that loss alone still moves the weights. So a test that checks
files and step counts passes on such a run, and so does one that only checks the weights moved. These helpers check the run's own records instead: every step trained
episodes and tokens, its loss is finite and its gradient non-zero, the policy version advanced by one per
step, and the final weights differ from the initial ones.

Each function raises AssertionError naming every problem it found (not only the first), so a
failing end-to-end test says what was wrong with the run in one go.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np


def step_problems(records: Sequence[Mapping], *, steps: int, start_version: int = 0,
                  episodes_per_step: Optional[int] = None, episodic: bool = True) -> list[str]:
  """What is wrong with a run's per-step learner records (empty if nothing).

  Args:
    records: one mapping per learner step, in step order, with the learner's metrics `loss`,
      `grad_norm`, `tokens` (trained tokens) and `policy_version`, and for episodic (RL) runs
      `trained_episodes` (episodes packed into the step's batch).
    steps: the number of learner steps the run was asked for.
    start_version: the policy version before the first step.
    episodes_per_step: the exact number of episodes each step must have trained (None: any
      positive number; the count is checked only to be > 0).
    episodic: False for runs without episodes (pre-training, synthetic batches).
  """
  problems = []
  if len(records) != steps:
    problems.append(f"{len(records)} learner steps recorded, {steps} expected")
  for i, r in enumerate(records):
    where = f"step {i + 1}"
    loss = float(r.get("loss", math.nan))
    if not math.isfinite(loss):
      problems.append(f"{where}: loss {loss} (must be finite)")
    # The gradient, not the loss value, shows the step had something to learn from: an
    # on-policy GRPO loss is ~0 by construction (advantages sum to 0 per group, ratio 1), while a
    # batch with no signal (no trained token, every advantage 0) has a gradient of exactly 0.
    grad_norm = float(r.get("grad_norm", math.nan))
    if not (math.isfinite(grad_norm) and grad_norm > 0):
      problems.append(f"{where}: grad_norm {r.get('grad_norm')} (must be finite and > 0)")
    if not float(r.get("tokens", 0)) > 0:
      problems.append(f"{where}: {r.get('tokens')} trained tokens")
    if episodic:
      n = r.get("trained_episodes", 0)
      if not n > 0:
        problems.append(f"{where}: {n} trained_episodes")
      elif episodes_per_step is not None and n != episodes_per_step:
        problems.append(f"{where}: {n} trained_episodes, {episodes_per_step} expected")
    version = r.get("policy_version")
    if version is None or int(version) != start_version + i + 1:
      problems.append(f"{where}: policy_version {version}, {start_version + i + 1} expected")
  return problems


def assert_steps_trained(records: Sequence[Mapping], **kw) -> None:
  """Raises AssertionError unless `records` show a run that trained (see `step_problems`)."""
  problems = step_problems(records, **kw)
  if problems:
    raise AssertionError("the run did not train:\n  " + "\n  ".join(problems))


def weight_problems(initial: Mapping[str, np.ndarray],
                    final: Mapping[str, np.ndarray]) -> list[str]:
  """What is wrong with a run's final weights against its initial ones (empty if nothing).

  Both are flat {name: array} dicts (moe.params.flatten names). The final weights must have the
  same names and shapes, be finite, and differ from the initial ones in at least one array.
  """
  problems = []
  if set(initial) != set(final):
    problems.append(f"names differ: {sorted(set(initial) ^ set(final))[:5]}")
  changed = []
  for name in sorted(set(initial) & set(final)):
    a, b = np.asarray(initial[name]), np.asarray(final[name])
    if a.shape != b.shape:
      problems.append(f"{name}: shape {a.shape} -> {b.shape}")
      continue
    if not np.isfinite(b).all():
      problems.append(f"{name}: non-finite values after training")
    if not np.array_equal(a, b):
      changed.append(name)
  if not changed:
    problems.append(f"none of the {len(initial)} weight arrays changed")
  return problems


def assert_weights_changed(initial: Mapping[str, np.ndarray],
                           final: Mapping[str, np.ndarray]) -> None:
  """Raises AssertionError unless training changed the weights (see `weight_problems`)."""
  problems = weight_problems(initial, final)
  if problems:
    raise AssertionError("the weights show no training:\n  " + "\n  ".join(problems))
