"""Routed experts: weights and the two ways to run them.

  * `ragged_experts`: sort the token->expert assignments by expert and run one grouped matmul
    (`jax.lax.ragged_dot`) per projection. Dropless and the efficient choice on GPU/TPU. On the CPU
    XLA lowers ragged_dot to a loop that computes every expert for every row (see
    ../shared/verified-here.md), so it is slow there.
  * `dispatch_experts`: sort assignments by expert into per-expert capacity buffers
    [E, C, D] and run batched matmuls. Assignments beyond an expert's capacity are dropped (their
    output is zero); with capacity >= tokens nothing drops, at the price of computing every
    expert over a buffer as long as all the tokens (E/k times the routed work).
  * `grouped_experts`: dropless like ragged, as batched matmuls like dispatch: each expert's
    assignments are padded to whole blocks of `block` rows and every block is multiplied by its
    own expert's weights (the block-sparse layout of MegaBlocks, Gale et al. 2022). The work is
    the routed assignments plus at most one partial block per expert, so for all but tiny token
    counts it is far less than dropless dispatch; `auto` picks whichever of the two is smaller on
    the CPU (`dropless_cpu_impl`).

All take an `expert_offset` so that, under expert parallelism, a shard holding experts
[offset, offset + E_local) computes only their contributions; assignments to other experts
contribute zero (moe/expert_parallel.py runs them on the rows an all-to-all brought to the
shard, and reuses `rank_by_expert`, `expert_ffn` and `combine` for its own buffers). All sum the k
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


def rank_by_expert(idx: jax.Array, expert_offset, num_local: int):
  """(keys, valid, assignments per key, each assignment's rank among its expert's), the
  assignments taken in (token, k) order: what both buffer layouts place rows by."""
  keys, valid = _local_keys(idx, expert_offset, num_local)
  a = keys.shape[0]
  order = jnp.argsort(keys, stable=True)
  counts = jnp.bincount(keys, length=num_local + 1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = jnp.arange(a, dtype=jnp.int32) - starts[keys[order]].astype(jnp.int32)
  rank = jnp.zeros((a,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
  return keys, valid, counts, rank


def combine(y_assign: jax.Array, gates: jax.Array, valid: jax.Array, dtype) -> jax.Array:
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
  return combine(ys[inverse], gates, valid, dtype)


def capacity_for(num_tokens: int, k: int, num_experts: int,
                 capacity_factor: Optional[float]) -> int:
  """Per-expert buffer size; None means dropless (every token could pick one expert)."""
  if capacity_factor is None:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(num_tokens * k / num_experts * capacity_factor)))


def expert_ffn(buf: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
               dtype) -> jax.Array:
  """Each expert's SwiGLU over its own buffer rows, as batched matmuls: [E, C, D] -> [E, C, D].

  Zero rows give zero rows.
  """
  h = jax.nn.silu(jnp.einsum("ecd,edi->eci", buf, w_gate.astype(dtype)))
  h = h * jnp.einsum("ecd,edi->eci", buf, w_up.astype(dtype))
  return jnp.einsum("eci,eid->ecd", h, w_down.astype(dtype))


def dispatch_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array, *, dtype, capacity: int,
                     expert_offset=0) -> jax.Array:
  """Sort-and-capacity experts as batched matmuls. x [N, D], idx/gates [N, k] -> [N, D]."""
  n, k = idx.shape
  e_local, d = w_gate.shape[0], x.shape[-1]
  a = n * k
  keys, valid, counts, rank = rank_by_expert(idx, expert_offset, e_local)
  keep = valid & (rank < capacity)
  dest = jnp.where(keep, keys * capacity + rank, e_local * capacity)  # out of range: dropped
  src = x[jnp.arange(a) // k].astype(dtype)
  buf = jnp.zeros((e_local * capacity, d), dtype).at[dest].set(src, mode="drop")
  y = expert_ffn(buf.reshape(e_local, capacity, d), w_gate, w_up, w_down, dtype=dtype)
  y = y.reshape(e_local * capacity, d)
  y_assign = jnp.take(y, dest, axis=0, mode="fill", fill_value=0)
  return combine(y_assign, gates, keep, dtype)


def grouped_blocks(num_assignments: int, num_experts: int, block: int) -> int:
  """Blocks of `grouped_experts`' buffer: enough for any routing (sum_e ceil(c_e / block))."""
  return -(-num_assignments // block) + num_experts - 1


def grouped_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                    w_up: jax.Array, w_down: jax.Array, *, dtype, block: int,
                    expert_offset=0) -> jax.Array:
  """Dropless experts as a padded grouped matmul. x [N, D], idx/gates [N, k] -> [N, D].

  Assignments sorted by expert fill whole `block`-row blocks, each expert's group starting on a
  block boundary; block b is multiplied by the weights of the expert its rows belong to (blocks
  past the last group hold zeros and give zeros). Nothing is dropped and every assignment sees
  exactly its expert's weights, so the output equals dropless dispatch and ragged_dot.
  """
  n, k = idx.shape
  e_local, d = w_gate.shape[0], x.shape[-1]
  a = n * k
  nb = grouped_blocks(a, e_local, block)
  keys, valid, counts, rank = rank_by_expert(idx, expert_offset, e_local)
  blocks = (counts[:e_local] + block - 1) // block  # blocks each local expert's group takes
  block_ends = jnp.cumsum(blocks)
  first_block = block_ends - blocks
  safe_key = jnp.minimum(keys, e_local - 1)
  dest = jnp.where(valid, first_block[safe_key] * block + rank, nb * block)  # off-shard: none
  src = x[jnp.arange(a) // k].astype(dtype)
  buf = jnp.zeros((nb * block, d), dtype).at[dest].set(src, mode="drop", unique_indices=True)
  buf = buf.reshape(nb, block, d)
  # The expert of each block (blocks past the groups: the last expert, applied to zeros).
  owner = jnp.minimum(jnp.searchsorted(block_ends, jnp.arange(nb), side="right"), e_local - 1)
  wg, wu, wdn = (jnp.take(w.astype(dtype), owner, axis=0) for w in (w_gate, w_up, w_down))
  h = jax.nn.silu(jnp.einsum("nbd,ndi->nbi", buf, wg))
  h = h * jnp.einsum("nbd,ndi->nbi", buf, wu)
  y = jnp.einsum("nbi,nid->nbd", h, wdn).reshape(nb * block, d)
  y_assign = jnp.take(y, dest, axis=0, mode="fill", fill_value=0)
  return combine(y_assign, gates, valid, dtype)


# Rows per block of the grouped path: big enough for efficient matmuls on a CPU, small enough
# that the padding (under one block per expert) stays a small share of a training batch.
GROUPED_BLOCK = 128


def dropless_cpu_impl(num_tokens: int, k: int, num_experts: int,
                      block: int = GROUPED_BLOCK) -> str:
  """"grouped" or "dispatch", whichever computes fewer expert rows for a dropless layer.

  Dropless dispatch computes num_experts * num_tokens rows; grouped, at most the assignments
  plus a partial block per expert. Decoding a few rows favours dispatch, prefill and training
  batches grouped.
  """
  grouped = grouped_blocks(num_tokens * k, num_experts, block) * block
  return "grouped" if grouped < num_experts * num_tokens else "dispatch"


def resolve_impl(expert_impl: str) -> str:
  """'auto' picks dispatch on the CPU (ragged_dot is slow there) and ragged elsewhere."""
  if expert_impl != "auto":
    return expert_impl
  return "dispatch" if jax.default_backend() == "cpu" else "ragged"
