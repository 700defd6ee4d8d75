"""The MoE feed-forward block: router, routed experts (optionally expert-parallel), shared experts.

Routing is computed first, by the replicated router, so every shard agrees on it (and replayed
routing goes through unchanged). When a mesh with an expert axis larger than one is active
(`jax.set_mesh`), the routed experts are expert-parallel by all-to-all (moe/expert_parallel.py):
tokens are split over the batch and expert axes and each token's k copies go only to the shards
holding their experts. `ModelConfig.expert_dispatch = "psum"` keeps the older form, every expert
shard seeing every token of its batch shard and a psum over (expert, tensor), as a benchmark
baseline; it is also what runs when only the tensor axis is split (plain tensor parallelism).
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from moe import expert_parallel
from moe import experts as experts_lib
from moe import layers
from moe import sharding
from moe.config import ModelConfig
from moe.router import Router


class MoEBlock(nnx.Module):
  """Routed experts plus optional always-on shared experts."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.k = cfg.num_experts_per_tok
    self.num_experts = cfg.num_experts
    self.dtype = cfg.jnp_dtype
    self.expert_impl = cfg.expert_impl
    self.capacity_factor = cfg.capacity_factor
    self.expert_dispatch = cfg.expert_dispatch
    self.router = Router(cfg, rngs=rngs)
    self.experts = experts_lib.ExpertWeights(cfg, rngs=rngs)
    if cfg.num_shared_experts > 0:
      self.shared = layers.MLP(cfg.hidden_size, cfg.resolved_shared_intermediate_size, rngs=rngs,
                               std=cfg.init_std, param_dtype=cfg.jnp_param_dtype,
                               dtype=cfg.jnp_dtype)
    else:
      self.shared = None

  def _run_experts(self, x, idx, gates):
    impl = experts_lib.resolve_impl(self.expert_impl)
    wg = self.experts.gate.get_value()
    wu = self.experts.up.get_value()
    wd = self.experts.down.get_value()
    mesh = jax.sharding.get_abstract_mesh()
    ep = sharding.axes_size(mesh, sharding.mesh_axes("exp"))
    tp = sharding.axes_size(mesh, sharding.mesh_axes("mlp"))
    dt = self.dtype

    def local(x, idx, gates, wg, wu, wd, offset):
      if impl == "ragged":
        return experts_lib.ragged_experts(x, idx, gates, wg, wu, wd, dtype=dt,
                                          expert_offset=offset)
      use = impl
      if impl == "dispatch" and self.expert_impl == "auto" and self.capacity_factor is None:
        use = experts_lib.dropless_cpu_impl(x.shape[0], self.k, wg.shape[0])
      if use == "grouped":
        return experts_lib.grouped_experts(x, idx, gates, wg, wu, wd, dtype=dt,
                                           block=experts_lib.GROUPED_BLOCK, expert_offset=offset)
      cap = experts_lib.capacity_for(x.shape[0], self.k, self.num_experts, self.capacity_factor)
      return experts_lib.dispatch_experts(x, idx, gates, wg, wu, wd, dtype=dt, capacity=cap,
                                          expert_offset=offset)

    if ep * tp == 1:
      return local(x, idx, gates, wg, wu, wd, 0)
    if ep == 1 or self.expert_dispatch == "psum":
      return expert_parallel.psum_experts(x, idx, gates, wg, wu, wd, local_experts=local)
    if self.num_experts % ep:
      raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of the expert "
                       f"axis ({ep}) for expert parallelism")
    return expert_parallel.routed_experts(
        x, idx, gates, wg, wu, wd,
        exchange=expert_parallel.choose_exchange(jax.default_backend(), self.capacity_factor),
        capacity_factor=self.capacity_factor,
        local_experts=expert_parallel.dropless_local_experts(self.expert_impl, dt), dtype=dt)

  def __call__(self, x: jax.Array, routing: Optional[jax.Array] = None,
               token_mask: Optional[jax.Array] = None):
    """x [B, T, D]; routing optional [B, T, k] -> (y [B, T, D], indices [B, T, k], aux)."""
    b, t, d = x.shape
    xf = x.reshape(b * t, d)
    rf = None if routing is None else routing.reshape(b * t, self.k)
    mf = None if token_mask is None else token_mask.reshape(b * t)
    idx, gates, aux = self.router(xf, rf, mf)
    y = self._run_experts(xf, idx, gates)
    if self.shared is not None:
      y = y + self.shared(xf)
    return y.reshape(b, t, d).astype(self.dtype), idx.reshape(b, t, self.k), aux
