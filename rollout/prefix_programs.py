"""Prefix caching, device side: the block store, copies into it, and the "extend" prefill.

What:
  * `allocate_store(cfg, blocks, block_size)`: per layer, keys [N, KV, hd, B] and values
    [N, KV, B, hd] (the slot cache's layouts, `rollout.kv_cache`, cut into blocks of B
    positions).
  * `save_blocks`: copies blocks of slot positions into store blocks (one call for every copy
    `rollout.prefix_cache.PrefixIndex.take_pending` queued).
  * `extend_forward`: the prefill of prompt suffixes that attend over a cached prefix: row r's
    tokens sit at positions start[r].., attend over the first start[r] positions of its context
    (gathered from the store by a block table) and causally over themselves.
  * `extend_into_slots`: `rollout.device_programs.prefill_into_slots` for prompts with cached
    prefixes: writes each row's cached context and its new KV into every slot that samples from
    it, and samples each slot's first token.

Why a store of its own rather than keeping finished slots: the slot cache is dense and every
slot is reused by the next request (`rollout.kv_cache`), so what a finished request computed
must be copied out to outlive it; blocks of B positions let requests share a prefix and let
memory be bounded by a block count. Keys and values keep the slot cache's layouts, so a copy is
a plain gather/scatter along positions.

Stale data: the block table of a row is padded with block 0 and the context past start[r] is
selected out of both the scores and the values (a select, not a 0-probability product, as
`rollout.forward.decode_step` explains), so whatever those blocks hold never reaches outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe.config import ModelConfig
from rollout import forward
from rollout import kv_cache
from rollout import sampling

_NEG_INF = -1e30


def allocate_store(cfg: ModelConfig, blocks: int, block_size: int, dtype=jnp.float32,
                   sharding=None) -> tuple:
  """Zeroed per-layer block stores: keys [N, KV, hd, B], values [N, KV, B, hd]; `sharding` as
  `rollout.kv_cache.allocate`'s (the store is split like the slot cache)."""
  kvh, hd = cfg.num_kv_heads, cfg.resolved_head_dim
  return (tuple(jnp.zeros((blocks, kvh, hd, block_size), dtype, device=sharding)
                for _ in range(cfg.num_layers)),
          tuple(jnp.zeros((blocks, kvh, block_size, hd), dtype, device=sharding)
                for _ in range(cfg.num_layers)))


@functools.partial(jax.jit, donate_argnames=("store_k", "store_v"))
def save_blocks(store_k, store_v, cache_k, cache_v, slot, block_index, dst_block):
  """Copies slot positions [i*B, (i+1)*B) of slot `slot[m]`, i = `block_index[m]`, into store
  block `dst_block[m]` (an entry of N, out of range, is dropped: how callers pad to a fixed M).

  Returns the updated (store_k, store_v) (donated, so updated in place).
  """
  b = store_v[0].shape[2]
  pos = block_index[:, None] * b + jnp.arange(b)[None, :]  # [M, B]
  rows = slot[:, None]
  new_k = tuple(s.at[dst_block].set(jnp.transpose(c[rows, :, :, pos], (0, 2, 3, 1)), mode="drop")
                for s, c in zip(store_k, cache_k))  # gathered [M, B, KV, hd] -> [M, KV, hd, B]
  new_v = tuple(s.at[dst_block].set(jnp.transpose(c[rows, :, pos, :], (0, 2, 1, 3)), mode="drop")
                for s, c in zip(store_v, cache_v))  # gathered [M, B, KV, hd] -> [M, KV, B, hd]
  return kv_cache.keep_sharding(new_k), kv_cache.keep_sharding(new_v)


def gather_context(store_k, store_v, table) -> tuple:
  """Per layer, the blocks named by `table` [P, nb] laid end to end: keys [P, KV, hd, nb*B],
  values [P, KV, nb*B, hd]."""
  p, nb = table.shape
  ks = []
  for s in store_k:
    g = jnp.transpose(s[table], (0, 2, 3, 1, 4))  # [P, KV, hd, nb, B]
    ks.append(g.reshape(p, g.shape[1], g.shape[2], -1))
  vs = []
  for s in store_v:
    g = jnp.transpose(s[table], (0, 2, 1, 3, 4))  # [P, KV, nb, B, hd]
    vs.append(g.reshape(p, g.shape[1], -1, g.shape[4]))
  return tuple(ks), tuple(vs)


