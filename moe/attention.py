"""Grouped-query attention with RoPE, optional per-head QK-norm and packing.

Keys are the sequence itself: a key is visible to a query when it comes no later in the row and
carries the same segment id (so packed episodes never attend to each other). Decoding with a KV
cache is the sampler's (`rollout.forward`, `rollout.kv_cache`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moe import layers
from moe.config import ModelConfig

_NEG_INF = -1e30


class Attention(nnx.Module):
  """Multi-head attention with num_kv_heads key/value heads shared by groups of query heads."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    pd = cfg.jnp_param_dtype
    std = cfg.init_std
    self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
    self.rope_theta = cfg.rope_theta
    self.query_chunk = cfg.attention_query_chunk
    self.dtype = cfg.jnp_dtype
    self.q = layers.param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), std=std, dtype=pd)
    self.k = layers.param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=pd)
    self.v = layers.param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=pd)
    self.o = layers.param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), std=std, dtype=pd)
    if cfg.qk_norm:
      self.q_norm = layers.RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=pd,
                                   logical_axis="head_dim")
      self.k_norm = layers.RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=pd,
                                   logical_axis="head_dim")
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: Optional[jax.Array]) -> jax.Array:
    """Returns the output [B, T, D].

    Args:
      x: [B, T, D] activations.
      positions: [B, T] positions (RoPE).
      segment_ids: [B, T] packing segments; None means one segment per row.
    """
    dt = self.dtype
    x = x.astype(dt)
    q = jnp.einsum("btd,dhk->bthk", x, self.q.get_value().astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.k.get_value().astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.v.get_value().astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = layers.rope(q, positions, self.rope_theta)
    k = layers.rope(k, positions, self.rope_theta)

    b, t = x.shape[:2]
    g = self.num_heads // self.num_kv_heads
    qg = q.reshape(b, t, self.num_kv_heads, g, self.head_dim)
    # Causal chunks (ModelConfig.attention_query_chunk): the queries of chunk [s, e) see keys
    # [0, e) only, so the blocks above the diagonal are never computed (for 4 chunks, 10 of the
    # 16 blocks). Masked keys weigh exactly zero, so each query's softmax is over the same keys
    # as the whole-square form. At T = 512 this made a CPU pre-training step about a third
    # shorter (BENCHMARKS.md, "Causal attention chunks").
    chunk = self.query_chunk or t
    k, v = k.astype(dt), v.astype(dt)
    outs = []
    for s0 in range(0, t, chunk):
      e0 = min(t, s0 + chunk)
      outs.append(_attend(qg[:, s0:e0], k[:, :e0], v[:, :e0],
                          jnp.arange(s0, e0), None if segment_ids is None else
                          (segment_ids[:, s0:e0], segment_ids[:, :e0]), self.head_dim, dt))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    out = out.reshape(b, t, self.num_heads, self.head_dim)
    y = jnp.einsum("bthk,hkd->btd", out, self.o.get_value().astype(dt))
    return y


def _attend(qg, keys, values, q_pos, segments, head_dim: int, dt):
  """Attention of queries qg [B, C, K, G, D] at positions q_pos [C] over keys/values
  [B, S, K, D] at positions 0..S-1 (causal; `segments`: (query [B, C], key [B, S]) ids, keys of
  another segment hidden) -> [B, C, K, G, D]."""
  mask = jnp.arange(keys.shape[1])[None, None, :] <= q_pos[None, :, None]  # [1, C, S]
  if segments is not None:
    mask = mask & (segments[0][:, :, None] == segments[1][:, None, :])
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
  scores = scores * (head_dim ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  return jnp.einsum("bkgts,bskd->btkgd", probs, values)
