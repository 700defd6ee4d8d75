"""Routed experts: weights and the two ways to run them.

  * `ragged_experts`: sort the token->expert assignments by expert and run one grouped matmul
    (`jax.lax.ragged_dot`) per projection. Dropless and the efficient choice on GPU/TPU. On the CPU
    XLA lowers ragged_dot to a loop that computes every expert for every row (see
    ../shared/verified-here.md), so it is slow there.
  * `dispatch_experts`: sort assignments by expert into per-expert capacity buffers
    [E, C, D] and run batched matmuls. Assignments beyond an expert's capacity are dropped (their
    output is zero); with capacity >= tokens nothing drops. The fast path on the CPU.

Both take an `expert_offset` so that, under expert parallelism, a shard holding experts
[offset, offset + E_local) computes only their contributions; assignments to other experts
contribute zero and the shards' partial outputs are summed by the caller. Both sum the k
contributions of a token in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moe import layers
from moe.config import ModelConfig


class ExpertWeights(nnx.Module):
  """SwiGLU weights of E experts: gate/up [E, D, I], down [E, I, D]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    pd, std = cfg.jnp_param_dtype, cfg.init_std
    self.gate = layers.param(rngs, (e, d, i), ("exp", "embed", "mlp"), std=std, dtype=pd)
    self.up = layers.param(rngs, (e, d, i), ("exp", "embed", "mlp"), std=std, dtype=pd)
    self.down = layers.param(rngs, (e, i, d), ("exp", "mlp", "embed"), std=std, dtype=pd)


def _local_keys(idx: jax.Array, expert_offset, num_local: int):
  """Assignment keys in [0, num_local], where num_local marks 'not on this shard'."""
  local = idx.reshape(-1).astype(jnp.int32) - expert_offset
  valid = (local >= 0) & (local < num_local)
  return jnp.where(valid, local, num_local), valid


def _combine(y_assign: jax.Array, gates: jax.Array, valid: jax.Array, dtype) -> jax.Array:
  """Weighted sum over each token's k assignments (in order: deterministic, no scatter-add)."""
  n, k = gates.shape
  w = jnp.where(valid.reshape(n, k), gates, 0.0).astype(jnp.float32)
  y = y_assign.reshape(n, k, -1).astype(jnp.float32)
  return jnp.einsum("nkd,nk->nd", y, w).astype(dtype)


def ragged_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, *, dtype, expert_offset=0) -> jax.Array:
  """Dropless grouped-matmul experts. x [N, D], idx/gates [N, k] -> [N, D]."""
  n, k = idx.shape
  e_local = w_gate.shape[0]
  keys, valid = _local_keys(idx, expert_offset, e_local)
  order = jnp.argsort(keys, stable=True)
  group_sizes = jnp.bincount(keys, length=e_local + 1)[:e_local].astype(jnp.int32)
  xs = x[order // k].astype(dtype)
  h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate.astype(dtype), group_sizes))
  h = h * jax.lax.ragged_dot(xs, w_up.astype(dtype), group_sizes)
  ys = jax.lax.ragged_dot(h, w_down.astype(dtype), group_sizes)  # rows past the groups are zero
  inverse = jnp.argsort(order)
  return _combine(ys[inverse], gates, valid, dtype)


def capacity_for(num_tokens: int, k: int, num_experts: int,
                 capacity_factor: Optional[float]) -> int:
  """Per-expert buffer size; None means dropless (every token could pick one expert)."""
  if capacity_factor is None:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(num_tokens * k / num_experts * capacity_factor)))


def dispatch_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array, *, dtype, capacity: int,
                     expert_offset=0) -> jax.Array:
  """Sort-and-capacity experts as batched matmuls. x [N, D], idx/gates [N, k] -> [N, D]."""
  n, k = idx.shape
  e_local, d = w_gate.shape[0], x.shape[-1]
  a = n * k
  keys, valid = _local_keys(idx, expert_offset, e_local)
  order = jnp.argsort(keys, stable=True)
  counts = jnp.bincount(keys, length=e_local + 1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = jnp.arange(a, dtype=jnp.int32) - starts[keys[order]].astype(jnp.int32)
  rank = jnp.zeros((a,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
  keep = valid & (rank < capacity)
  dest = jnp.where(keep, keys * capacity + rank, e_local * capacity)  # out of range: dropped
  src = x[jnp.arange(a) // k].astype(dtype)
  buf = jnp.zeros((e_local * capacity, d), dtype).at[dest].set(src, mode="drop")
  buf = buf.reshape(e_local, capacity, d)
  h = jax.nn.silu(jnp.einsum("ecd,edi->eci", buf, w_gate.astype(dtype)))
  h = h * jnp.einsum("ecd,edi->eci", buf, w_up.astype(dtype))
  y = jnp.einsum("eci,eid->ecd", h, w_down.astype(dtype)).reshape(e_local * capacity, d)
  y_assign = jnp.take(y, dest, axis=0, mode="fill", fill_value=0)
  return _combine(y_assign, gates, keep, dtype)


def resolve_impl(expert_impl: str) -> str:
  """'auto' picks dispatch on the CPU (ragged_dot is slow there) and ragged elsewhere."""
  if expert_impl != "auto":
    return expert_impl
  return "dispatch" if jax.default_backend() == "cpu" else "ragged"
