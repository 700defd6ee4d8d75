"""The learner's loop in the pipeline: read a step's batch, train, checkpoint, publish weights.

Versions: the weights published after the learner's update number v are version v (the initial
weights are version 0), the same number the samplers record per token and the learner's
staleness bound compares against. On a restart from a checkpoint older than the newest published
version p, the learner adopts p as its policy version, so versions stay monotonic for the samplers
and the staleness arithmetic stays consistent (the few steps between the checkpoint and the crash
are retrained from the same data: the reader's position is checkpointed with the train state).

Order per step: train -> checkpoint (when due) -> publish. A published version is therefore
never ahead of what a restart can reach by more than the checkpoint interval.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import jax.numpy as jnp

from pipeline.step_batches import StepBatcher

log = logging.getLogger(__name__)


class LearnerLoop:
  """Drives an `rl.learner.Learner` from a `StepBatcher`.

  Args:
    learner: rl.learner.Learner (objective "policy").
    batcher: StepBatcher over the trajectory directory.
    publish: publish(flat_weights, version) -> report; makes the new weights visible to samplers
      (e.g. a sync.publisher.Publisher wrapper).
    published_version: callable returning the newest published version (None if none).
    checkpoints: optional rl.checkpointing.CheckpointManager.
    checkpoint_every: save every this many steps (0: never).
    on_step: optional callback(step, metrics, info) after each step.
  """

  def __init__(self, learner, batcher: StepBatcher, *, publish: Callable,
               published_version: Callable[[], Optional[int]], checkpoints=None,
               checkpoint_every: int = 0, on_step: Optional[Callable] = None):
    self.learner = learner
    self.batcher = batcher
    self.publish = publish
    self.published_version = published_version
    self.checkpoints = checkpoints
    self.checkpoint_every = checkpoint_every
    self.on_step = on_step
    self.wait_s = 0.0
    self.train_s = 0.0
    self.publish_s = 0.0

  def restore(self) -> bool:
    """Restores the latest checkpoint if there is one; returns whether it did."""
    if self.checkpoints is None or self.checkpoints.latest_step() is None:
      return False
    data = self.checkpoints.restore(self.learner)
    self.batcher.set_state(data["batcher"])
    latest = self.published_version()
    if latest is not None and latest > self.learner.policy_version:
      self.learner.state = self.learner.state.replace(
          policy_version=jnp.asarray(latest, jnp.int32))
    log.info("learner restored at step %d (policy version %d)", self.learner.step,
             self.learner.policy_version)
    return True

  def publish_current(self) -> None:
    """Publishes the current weights as the next version (the initial weights at start)."""
    t0 = time.perf_counter()
    flat, version = self.learner.sampler_weights()
    self.publish(flat, version)
    self.publish_s += time.perf_counter() - t0

  def run(self, num_steps: int, stop: Optional[threading.Event] = None) -> None:
    """Trains until the learner has taken `num_steps` steps (or `stop` is set)."""
    stop = stop or threading.Event()
    if self.published_version() is None:
      self.publish_current()
    while self.learner.step < num_steps and not stop.is_set():
      t0 = time.perf_counter()
      got = self.batcher.next_batch(self.learner.policy_version, stop)
      if got is None:
        return
      batch, info = got
      t1 = time.perf_counter()
      self.wait_s += t1 - t0
      metrics = self.learner.train_step(batch)
      self.train_s += time.perf_counter() - t1
      step = self.learner.step
      if self.checkpoints is not None and self.checkpoint_every and \
          step % self.checkpoint_every == 0:
        self.checkpoints.save(self.learner, {"batcher": self.batcher.get_state()})
      self.publish_current()
      if self.on_step is not None:
        self.on_step(step, metrics, dict(info, wait_s=t1 - t0))
