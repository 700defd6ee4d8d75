"""The learner's loop in the pipeline: read a step's batch, train, publish weights, checkpoint.

Versions: the weights published after the learner's update number v are version v (the initial
weights are version 0), the same number the samplers record per token, the learner's staleness
bound compares against and the controller's bound (pipeline.controller) starts groups by. The
invariant is version == step, always, restarts included: the controller sends step s's groups
when the samplers serve version >= s - k, so a learner whose version ran ahead of its step would
find a whole step's data staler than k and drop it.

Order per step: train -> publish -> checkpoint (when due; saved in the background). A published
version can therefore be ahead of the newest committed checkpoint (a kill after a publish, before
its checkpoint commits). Restoring then rolls forward: the learner restores the checkpoint at
step c < p (the newest published version) and retrains steps c+1..p from the same records (the
reader's position is checkpointed with the train state, the records never change) without
publishing them again, because versions c+1..p are already out; from step p on it publishes as
usual. The replayed updates see the same batches at the same versions, so the same episodes are
trained and dropped as before the crash. (We considered adopting p as the version at step c: that
breaks version == step and, with it, the controller's staleness arithmetic; and waiting for every
checkpoint to commit before publishing would serialise checkpoint writes into every step.)

Publishing is measured per version: each step's metrics (what `on_step` gets) carry
`publish_metrics` of the version it published (the bytes a sampler fetches, the sampler-dtype
weights' raw bytes and their ratio), and the loop sums them over the run (`publish_totals`).

A step whose batch has no trainable token (everything stale, rejected, lost or an
infrastructure failure) is an error (`EmptyStepError`), not an update: the optimizer would still
move the weights on its momentum and the run would go on training on nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from pipeline import faults
from pipeline.step_batches import StepBatcher

log = logging.getLogger(__name__)

AFTER_PUBLISH = "learner.after_publish"


def publish_metrics(report) -> dict:
  """A published version's figures for the step's metrics, from the sync.publisher.PublishReport
  the publish callable returned ({} if it returned None).

  publish_bytes: bytes a following sampler fetches for the version (its delta; its snapshot
  when it has no delta: publish_delta 0); publish_raw_bytes: the published weights' bytes in
  the sampler's dtype; publish_ratio: their quotient; publish_snapshot: 1 if a full snapshot was
  written too (publish_snapshot_bytes); publish_s: the publish call's wall time.

  A sharded publish (pipeline.sharded_weights.ShardedWeightChannel) reports this process's
  blocks only; one whose blocks were stored whole (version 0) has no fetched byte count, so
  publish_bytes and publish_ratio are left out rather than guessed.
  """
  if report is None:
    return {}
  snapshot_bytes = getattr(report, "snapshot_bytes", None)
  fetched = report.delta_bytes if report.delta_bytes is not None else snapshot_bytes
  out = {"publish_raw_bytes": int(report.raw_bytes),
         "publish_delta": int(report.delta_bytes is not None),
         "publish_snapshot": int(bool(report.snapshot)), "publish_s": float(report.total_s)}
  if fetched is not None:  # a sharded process's share stored whole does not know its bytes
    out.update(publish_bytes=int(fetched), publish_ratio=report.raw_bytes / max(1, fetched))
  if report.snapshot and snapshot_bytes is not None:
    out["publish_snapshot_bytes"] = int(snapshot_bytes)
  return out


class EmptyStepError(RuntimeError):
  """A learner step's batch has no trainable token."""


class VersionMismatch(RuntimeError):
  """The learner's version, step, published version or checkpoint disagree."""


