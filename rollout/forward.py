"""Sampler forward passes on packed weights: prompt prefill and one-token decode steps.

What: the same decoder as `moe.model.MoEDecoder` (RMSNorm, GQA attention with RoPE and optional
QK-norm, softmax/sigmoid top-k routers, SwiGLU experts, shared experts, dense prefix layers), written
for the sampler's packed layout (`rollout.packed_weights`) and its slot KV cache
(`rollout.kv_cache`).

Why not call `MoEDecoder` directly: decoding on the CPU is bound by per-op overhead and wasted
expert FLOPs. Here
  * decode attention reads the slot cache in its transposed-key layout (why: `rollout.kv_cache`)
    over a length-bucketed prefix chosen by the caller;
  * experts run through a capacity dispatch whose capacity is picked per layer and per step from
    a small set of tiers (`caps`) by the actual maximum expert load, with the last tier dropless
    (capacity = tokens). So no token is ever dropped, and the common case pays ~1.25-1.5x the ideal
    expert FLOPs instead of E/k x (dropless) -- `lax.switch` runs only the chosen branch;
  * deterministic mode passes a single tier (dropless), so a row's arithmetic never depends on
    what else is in the batch (see rollout/README.md).

On a mesh (an engine sharded by `rollout.placement`, traced under its `jax.set_mesh`) the same
code runs partitioned: the fused matrices are in tensor groups (`rollout.packed_weights`), so
attention is per tensor shard of heads; the routed experts go through moe's expert parallelism
(`_sharded_experts`: all-to-all over the expert axis, dropless) instead of the tiers; logits are
gathered whole before sampling.

Numerics follow the model exactly in formula (float32 norms, router and softmax, the same RoPE, the
k contributions summed in order in float32); only matmul blocking differs, which the agreement
measurement in `rollout.agreement` quantifies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe import expert_parallel
from moe import layers as moe_layers
from moe import sharding as moe_sharding
from moe.config import ModelConfig
from rollout import kv_cache
from rollout import placement

_NEG_INF = -1e30


def rms_norm(x, scale, eps):
  """RMSNorm in float32, returned in x's dtype (as moe.layers.RMSNorm)."""
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return (scale * (x32 * jax.lax.rsqrt(var + eps))).astype(x.dtype)


