"""The sampler's slot KV cache: its layout, its allocation and every write into it.

What: per layer, keys [slots, kv_heads, head_dim, length] (transposed) and values
[slots, kv_heads, length, head_dim], as two tuples (one array per layer). Each completion being
generated owns one slot (row) from its prefill until it finishes.
  * `allocate`: the zeroed caches, once per engine (and again after a failed device call, which
    may have consumed the donated buffers).
  * `write_prompts`: copies each prefilled prompt's keys and values into every slot that samples
    from it, so the n completions of one prompt share one prefill.
  * `write_step`: one decode step's key and value of every slot, at the slot's position.
  * `window` / `write_back`: the prefix of slots and positions a decode call attends over, and
    putting it back into the full cache afterwards.
The device programs (`rollout.device_programs`) take the caches as donated arguments, so XLA
updates them in place; `rollout.forward` reads them in its attention.

Why this layout:
  * Slots, not pages. Paging would save memory for ragged lengths, but on the CPU the cache is
    small and a dense slot cache keeps decode attention a contiguous batched matvec with no
    page-table gathers. Slots are handed out lowest-first (`rollout.scheduler`), so the active
    rows form a prefix and a decode call runs on the smallest power-of-two batch bucket covering
    them, attending over a `length_bucket`-rounded prefix of positions (`window`).
  * Keys transposed. A decode step's scores are then an elementwise product summed over
    head_dim with length as the contiguous (vectorised) axis, and its output a batched matvec
    over contiguous values. On the CPU this is 2.4x faster attention than two batched matmuls
    over [.., length, head_dim], which XLA runs as thousands of tiny [group x head_dim] x
    [head_dim x length] products (1.3x more tokens/s at batch 64, BENCHMARKS.md).
  * Never cleared. A slot is reused as it was left: entry s is visible to a query only when
    s <= its position, so what an earlier occupant (or earlier weights) left past a row's
    position stays hidden until it is overwritten. Hidden means selected out of both the scores
    and the values (`rollout.forward.decode_step`), not multiplied by probability 0: 0 x NaN is
    NaN, so a multiply would let a NaN left by bad weights poison every later occupant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe.config import ModelConfig
from rollout import placement


def allocate(cfg: ModelConfig, slots: int, length: int, dtype=jnp.float32,
             sharding=None) -> tuple:
  """Zeroed per-layer slot caches (keys [slots, KV, hd, length], values [slots, KV, length, hd]).

  `sharding`: where they live (`rollout.placement.Placement.cache_sharding`: on a mesh, split on
  kv heads; each device allocates only its shard); None is the default device.
  """
  kvh, hd = cfg.num_kv_heads, cfg.resolved_head_dim
  return (tuple(jnp.zeros((slots, kvh, hd, length), dtype, device=sharding)
                for _ in range(cfg.num_layers)),
          tuple(jnp.zeros((slots, kvh, length, hd), dtype, device=sharding)
                for _ in range(cfg.num_layers)))


def write_prompts(cache_k, cache_v, ks, vs, dst_slot, src_row) -> tuple:
  """Copies prefilled prompts' keys and values into slots, from position 0.

  Args:
    cache_k, cache_v: per-layer slot caches ([B, KV, hd, S] and [B, KV, S, hd]).
    ks, vs: per-layer prompt keys [P, KV, hd, L] and values [P, KV, L, hd] (`forward.prefill`).
    dst_slot: int32 [M] slot to fill; an entry of B (out of range) is dropped, which is how
      callers pad the list to a fixed M.
    src_row: int32 [M] prompt row each slot gets.

  Returns:
    (cache_k, cache_v) with positions [0, L) of the named slots replaced.
  """
  cache_k = tuple(c.at[dst_slot, :, :, :k.shape[3]].set(k[src_row].astype(c.dtype), mode="drop")
                  for c, k in zip(cache_k, ks))
  cache_v = tuple(c.at[dst_slot, :, :v.shape[2]].set(v[src_row].astype(c.dtype), mode="drop")
                  for c, v in zip(cache_v, vs))
  return keep_sharding(cache_k), keep_sharding(cache_v)


def write_step(ck, cv, positions, k, v) -> tuple:
  """Writes one decode step of one layer: slot b's key k[b] and value v[b] at positions[b].

  Args:
    ck, cv: one layer's caches [B, KV, hd, S] and [B, KV, S, hd].
    positions: int32 [B] position of each slot's new token (one past S is dropped).
    k, v: [B, KV, hd] the new keys and values.

  Returns:
    (ck, cv) updated.
  """
  rows = jnp.arange(k.shape[0])
  ck = ck.at[rows, :, :, positions].set(k.astype(ck.dtype), mode="drop")
  cv = cv.at[rows, :, positions].set(v.astype(cv.dtype), mode="drop")
  return keep_sharding((ck,))[0], keep_sharding((cv,))[0]


def _is_whole(cache_v, nb: int, sv: int) -> bool:
  return nb == cache_v[0].shape[0] and sv == cache_v[0].shape[2]


def window(cache_k, cache_v, nb: int, sv: int) -> tuple:
  """The first nb slots and sv positions of every layer (the caches themselves if that is all)."""
  if _is_whole(cache_v, nb, sv):
    return cache_k, cache_v
  return (tuple(c[:nb, :, :, :sv] for c in cache_k), tuple(c[:nb, :, :sv] for c in cache_v))


def write_back(cache_k, cache_v, ck, cv) -> tuple:
  """Puts a `window` (ck, cv), updated, back into the full caches; returns the full caches."""
  if _is_whole(cache_v, cv[0].shape[0], cv[0].shape[2]):
    return keep_sharding(ck), keep_sharding(cv)
  return (keep_sharding(tuple(jax.lax.dynamic_update_slice(c, s, (0, 0, 0, 0))
                              for c, s in zip(cache_k, ck))),
          keep_sharding(tuple(jax.lax.dynamic_update_slice(c, s, (0, 0, 0, 0))
                              for c, s in zip(cache_v, cv))))


def keep_sharding(caches: tuple) -> tuple:
  """Per-layer caches (or prefix-store blocks) constrained to their sharding on the active mesh
  (`rollout.placement.CACHE_AXES`; nothing on one device). Every program that writes a cache
  ends with it, so the cache it returns is laid out as the one it was given (and donated):
  otherwise the partitioner may pick another layout from the expert exchange's token split,
  and the next call would see a new input sharding (a new compilation, a copy)."""
  return tuple(placement.constrain(c, placement.CACHE_AXES) for c in caches)
