"""Creating models: plain, abstract (no allocation), and sharded on a mesh.

Sharded creation follows the guard-rail recipe: `nnx.eval_shape` gives the abstract state, the
logical-axis table gives its shardings, and `jax.jit(init, out_shardings=...)` materialises each
parameter directly on its devices, so no host ever holds the whole model.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from moe import sharding
from moe.config import ModelConfig
from moe.model import MoEDecoder


def create(cfg: ModelConfig, seed: int = 0, mesh: Optional[Mesh] = None) -> MoEDecoder:
  """A freshly initialised model; with a mesh, every parameter is created already sharded."""
  if mesh is None:
    return MoEDecoder(cfg, rngs=nnx.Rngs(seed))

  def init():
    return nnx.split(MoEDecoder(cfg, rngs=nnx.Rngs(seed)))[1]

  graphdef, abstract_state = nnx.split(abstract(cfg, seed))
  out = sharding.state_shardings(abstract_state, mesh)
  state = jax.jit(init, out_shardings=out)()
  return nnx.merge(graphdef, state)


def abstract(cfg: ModelConfig, seed: int = 0) -> MoEDecoder:
  """The model with ShapeDtypeStructs in place of arrays (nothing allocated)."""
  return nnx.eval_shape(lambda: MoEDecoder(cfg, rngs=nnx.Rngs(seed)))


def param_count(model_or_state: Any) -> int:
  """Number of trainable parameters (nnx.Param leaves) of a model or abstract model."""
  state = nnx.state(model_or_state, nnx.Param)
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


def active_param_count(cfg: ModelConfig) -> int:
  """Parameters a single token touches: everything but the unused (E - k) routed experts."""
  total = param_count(abstract(cfg))
  per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
  unused = cfg.num_moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
  return total - unused


def resource_plan(cfg: ModelConfig, mesh: Mesh) -> dict:
  """Parameter count and per-device parameter bytes on `mesh`, computed without allocating."""
  model = abstract(cfg)
  state = nnx.state(model)
  return {
      "params": param_count(model),
      "active_params": active_param_count(cfg),
      "param_bytes": int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                             for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
      "param_bytes_per_device": sharding.bytes_per_device(state, mesh),
      "mesh": dict(mesh.shape),
  }