def extend_forward(params, cfg: ModelConfig, tokens, lengths, start, ctx_k, ctx_v, caps: tuple):
  """Prefill of prompt suffixes after cached prefixes.

  Args:
    params: packed weights.
    cfg: model config.
    tokens: int32 [P, L] each row's tokens after its cached prefix, right-padded.
    lengths: int32 [P] real suffix lengths (>= 1).
    start: int32 [P] cached prefix length of each row (its first token's position); 0 is a
      plain prefill.
    ctx_k, ctx_v: per-layer context keys [P, KV, hd, C] and values [P, KV, C, hd]; positions
      < start[r] are row r's cached prefix, the rest is never read.
    caps: expert capacity tiers for P * L tokens.

  Returns:
    As `rollout.forward.prefill`, for the suffix positions: (logits [P, V] at each row's last
    token, routing [moe_layers, P, L, k], ks [P, KV, hd, L], vs [P, KV, L, hd]).
  """
  p, t = tokens.shape
  kvh, hd = cfg.num_kv_heads, cfg.resolved_head_dim
  g = cfg.num_heads // kvh
  dt = params["embed"].dtype
  c_len = ctx_v[0].shape[2] if ctx_v else 0
  offsets = jnp.arange(t, dtype=jnp.int32)
  positions = start[:, None] + offsets[None, :]
  causal = offsets[None, :] <= offsets[:, None]  # [T(query), T(key)]
  real = offsets[None, :] < lengths[:, None]  # [P, T]
  ctx_vis = jnp.arange(c_len)[None, :] < start[:, None]  # [P, C]
  x = jnp.take(params["embed"], tokens, axis=0)
  ks, vs, routing = [], [], []
  for li, lp in enumerate(params["layers"]):
    hx = forward.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = forward._qkv(hx, lp, cfg, positions)
    v = jnp.where(real[:, :, None, None], v, jnp.zeros((), v.dtype))
    ks.append(jnp.transpose(k, (0, 2, 3, 1)))
    vs.append(jnp.swapaxes(v, 1, 2))
    qg = q.reshape(p, t, kvh, g, hd)
    s_ctx = jnp.einsum("btkgd,bkdc->bkgtc", qg, ctx_k[li],
                       preferred_element_type=jnp.float32) * (hd ** -0.5)
    s_ctx = jnp.where(ctx_vis[:, None, None, None, :], s_ctx, _NEG_INF)
    s_new = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                       preferred_element_type=jnp.float32) * (hd ** -0.5)
    s_new = jnp.where(causal[None, None, None], s_new, _NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_new], axis=-1), axis=-1).astype(dt)
    v_ctx = jnp.where(ctx_vis[:, None, :, None], ctx_v[li].astype(dt), jnp.zeros((), dt))
    att = (jnp.einsum("bkgtc,bkcd->btkgd", probs[..., :c_len], v_ctx)
           + jnp.einsum("bkgts,bskd->btkgd", probs[..., c_len:], v)).reshape(p, t, -1)
    x = x + (att @ lp["wo"]).astype(x.dtype)
    hf = forward.rms_norm(x, lp["ffn_norm"], cfg.rms_norm_eps).reshape(p * t, -1)
    f, idx = forward.ffn(hf, lp, cfg, caps)
    x = x + f.reshape(p, t, -1).astype(x.dtype)
    if idx is not None:
      routing.append(idx.reshape(p, t, -1))
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
  logits = forward._head(forward.rms_norm(last, params["final_norm"], cfg.rms_norm_eps), params,
                         cfg)
  routing = (jnp.stack(routing) if routing
             else jnp.zeros((0, p, t, cfg.num_experts_per_tok), jnp.int32))
  return logits, routing, tuple(ks), tuple(vs)


def _write_rows(cache_k, cache_v, ks, vs, dst_slot, src_row, positions) -> tuple:
  """Writes row src_row[m]'s keys [P, KV, hd, T] / values [P, KV, T, hd] into slot dst_slot[m]
  at positions[m] ([M, T]; an index out of range -- a slot of B, a position of S -- is dropped)."""
  rows = dst_slot[:, None]
  cache_k = tuple(c.at[rows, :, :, positions].set(
      jnp.transpose(k[src_row], (0, 3, 1, 2)).astype(c.dtype), mode="drop")
                  for c, k in zip(cache_k, ks))
  cache_v = tuple(c.at[rows, :, positions].set(
      jnp.transpose(v[src_row], (0, 2, 1, 3)).astype(c.dtype), mode="drop")
                  for c, v in zip(cache_v, vs))
  return kv_cache.keep_sharding(cache_k), kv_cache.keep_sharding(cache_v)


@functools.partial(jax.jit, static_argnames=("cfg", "caps", "top_n"),
                   donate_argnames=("cache_k", "cache_v"))
def extend_into_slots(params, cache_k, cache_v, store_k, store_v, table, start, tokens, lengths,
                      dst_slot, src_row, temp, top_k, top_p, seed, sample, *, cfg: ModelConfig,
                      caps: tuple, top_n: int = 0):
  """Prefills prompt suffixes after their cached prefixes and seeds slots.

  Args:
    params: packed weights.
    cache_k, cache_v: per-layer slot caches (donated), as `prefill_into_slots`.
    store_k, store_v: per-layer block stores (`allocate_store`).
    table: int32 [P, nb] store blocks of each row's cached prefix (padded with block 0).
    start: int32 [P] cached prefix length of each row (a multiple of B, <= nb * B).
    tokens, lengths: int32 [P, L] / [P] each row's remaining prompt tokens.
    dst_slot, src_row, temp, top_k, top_p, seed, sample: as `prefill_into_slots`.
    cfg, caps, top_n: as `prefill_into_slots` (caps for P * L tokens).

  Returns:
    As `prefill_into_slots`, with routing [moe_layers, P, L, k] of the suffix positions.
  """
  ctx_k, ctx_v = gather_context(store_k, store_v, table)
  logits, routing, ks, vs = extend_forward(params, cfg, tokens, lengths, start, ctx_k, ctx_v, caps)
  s_len = cache_v[0].shape[2]
  c_len = ctx_v[0].shape[2]
  row_start = start[src_row][:, None]
  ctx_pos = jnp.arange(c_len)[None, :]
  # Only the cached positions of each row are written; the rest of the context is padding.
  cache_k, cache_v = _write_rows(cache_k, cache_v, ctx_k, ctx_v, dst_slot, src_row,
                                 jnp.where(ctx_pos < row_start, ctx_pos, s_len))
  new_pos = row_start + jnp.arange(tokens.shape[1])[None, :]
  cache_k, cache_v = _write_rows(cache_k, cache_v, ks, vs, dst_slot, src_row,
                                 jnp.where(new_pos < s_len, new_pos, s_len))
  tok, lp, top_lp, top_ids = sampling.sample(logits[src_row], temp, top_k, top_p, seed, sample,
                                             jnp.zeros_like(sample), top_n)
  return cache_k, cache_v, tok, lp, routing.astype(cfg.routing_dtype), top_lp, top_ids
