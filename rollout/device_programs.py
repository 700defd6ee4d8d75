"""The sampler's jit-compiled device programs: prefill-into-slots and multi-step decode chunks.

What: two functions, each compiled once per static shape (so a running server compiles a fixed,
small set and then never again):
  * `prefill_into_slots`: runs P prompts padded to a length bucket L, copies each prompt's KV into
    every slot that samples from it (n completions share one prefill), and samples each slot's
    first token. Shapes: (P, L) buckets; the slot list is always padded to max_slots.
  * `decode_chunk`: `steps` decode steps for the first `nb` slots inside one `lax.scan`, sampling
    on device, attending over the first `sv` cache positions. A row that finishes moves to its
    last token's position and stays there (its KV before it is kept exact); the
    host reads tokens/logprobs/routing once per chunk. Static (nb, sv) come from buckets.

Why: per-call dispatch and a host sync per token would dominate on the CPU; a scan of `steps`
steps with sampling inside amortises both. The KV cache (`rollout.kv_cache`) is donated, so it is
updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe.config import ModelConfig
from rollout import forward
from rollout import kv_cache
from rollout import sampling

# Host-side slot state fields passed to and returned from `decode_chunk` (all [max_slots]).
SLOT_FIELDS = ("tok", "pos", "remaining", "active", "temp", "top_k", "top_p", "seed", "sample",
               "tindex", "stop")
CARRIED = ("tok", "pos", "remaining", "active", "tindex")


@functools.partial(jax.jit, static_argnames=("cfg", "caps", "top_n"),
                   donate_argnames=("cache_k", "cache_v"))
def prefill_into_slots(params, cache_k, cache_v, tokens, lengths, dst_slot, src_row, temp, top_k,
                       top_p, seed, sample, *, cfg: ModelConfig, caps: tuple, top_n: int = 0):
  """Prefills prompts and seeds slots.

  Args:
    params: packed weights.
    cache_k, cache_v: per-layer slot caches (donated): keys [B, KV, hd, S], values
      [B, KV, S, hd] (rollout.kv_cache).
    tokens: int32 [P, L] prompts, right-padded; lengths int32 [P].
    dst_slot: int32 [M] slot to fill (M = B; padding entries hold B and are dropped).
    src_row: int32 [M] prompt row each slot samples from.
    temp, top_k, top_p, seed, sample: [M] sampling settings of each slot (see rollout.sampling).
    cfg: model config; caps: expert capacity tiers for P * L tokens; top_n: alternatives to
      return per token (rollout.sampling.sample).

  Returns:
    (cache_k, cache_v, first tokens int32 [M], their logprobs [M], prompt routing uint8/int16
     [moe_layers, P, L, k], top logprobs [M, top_n], top ids [M, top_n]).
  """
  logits, routing, ks, vs = forward.prefill(params, cfg, tokens, lengths, caps)
  cache_k, cache_v = kv_cache.write_prompts(cache_k, cache_v, ks, vs, dst_slot, src_row)
  tok, lp, top_lp, top_ids = sampling.sample(logits[src_row], temp, top_k, top_p, seed, sample,
                                             jnp.zeros_like(sample), top_n)
  return cache_k, cache_v, tok, lp, routing.astype(cfg.routing_dtype), top_lp, top_ids


@functools.partial(jax.jit, static_argnames=("cfg", "nb", "sv", "steps", "caps", "top_n"),
                   donate_argnames=("cache_k", "cache_v"))
def decode_chunk(params, cache_k, cache_v, slots, *, cfg: ModelConfig, nb: int, sv: int,
                 steps: int, caps: tuple, top_n: int = 0):
  """Runs `steps` decode steps on slots [0, nb) attending over cache positions [0, sv).

  Args:
    params: packed weights.
    cache_k, cache_v: per-layer keys [B, KV, hd, S] and values [B, KV, S, hd] (donated).
    slots: dict of SLOT_FIELDS arrays, each [B] ("stop" is [B, max_stop_ids]); only the first nb
      rows are used. `tok` is each slot's next input token at position `pos`; `remaining` counts
      tokens still to generate; inactive rows compute but emit nothing and do not advance (a row
      that stops advances once more, onto the position of its last token).
    cfg, nb, sv, steps, caps, top_n: static shape parameters.

  Returns:
    (cache_k, cache_v, carried {CARRIED: [nb]}, outputs) with outputs = dict(tokens int32
    [steps, nb], logprobs float32 [steps, nb], routing [steps, moe_layers, nb, k],
    valid bool [steps, nb], top_logprobs [steps, nb, top_n], top_ids [steps, nb, top_n]).
  """
  st = {k: v[:nb] for k, v in slots.items()}
  with jax.named_scope("cache_window"):
    ck, cv = kv_cache.window(cache_k, cache_v, nb, sv)

  def body(carry, _):
    ck, cv, c = carry
    logits, routing, ck, cv = forward.decode_step(params, cfg, c["tok"], c["pos"], ck, cv, caps)
    with jax.named_scope("sampling"):
      tok, lp, top_lp, top_ids = sampling.sample(logits, st["temp"], st["top_k"], st["top_p"],
                                                 st["seed"], st["sample"], c["tindex"], top_n)
    valid = c["active"]
    remaining = c["remaining"] - valid.astype(jnp.int32)
    stopped = jnp.any(tok[:, None] == st["stop"], axis=-1) | (remaining <= 0)
    active = valid & ~stopped
    new = {"tok": jnp.where(valid, tok, c["tok"]),
           # A row that stops here still advances once: its later steps in this chunk then
           # write the last token's KV at that token's own position, not over the position
           # before it, so the slot keeps exact KV for prompt + tokens[:-1] (the prefix cache
           # copies it when the completion finishes, `rollout.prefix_reuse`).
           "pos": c["pos"] + valid.astype(jnp.int32),
           "remaining": remaining, "active": active,
           "tindex": c["tindex"] + valid.astype(jnp.int32)}
    out = {"tokens": tok, "logprobs": lp, "routing": routing.astype(cfg.routing_dtype),
           "valid": valid, "top_logprobs": top_lp, "top_ids": top_ids}
    return (ck, cv, new), out

  init = {k: st[k] for k in CARRIED}
  (ck, cv, carried), outs = jax.lax.scan(body, (ck, cv, init), None, length=steps)
  with jax.named_scope("cache_window"):
    ck, cv = kv_cache.write_back(cache_k, cache_v, ck, cv)
  return ck, cv, carried, outs