class LearnerLoop:
  """Drives an `rl.learner.Learner` from a `StepBatcher`.

  Args:
    learner: rl.learner.Learner (objective "policy").
    batcher: StepBatcher over the trajectory directory.
    publish: publish(weights, version) -> report; makes the new weights visible to samplers
      (e.g. a sync.publisher.Publisher wrapper).
    weights_of: weights_of(learner) -> (weights, version), what `publish` takes (default: the
      whole flat weights, `learner.sampler_weights()`; a sharded channel takes each process's
      blocks, `learner.sampler_shards()`, so that no process gathers the model).
    published_version: callable returning the newest published version (None if none).
    hold: optional hold(flat_weights): called once the learner's weights are those of the newest
      published version (at start, or when a replay reaches it) so that a publisher which could
      not rebuild them from the store after a restart can use them (WeightChannel.hold).
    checkpoints: optional rl.checkpointing.CheckpointManager.
    checkpoint_every: save every this many steps (0: never).
    on_step: optional callback(step, metrics, info) after each step.
  """

  def __init__(self, learner, batcher: StepBatcher, *, publish: Callable,
               published_version: Callable[[], Optional[int]],
               weights_of: Optional[Callable] = None,
               hold: Optional[Callable[[dict], None]] = None, checkpoints=None,
               checkpoint_every: int = 0, on_step: Optional[Callable] = None):
    self.learner = learner
    self.batcher = batcher
    self.publish = publish
    self.weights_of = weights_of or (lambda learner: learner.sampler_weights())
    self.published_version = published_version
    self.hold = hold
    self.checkpoints = checkpoints
    self.checkpoint_every = checkpoint_every
    self.on_step = on_step
    self.wait_s = 0.0
    self.train_s = 0.0
    self.publish_s = 0.0
    self.published = []  # publish_metrics of every version this loop published, in order

  def restore(self) -> bool:
    """Restores the latest checkpoint if there is one; returns whether it did.

    The published version may be ahead of the restored step (see the module docstring): `run`
    then replays the steps in between before it publishes again.
    """
    if self.checkpoints is None or self.checkpoints.latest_step() is None:
      return False
    data = self.checkpoints.restore(self.learner)
    self.batcher.set_state(data["batcher"])
    step, version = self.learner.step, self.learner.policy_version
    if version != step:
      raise VersionMismatch(
          f"checkpoint {self.checkpoints.latest_step()} holds policy version {version} at step "
          f"{step}; the pipeline needs version == step (a checkpoint from an older learner that "
          "adopted the published version on restart)")
    log.info("learner restored at step %d (published version %s)", step, self.published_version())
    return True

  def _hold(self) -> None:
    if self.hold is not None:
      self.hold(self.learner.sampler_weights()[0])

  def publish_current(self) -> dict:
    """Publishes the current weights as the next version (the initial weights at start);
    returns its `publish_metrics`."""
    t0 = time.perf_counter()
    weights, version = self.weights_of(self.learner)
    report = self.publish(weights, version)
    self.publish_s += time.perf_counter() - t0
    out = publish_metrics(report)
    if out:
      self.published.append(out)
    return out

  def publish_totals(self) -> dict:
    """The versions this loop published and their bytes: fetched (publish_bytes), raw in the
    sampler's dtype (publish_raw_bytes) and the ratio of the sums, over the versions published
    as deltas (`delta_versions`; a snapshot-only version, such as version 0, is left out of
    the ratio: it is the whole model)."""
    deltas = [m for m in self.published if m["publish_delta"]]
    raw = sum(m["publish_raw_bytes"] for m in deltas)
    fetched = sum(m["publish_bytes"] for m in deltas)
    return {"published_versions": len(self.published), "delta_versions": len(deltas),
            "publish_bytes": fetched, "publish_raw_bytes": raw,
            "publish_ratio": raw / fetched if fetched else None,
            "publish_s": self.publish_s}

  def run(self, num_steps: int, stop: Optional[threading.Event] = None) -> None:
    """Trains until the learner has taken `num_steps` steps (or `stop` is set).

    Raises:
      VersionMismatch: the published version is behind the learner's step (the weight store
        was reset under a checkpoint), or an update left version != step.
      EmptyStepError: a step's batch has no trainable token.
    """
    stop = stop or threading.Event()
    published = self.published_version()
    if published is None and self.learner.step == 0:
      self.publish_current()
      published = 0
    if published is None or published < self.learner.step:
      raise VersionMismatch(
          f"the learner is at step {self.learner.step} but the newest published version is "
          f"{published}: every step's weights are published before its checkpoint is saved, so "
          "the weight store does not belong to this checkpoint directory")
    if published == self.learner.step:
      self._hold()
    if published > self.learner.step:
      log.warning("learner restored at step %d behind the published version %d: replaying "
                  "steps %d..%d from the same records without publishing them again",
                  self.learner.step, published, self.learner.step + 1, published)
    while self.learner.step < num_steps and not stop.is_set():
      t0 = time.perf_counter()
      got = self.batcher.next_batch(self.learner.policy_version, stop)
      if got is None:
        return
      batch, info = got
      trainable = int(batch["loss_mask"].sum())
      if trainable == 0:
        raise EmptyStepError(
            f"learner step {self.learner.step + 1} has no trainable token: its "
            f"{info['episodes']} records held {info['stale_episodes']} stale, "
            f"{info['rejected_episodes']} rejected, {info['infra_failures']} infrastructure-"
            f"failed and {info['lost_episodes']} lost episodes (learner version "
            f"{self.learner.policy_version}, max_staleness {self.batcher.cfg.max_staleness})")
      t1 = time.perf_counter()
      self.wait_s += t1 - t0
      metrics = self.learner.train_step(batch)
      self.train_s += time.perf_counter() - t1
      step, version = self.learner.step, self.learner.policy_version
      if version != step:
        raise VersionMismatch(f"after step {step} the learner's policy version is {version}")
      replayed = step <= published
      if step == published:
        self._hold()
      if not replayed:
        metrics = dict(metrics, **self.publish_current())
        published = step
        faults.point(AFTER_PUBLISH)
      if self.checkpoints is not None and self.checkpoint_every and \
          step % self.checkpoint_every == 0:
        self.checkpoints.save(self.learner, {"batcher": self.batcher.get_state()})
      if self.on_step is not None:
        self.on_step(step, metrics, dict(info, wait_s=t1 - t0, replayed=replayed))