def capacity_tiers(num_tokens: int, cfg: ModelConfig, factors, deterministic: bool) -> tuple:
  """Sorted capacities for `num_tokens` routed tokens; the last is dropless (= num_tokens)."""
  if deterministic:
    return (num_tokens,)
  even = num_tokens * cfg.num_experts_per_tok / cfg.num_experts
  caps = {min(num_tokens, max(1, int(-(-even * f // 1)))) for f in factors}
  caps.add(num_tokens)
  return tuple(sorted(caps))


def _dispatch(x, idx, gates, w_gu, w_d, cap: int):
  """Capacity dispatch by gathers: x [N, D], idx/gates [N, k] -> [N, D] (float32 combine).

  w_gu: [E, D, G, 2 I / G] (gate and up side by side per tensor group, `rollout.packed_weights`),
  w_d: [E, I, D].
  """
  n, k = idx.shape
  e, d, groups = w_gu.shape[0], x.shape[-1], w_gu.shape[2]
  inter = w_d.shape[1] // groups
  flat = idx.reshape(-1)
  onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)
  rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1  # order of arrival per expert
  keep = rank < cap
  dest = jnp.where(keep, flat * cap + rank, e * cap)
  src = jnp.full((e * cap + 1,), n, jnp.int32).at[dest].set(
      jnp.arange(n * k, dtype=jnp.int32) // k, mode="drop")[: e * cap]
  xp = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
  buf = xp[src].reshape(e, cap, d)
  gu = jnp.einsum("ecd,edi->eci", buf, w_gu.reshape(e, d, -1)).reshape(e, cap, groups, -1)
  h = (jax.nn.silu(gu[..., :inter]) * gu[..., inter:]).reshape(e, cap, -1)
  y = jnp.einsum("eci,eid->ecd", h, w_d).reshape(e * cap, d)
  y = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[dest].reshape(n, k, d)
  w = jnp.where(keep.reshape(n, k), gates, 0.0).astype(jnp.float32)
  return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), w).astype(x.dtype)


def _route(x, lp, cfg: ModelConfig):
  """Router math of moe.router.Router (float32): -> (idx [N, k] int32, gates [N, k] float32)."""
  logits = x.astype(jnp.float32) @ lp["router_w"]
  if cfg.router_type == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
  select = scores + lp["router_b"] if "router_b" in lp else scores
  _, idx = jax.lax.top_k(select, cfg.num_experts_per_tok)
  gates = jnp.take_along_axis(scores, idx, axis=-1)
  if cfg.norm_topk_prob:
    gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
  return idx, gates * cfg.routed_scaling_factor


def _swiglu(x, w_gu, w_d):
  """SwiGLU on x [.., D] with w_gu [D, G, 2 I / G] (per tensor group: gate, up), w_d [I, D]."""
  groups = w_gu.shape[1]
  inter = w_d.shape[0] // groups
  gu = (x @ w_gu.reshape(w_gu.shape[0], -1)).reshape(*x.shape[:-1], groups, 2 * inter)
  return (jax.nn.silu(gu[..., :inter]) * gu[..., inter:]).reshape(*x.shape[:-1], -1) @ w_d


def _split_gate_up(w_gu):
  """[E, D, G, 2 I / G] -> (gate, up), each [E, D, I] in moe's expert layout (`moe.experts`)."""
  e, d, groups, two = w_gu.shape
  inter = two // 2
  return (w_gu[..., :inter].reshape(e, d, groups * inter),
          w_gu[..., inter:].reshape(e, d, groups * inter))


def _sharded_experts(x, idx, gates, lp, mesh):
  """Routed experts of a sharded engine: moe's expert parallelism over the active mesh.

  An expert axis larger than one exchanges each token's k copies by all-to-all with the shards
  holding their experts (`moe.expert_parallel.routed_experts`, dropless: "padded" on the CPU,
  "ragged" on GPU/TPU); with only a tensor axis, every device runs its mlp columns of all
  experts on all tokens and one psum adds them (`psum_experts`). Both are dropless, so no token
  is dropped, as with the single-device tiers.
  """
  wg, wu = _split_gate_up(lp["experts_gu"])
  local = expert_parallel.dropless_local_experts("auto", x.dtype)
  if moe_sharding.axes_size(mesh, moe_sharding.mesh_axes("exp")) == 1:
    return expert_parallel.psum_experts(x, idx, gates, wg, wu, lp["experts_d"],
                                        local_experts=local)
  return expert_parallel.routed_experts(
      x, idx, gates, wg, wu, lp["experts_d"],
      exchange=expert_parallel.choose_exchange(jax.default_backend(), None),
      local_experts=local, dtype=x.dtype)


def ffn(x, lp, cfg: ModelConfig, caps: tuple):
  """Feed-forward of one layer on flat tokens x [N, D] -> (y [N, D], idx [N, k] or None)."""
  if "mlp_gu" in lp:
    return _swiglu(x, lp["mlp_gu"], lp["mlp_d"]), None
  with jax.named_scope("router"):
    idx, gates = _route(x, lp, cfg)
  w_gu, w_d = lp["experts_gu"], lp["experts_d"]
  mesh = placement.active_mesh()
  with jax.named_scope("experts"):
    if mesh is not None:
      y = _sharded_experts(x, idx, gates, lp, mesh)
    elif len(caps) == 1:
      y = _dispatch(x, idx, gates, w_gu, w_d, caps[0])
    else:
      counts = jnp.sum(jax.nn.one_hot(idx.reshape(-1), cfg.num_experts, dtype=jnp.int32), axis=0)
      tier = jnp.searchsorted(jnp.asarray(caps, jnp.int32), jnp.max(counts))
      branches = [lambda x, idx, g, c=c: _dispatch(x, idx, g, w_gu, w_d, c) for c in caps]
      y = jax.lax.switch(jnp.minimum(tier, len(caps) - 1), branches, x, idx, gates)
  if "shared_gu" in lp:
    y = y + _swiglu(x, lp["shared_gu"], lp["shared_d"]).astype(y.dtype)
  return y, idx


def _qkv(x, lp, cfg: ModelConfig, positions):
  """x [B, T, D] -> q [B, T, H, hd], k, v [B, T, KV, hd] (RoPE and QK-norm applied)."""
  h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  b, t = x.shape[:2]
  w = lp["wqkv"]  # [D, G, (H + 2 KV) / G * hd]: per tensor group, its q, k and v heads
  groups = w.shape[1]
  qkv = (x @ w.reshape(w.shape[0], -1)).reshape(b, t, groups, -1)
  hq, hk = h // groups * hd, kv // groups * hd
  q = qkv[..., :hq].reshape(b, t, h, hd)
  k = qkv[..., hq:hq + hk].reshape(b, t, kv, hd)
  v = qkv[..., hq + hk:].reshape(b, t, kv, hd)
  if "q_norm" in lp:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  q = moe_layers.rope(q, positions, cfg.rope_theta)
  k = moe_layers.rope(k, positions, cfg.rope_theta)
  return q, k, v


def _head(h, params, cfg: ModelConfig):
  head = params["head"]
  logits = jnp.dot(h.astype(head.dtype), head, preferred_element_type=jnp.float32).astype(
      jnp.float32)
  # Sharded over the vocabulary on a mesh: gathered whole, so sampling (sorts, cumulative sums
  # over the vocabulary) runs replicated and exactly as on one device.
  return placement.constrain(logits, (None, None))


def decode_step(params, cfg: ModelConfig, tokens, positions, cache_k, cache_v, caps: tuple):
  """One decode step for every slot.

  Args:
    params: packed weights.
    cfg: model config.
    tokens: int32 [B] input token of each slot.
    positions: int32 [B] its absolute position (< cache length).
    cache_k: tuple (per layer) of [B, KV, hd, S] (keys transposed); cache_v: [B, KV, S, hd]
      (`rollout.kv_cache`). Entry s of a row is visible to the query when s <= position; stale
      entries past it are selected out of both scores and values, so whatever they hold (NaN
      or inf included) never reaches the outputs.
    caps: expert capacity tiers for B tokens (`capacity_tiers`).

  Returns:
    (logits float32 [B, V], routing int32 [moe_layers, B, k], new cache_k, new cache_v).
  """
  b = tokens.shape[0]
  kvh, hd = cfg.num_kv_heads, cfg.resolved_head_dim
  g = cfg.num_heads // kvh
  dt = params["embed"].dtype
  x = jnp.take(params["embed"], tokens, axis=0)  # [B, D]
  s_len = cache_v[0].shape[2]
  mask = jnp.arange(s_len)[None, :] <= positions[:, None]  # [B, S]
  new_k, new_v, routing = [], [], []
  # The named scopes only label the compiled ops (tools/profile_sampler.py groups time by them).
  for li, lp in enumerate(params["layers"]):
    with jax.named_scope("qkv"):
      hx = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
      q, k, v = _qkv(hx[:, None], lp, cfg, positions[:, None])
    with jax.named_scope("kv_write"):
      ck, cv = kv_cache.write_step(cache_k[li], cache_v[li], positions, k[:, 0], v[:, 0])
    new_k.append(ck)
    new_v.append(cv)
    with jax.named_scope("attention"):
      qg = q[:, 0].reshape(b, kvh, g, hd)
      scores = jnp.sum(qg.astype(jnp.float32)[..., None] * ck.astype(jnp.float32)[:, :, None],
                       axis=-2) * (hd ** -0.5)  # [B, KV, G, S]
      scores = jnp.where(mask[:, None, None, :], scores, _NEG_INF)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      # Probability 0 does not hide a value: 0 x NaN (or inf) is NaN, and entries past a
      # position hold whatever an earlier occupant or earlier weights left there. Select them
      # out of the values (costs ~4-7% of a decode step at batch 64, hidden 256, 160 positions).
      vis_v = jnp.where(mask[:, None, :, None], cv.astype(dt), jnp.zeros((), dt))
      att = jnp.einsum("bkgs,bksd->bkgd", probs, vis_v).reshape(b, -1)
    with jax.named_scope("out_proj"):
      x = x + (att @ lp["wo"]).astype(x.dtype)
    with jax.named_scope("ffn"):
      f, idx = ffn(rms_norm(x, lp["ffn_norm"], cfg.rms_norm_eps), lp, cfg, caps)
      x = x + f.astype(x.dtype)
    if idx is not None:
      routing.append(idx)
  with jax.named_scope("lm_head"):
    logits = _head(rms_norm(x, params["final_norm"], cfg.rms_norm_eps), params, cfg)
  routing = (jnp.stack(routing) if routing
             else jnp.zeros((0, b, cfg.num_experts_per_tok), jnp.int32))
  return logits, routing, tuple(new_k), tuple(new_v)


def prefill(params, cfg: ModelConfig, tokens, lengths, caps: tuple):
  """Runs whole prompts (from position 0) and returns what decoding needs.

  Args:
    params: packed weights.
    cfg: model config.
    tokens: int32 [P, L] prompts, right-padded (pad positions produce unused cache entries).
    lengths: int32 [P] real prompt lengths (>= 1).
    caps: expert capacity tiers for P * L tokens.

  Returns:
    (last_logits float32 [P, V] at each prompt's last token, routing int32 [moe_layers, P, L, k],
     ks: per-layer tuple of [P, KV, hd, L] (transposed, as the decode cache), vs: of
     [P, KV, L, hd]).
  """
  p, t = tokens.shape
  kvh, hd = cfg.num_kv_heads, cfg.resolved_head_dim
  g = cfg.num_heads // kvh
  dt = params["embed"].dtype
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
  causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(key)]
  real = positions < lengths[:, None]  # [P, T]
  x = jnp.take(params["embed"], tokens, axis=0)  # [P, T, D]
  ks, vs, routing = [], [], []
  for lp in params["layers"]:
    hx = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = _qkv(hx, lp, cfg, positions)
    # Pad positions' values are zeroed (a select, not a 0-probability product) so nothing past
    # a prompt's length reaches its outputs, and the cache entries past it hold zeros.
    v = jnp.where(real[:, :, None, None], v, jnp.zeros((), v.dtype))
    ks.append(jnp.transpose(k, (0, 2, 3, 1)))
    vs.append(jnp.swapaxes(v, 1, 2))
    qg = q.reshape(p, t, kvh, g, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(causal[None, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    att = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(p, t, -1)
    x = x + (att @ lp["wo"]).astype(x.dtype)
    hf = rms_norm(x, lp["ffn_norm"], cfg.rms_norm_eps).reshape(p * t, -1)
    f, idx = ffn(hf, lp, cfg, caps)
    x = x + f.reshape(p, t, -1).astype(x.dtype)
    if idx is not None:
      routing.append(idx.reshape(p, t, -1))
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
  logits = _head(rms_norm(last, params["final_norm"], cfg.rms_norm_eps), params, cfg)
  routing = (jnp.stack(routing) if routing
             else jnp.zeros((0, p, t, cfg.num_experts_per_tok), jnp.int32))
  return logits, routing, tuple(ks), tuple(vs)
