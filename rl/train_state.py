"""The learner's train state and optimizer, created directly sharded on a mesh.

A `TrainState` holds the float32 master parameters (nnx.Param variables), the model's other
variables (router selection biases, updated by rule, not by the optimizer), the optax state, the
step and the policy version (the number of optimizer updates whose weights samplers may hold;
trajectories carry it per token to measure staleness).

Creation follows the guard-rail recipe: `jax.eval_shape(init)` gives the abstract state, the
logical-axis table (moe.sharding) gives every leaf's sharding (optimizer moments inherit their
parameter's logical axes), and `jax.jit(init, out_shardings=...)` materialises each array on its
devices. Mixed precision: parameters and optimizer state stay float32 (`param_dtype`); the model
computes in `ModelConfig.dtype` (e.g. bfloat16).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from moe import build
from moe import sharding
from moe.config import ModelConfig
from moe.model import MoEDecoder

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with warmup + decay schedule and global-norm clipping.

  Attributes:
    learning_rate: peak learning rate.
    schedule: "constant", "cosine" or "linear" decay after warmup.
    warmup_steps: linear warmup from 0.
    decay_steps: total steps of the decay (cosine / linear); ignored for constant.
    end_lr_factor: final learning rate as a fraction of the peak.
    b1, b2, eps: Adam moments.
    weight_decay: decoupled weight decay (applied to every parameter).
    clip_norm: global gradient-norm clip (None disables it).
  """

  learning_rate: float = 1e-4
  schedule: str = "constant"
  warmup_steps: int = 0
  decay_steps: int = 1000
  end_lr_factor: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_norm: Optional[float] = 1.0

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.learning_rate < 0 or self.warmup_steps < 0:
      raise ValueError("learning_rate and warmup_steps must be >= 0")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """The learning-rate schedule as a function of the optimizer step."""
  peak = cfg.learning_rate
  if cfg.schedule == "constant":
    decay = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, max(cfg.decay_steps, 1), alpha=cfg.end_lr_factor)
  else:
    decay = optax.linear_schedule(peak, peak * cfg.end_lr_factor, max(cfg.decay_steps, 1))
  if cfg.warmup_steps == 0:
    return decay
  warm = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warm, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  parts = []
  if cfg.clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


@flax.struct.dataclass
class TrainState:
  params: Any  # nnx.State of nnx.Param (float32 master weights)
  rest: Any  # nnx.State of the other variables (router biases)
  opt_state: Any
  step: jax.Array  # int32 scalar: optimizer updates applied
  policy_version: jax.Array  # int32 scalar

  def model(self, graphdef: nnx.GraphDef) -> MoEDecoder:
    return nnx.merge(graphdef, self.params, self.rest)


def split_model(model: nnx.Module):
  """(graphdef, params, rest): the learner's standard split of a model."""
  return nnx.split(model, nnx.Param, ...)


def graphdef_for(cfg: ModelConfig) -> nnx.GraphDef:
  return split_model(build.abstract(cfg))[0]


def _init_fn(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int):
  def init():
    _, params, rest = split_model(MoEDecoder(cfg, rngs=nnx.Rngs(seed)))
    return TrainState(params=params, rest=rest, opt_state=tx.init(params),
                      step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32))
  return init


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int = 0):
  """The TrainState of ShapeDtypeStructs (nothing allocated)."""
  return jax.eval_shape(_init_fn(cfg, tx, seed))


def state_shardings(abstract: TrainState, mesh: Mesh) -> TrainState:
  """NamedShardings for every leaf: parameters and their moments by logical axes, scalars
  replicated."""
  return sharding.state_shardings(abstract, mesh)


def create(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int = 0):
  """A freshly initialised, sharded TrainState. Returns (graphdef, state, shardings)."""
  abstract = abstract_state(cfg, tx, seed)
  shardings = state_shardings(abstract, mesh)
  state = jax.jit(_init_fn(cfg, tx, seed), out_shardings=shardings)()
  return graphdef_for(cfg), state, shardings


def from_model(model: MoEDecoder, tx: optax.GradientTransformation, mesh: Mesh):
  """A TrainState whose parameters are copied from an existing model (e.g. a pre-trained
  checkpoint), laid out on `mesh`. Returns (graphdef, state, shardings)."""
  graphdef, params, rest = split_model(model)
  abstract = abstract_state(model.config, tx)
  shardings = state_shardings(abstract, mesh)

  def init(params, rest):
    return TrainState(params=params, rest=rest, opt_state=tx.init(params),
                      step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32))

  # The model may live anywhere (one device, another mesh): lay its arrays out on `mesh` first.
  params = jax.device_put(params, shardings.params)
  rest = jax.device_put(rest, shardings.rest)
  state = jax.jit(init, out_shardings=shardings)(params, rest)
  return graphdef, state, shardings
