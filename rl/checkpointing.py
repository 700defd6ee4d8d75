"""Training checkpoints: orbax CheckpointManager over the learner state and the data iterators.

Every step directory `<dir>/<step>/` holds
  params/        all model variables by flat name (moe.checkpoint layout: servable as is)
  model_config/  the ModelConfig JSON (moe.checkpoint layout)
  train/         optimizer state, step, policy version
  reference/     the KL reference policy's parameters (only when the learner has one)
  data/          JSON: the pipelines' iterator states and anything else the caller adds
so `moe.checkpoint.load_model(manager.step_dir(step))` is the params-only restore for serving.

Saves are asynchronous (orbax copies device arrays to the host before `save` returns, so the
learner may donate its state to the next step at once); `wait()` blocks until the last save is
committed. Retention: the last `max_to_keep` checkpoints plus every step divisible by
`keep_every`. Restoring builds the targets from the learner's own mesh, so a checkpoint written on
one mesh shape restores onto another.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp
from flax import nnx

from moe import checkpoint as moe_ckpt
from moe import params as params_lib
from moe.model import MoEDecoder
from rl import train_state as ts

TRAIN_ITEM = "train"
REFERENCE_ITEM = "reference"
DATA_ITEM = "data"


def _flat_vars(*states: nnx.State) -> dict:
  out = {}
  for state in states:
    for path, var in nnx.to_flat_state(state):
      out[params_lib._name(path)] = var.get_value()
  return out


def _targets(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


class CheckpointManager:
  """Saves and restores a `rl.learner.Learner` together with data-iterator states.

  Args:
    directory: root directory of the step directories.
    max_to_keep: keep the newest this many checkpoints.
    keep_every: additionally keep every step divisible by this (None: no such policy).
    save_interval_steps: `save` skips steps not divisible by this unless forced.
    async_save: write in a background thread.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, keep_every: Optional[int] = None,
               save_interval_steps: int = 1, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, keep_period=keep_every,
        save_interval_steps=save_interval_steps, enable_async_checkpointing=async_save,
        create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def save(self, learner, data_state: Optional[Mapping[str, Any]] = None,
           force: bool = False) -> bool:
    """Checkpoints `learner` at its current step; returns whether a save was started."""
    state = learner.state
    step = learner.step
    items = moe_ckpt.save_args(_flat_vars(state.params, state.rest), learner.model_cfg)
    items[TRAIN_ITEM] = ocp.args.StandardSave(
        {"opt_state": state.opt_state, "step": state.step,
         "policy_version": state.policy_version})
    if learner.ref_params is not None:
      items[REFERENCE_ITEM] = ocp.args.StandardSave(moe_ckpt.nest(_flat_vars(learner.ref_params)))
    items[DATA_ITEM] = ocp.args.JsonSave(dict(data_state or {}))
    return self._mgr.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, learner, step: Optional[int] = None) -> dict:
    """Restores `learner`'s state (onto its own mesh) from `step` (default: the latest).

    Returns the saved data state (iterator states etc.).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    saved_cfg = moe_ckpt.load_config(self.step_dir(step))
    if saved_cfg != learner.model_cfg:
      raise ValueError(f"checkpoint model config {saved_cfg} differs from the learner's "
                       f"{learner.model_cfg}")
    abstract = ts.abstract_state(learner.model_cfg, learner.tx)
    targets = _targets(abstract, learner.shardings)
    flat_targets = _flat_vars(targets.params, targets.rest)
    items = {
        moe_ckpt.PARAMS_ITEM: ocp.args.StandardRestore(moe_ckpt.nest(flat_targets)),
        TRAIN_ITEM: ocp.args.StandardRestore(
            {"opt_state": targets.opt_state, "step": targets.step,
             "policy_version": targets.policy_version}),
        DATA_ITEM: ocp.args.JsonRestore(),
    }
    if learner.ref_params is not None:
      items[REFERENCE_ITEM] = ocp.args.StandardRestore(
          moe_ckpt.nest(_flat_vars(targets.params)))
    restored = self._mgr.restore(step, args=ocp.args.Composite(**items))
    flat = moe_ckpt.unnest(restored[moe_ckpt.PARAMS_ITEM])
    train = restored[TRAIN_ITEM]
    learner.state = ts.TrainState(
        params=moe_ckpt.state_from_flat(targets.params, flat),
        rest=moe_ckpt.state_from_flat(targets.rest, flat),
        opt_state=train["opt_state"], step=train["step"],
        policy_version=train["policy_version"])
    if learner.ref_params is not None:
      learner.ref_params = moe_ckpt.state_from_flat(
          targets.params, moe_ckpt.unnest(restored[REFERENCE_ITEM]))
    return dict(restored[DATA_ITEM] or {})

  def restore_params(self, step: Optional[int] = None, mesh=None) -> MoEDecoder:
    """Params-only restore for serving (moe.checkpoint.load_model on the step directory)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    self.wait()
    return moe_ckpt.load_model(self.step_dir(step), mesh=mesh)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> Optional[int]:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.close()
