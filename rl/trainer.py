"""The training loop: data iterator -> Learner.train_step -> checkpoints, with exact resumption.

The data iterator's state is saved in the same checkpoint as the train state (after the step
that consumed the batch), so restoring a checkpoint and continuing reproduces the uninterrupted
run: the same batches in the same order against the same parameters and optimizer state.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import numpy as np

from rl.checkpointing import CheckpointManager
from rl.learner import Learner

_log = logging.getLogger("rl.trainer")
ITERATOR_KEY = "iterator"
EXTRA_KEY = "extra"


def format_metrics(m: dict) -> str:
  parts = []
  for k in sorted(m):
    v = m[k]
    if np.ndim(v):
      parts.append(f"{k}={np.asarray(v).astype(int).tolist()}")
    else:
      parts.append(f"{k}={v:.5g}")
  return " ".join(parts)


class Trainer:
  """Runs a Learner over a checkpointable grain iterator.

  Args:
    learner: the Learner.
    dataset: a grain IterDataset (or anything whose iterator has get_state / set_state).
    checkpoints: where to save; None disables checkpointing.
    save_every: save after every this many steps (0: only when `save` is called).
    extra_metrics: optional callable returning more metrics per step (e.g. pipeline counters).
  """

  def __init__(self, learner: Learner, dataset: Iterable, *,
               checkpoints: Optional[CheckpointManager] = None, save_every: int = 0,
               extra_metrics: Optional[Callable[[], dict]] = None):
    self.learner = learner
    self.iterator = iter(dataset)
    self.checkpoints = checkpoints
    self.save_every = save_every
    self.extra_metrics = extra_metrics

  def restore(self, step: Optional[int] = None) -> bool:
    """Restores learner and iterator from `step` (default: the latest). False if there is no
    checkpoint to restore."""
    if self.checkpoints is None:
      return False
    if step is None and self.checkpoints.latest_step() is None:
      return False
    data = self.checkpoints.restore(self.learner, step)
    self.iterator.set_state(data[ITERATOR_KEY])
    _log.info("restored step %d", self.learner.step)
    return True

  def save(self, extra: Optional[dict] = None) -> None:
    if self.checkpoints is None:
      raise ValueError("this Trainer has no CheckpointManager")
    self.checkpoints.save(self.learner, {ITERATOR_KEY: self.iterator.get_state(),
                                         EXTRA_KEY: extra or {}}, force=True)

  def step(self) -> dict:
    """One step on the next batch; raises StopIteration when the data ends."""
    batch = next(self.iterator)
    metrics = self.learner.train_step(batch)
    if self.extra_metrics is not None:
      metrics.update(self.extra_metrics())
    if self.checkpoints is not None and self.save_every and (
        self.learner.step % self.save_every == 0):
      self.save()
    return metrics

  def run(self, num_steps: int, log_every: int = 1) -> list[dict]:
    """Up to `num_steps` steps (fewer if the data ends); returns their metrics."""
    out: list[dict[str, Any]] = []
    for _ in range(num_steps):
      try:
        m = self.step()
      except StopIteration:
        _log.info("data exhausted after step %d", self.learner.step)
        break
      out.append(m)
      if log_every and self.learner.step % log_every == 0:
        _log.info("step %d %s", self.learner.step, format_metrics(m))
    if self.checkpoints is not None:
      self.checkpoints.wait()
    return out
