"""The MoE feed-forward block: router, routed experts (optionally expert-parallel), shared experts.

Expert parallelism: when a mesh with `expert` or `tensor` axes larger than one is active
(`jax.set_mesh`), the routed experts run under `shard_map`. Each expert shard holds E / |expert|
experts (their `mlp` dim split over `tensor`), sees every token of its batch shard, computes only
its experts' contributions and the shards' partial outputs are summed with one psum over
(expert, tensor). Routing is computed before the shard_map from the replicated router, so every
shard agrees on it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

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
    ep = 1 if mesh.empty else mesh.shape.get("expert", 1) * mesh.shape.get("tensor", 1)
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

    if ep == 1:
      return local(x, idx, gates, wg, wu, wd, 0)

    batch = sharding.BATCH_AXES
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if x.shape[0] % n_batch_shards:
      batch = None  # too few tokens to split (e.g. a single decode row): replicate them

    def shard_fn(x, idx, gates, wg, wu, wd):
      offset = jax.lax.axis_index("expert") * wg.shape[0]
      y = local(x, idx, gates, wg, wu, wd, offset)
      return jax.lax.psum(y, ("expert", "tensor"))

    tok = P(batch, None)  # tokens: split over batch axes, replicated over expert and tensor
    return jax.shard_map(
        shard_fn,
        in_specs=(tok, tok, tok,
                  P("expert", None, "tensor"),  # gate: replicated over data/fsdp (gathered)
                  P("expert", None, "tensor"),  # up: likewise
                  P("expert", "tensor", None)),  # down: likewise
        out_specs=tok,
    )(x, idx, gates, wg, wu, wd)

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
