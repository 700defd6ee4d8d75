"""The sampler's weight layout: flat model weights packed for fast decoding.

What: `pack(flat, cfg, dtype)` turns the flat weights (`moe.params.flatten` names) into a pytree
laid out for the decode forward passes in `rollout.forward`:
  * q, k and v are fused into one [D, G, (H + 2 KV) / G * head_dim] matrix and o is flattened to
    [H * head_dim, D], so attention needs two matmuls instead of four;
  * each SwiGLU's gate and up are fused ([.., D, G, 2I / G]), so experts need two batched
    matmuls;
  * the LM head is materialised as [D, V] (the embedding's transpose when tied).
G is the number of tensor-parallel groups (`groups`, 1 on one device): group g holds heads
[g H/G, (g+1) H/G), kv heads [g KV/G, (g+1) KV/G) and intermediate columns [g I/G, (g+1) I/G)
of gate and up side by side. Split over a mesh's tensor axis on the G dimension
(`rollout.placement`), each device then holds whole heads with their kv heads and matching gate
and up columns, so attention and the SwiGLU product are local and only the output projections'
sums cross devices. With G = 1 the layout is the fused one of a single device.

Why a separate layout: on the CPU the sampler is bound by per-op overhead and matmul count, and the
fused layout is ~20% faster per decode step. Packing is a pure function of the flat weights, so a
weight swap packs the new weights off the serving loop and then swaps one pytree reference
(`rollout.engine.Engine.swap_weights`). The pytree holds jax arrays; the flat dict stays the
interchange format with `sync/` and the learner.
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moe.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{flat name: shape} of every variable of a `MoEDecoder` with this config."""
  d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  e, i_moe, i_dense = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
  out = {"embed": (cfg.vocab_size, d), "final_norm/scale": (d,)}
  if not cfg.tie_word_embeddings:
    out["lm_head"] = (d, cfg.vocab_size)
  for li in range(cfg.num_layers):
    p = f"layers/{li}/"
    out.update({p + "attn_norm/scale": (d,), p + "ffn_norm/scale": (d,),
                p + "attn/q": (d, h, hd), p + "attn/k": (d, kv, hd), p + "attn/v": (d, kv, hd),
                p + "attn/o": (h, hd, d)})
    if cfg.qk_norm:
      out[p + "attn/q_norm/scale"] = (hd,)
      out[p + "attn/k_norm/scale"] = (hd,)
    if li < cfg.first_k_dense:
      out.update({p + "ffn/gate": (d, i_dense), p + "ffn/up": (d, i_dense),
                  p + "ffn/down": (i_dense, d)})
      continue
    out.update({p + "ffn/router/weight": (d, e), p + "ffn/experts/gate": (e, d, i_moe),
                p + "ffn/experts/up": (e, d, i_moe), p + "ffn/experts/down": (e, i_moe, d)})
    if cfg.router_type == "sigmoid":
      out[p + "ffn/router/bias"] = (e,)
    if cfg.num_shared_experts > 0:
      i_sh = cfg.resolved_shared_intermediate_size
      out.update({p + "ffn/shared/gate": (d, i_sh), p + "ffn/shared/up": (d, i_sh),
                  p + "ffn/shared/down": (i_sh, d)})
  return out


def validate(flat: Mapping[str, object], cfg: ModelConfig) -> None:
  """Raises ValueError naming missing, unknown or misshapen weights."""
  want = expected_shapes(cfg)
  missing = sorted(set(want) - set(flat))
  unknown = sorted(set(flat) - set(want))
  if missing or unknown:
    raise ValueError(f"weights do not match the served model: missing {missing[:5]}, "
                     f"unknown {unknown[:5]}")
  for name, shape in want.items():
    got = tuple(np.shape(flat[name]))
    if got != shape:
      raise ValueError(f"weight {name} has shape {got}, the served model needs {shape}")


def check_groups(cfg: ModelConfig, groups: int) -> None:
  """Raises ValueError unless `groups` tensor groups split every head and intermediate dim."""
  if groups < 1:
    raise ValueError(f"tensor groups must be >= 1, got {groups}")
  dims = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads}
  if cfg.first_k_dense:
    dims["intermediate_size"] = cfg.intermediate_size
  if cfg.num_layers > cfg.first_k_dense:
    dims["moe_intermediate_size"] = cfg.moe_intermediate_size
    if cfg.num_shared_experts > 0:
      dims["shared intermediate size"] = cfg.resolved_shared_intermediate_size
  bad = {k: v for k, v in dims.items() if v % groups}
  if bad:
    raise ValueError(f"a tensor axis of {groups} must divide the heads and intermediate sizes; "
                     f"it does not divide {bad}")


def _grouped(parts, groups: int):
  """[.., X_i] arrays side by side per group: [.., G, sum_i X_i / G] (group g: each part's g-th
  slice of its last dim, in order)."""
  split = [p.reshape(*p.shape[:-1], groups, p.shape[-1] // groups) for p in parts]
  return np.concatenate(split, axis=-1)


def pack_host(flat: Mapping[str, object], cfg: ModelConfig, dtype: Optional[str] = None,
              groups: int = 1) -> dict:
  """Packs flat weights into the sampler layout as host (numpy) arrays.

  Args:
    flat: {name: array} as produced by `moe.params.flatten` (numpy or jax arrays).
    cfg: the model's config.
    dtype: compute dtype of the packed weights; None keeps `cfg.dtype`. Norm scales and the
      router always stay float32 (the model computes them in float32).
    groups: tensor-parallel groups G of the fused matrices (module docstring); must divide the
      heads, kv heads and intermediate sizes.

  Returns:
    A pytree of numpy arrays (see the module docstring): `rollout.placement` puts it on the
    engine's devices, each device receiving only its shards.
  """
  validate(flat, cfg)
  check_groups(cfg, groups)
  dt = jnp.dtype(dtype or cfg.dtype)
  hdt = jnp.float32 if cfg.fp32_lm_head else dt

  def a(name, to=dt):
    return np.asarray(flat[name]).astype(to, copy=False)

  d = cfg.hidden_size
  embed = a("embed")
  head = embed.T if cfg.tie_word_embeddings else a("lm_head")
  out = {"embed": embed, "head": np.ascontiguousarray(head.astype(hdt)),
         "final_norm": a("final_norm/scale", np.float32), "layers": []}
  for li in range(cfg.num_layers):
    p = f"layers/{li}/"
    layer = {
        "attn_norm": a(p + "attn_norm/scale", np.float32),
        "ffn_norm": a(p + "ffn_norm/scale", np.float32),
        "wqkv": _grouped([a(p + "attn/q").reshape(d, -1), a(p + "attn/k").reshape(d, -1),
                          a(p + "attn/v").reshape(d, -1)], groups),
        "wo": a(p + "attn/o").reshape(-1, d),
    }
    if cfg.qk_norm:
      layer["q_norm"] = a(p + "attn/q_norm/scale", np.float32)
      layer["k_norm"] = a(p + "attn/k_norm/scale", np.float32)
    if li < cfg.first_k_dense:
      layer["mlp_gu"] = _grouped([a(p + "ffn/gate"), a(p + "ffn/up")], groups)
      layer["mlp_d"] = a(p + "ffn/down")
    else:
      layer["router_w"] = a(p + "ffn/router/weight", np.float32)
      if cfg.router_type == "sigmoid":
        layer["router_b"] = a(p + "ffn/router/bias", np.float32)
      layer["experts_gu"] = _grouped([a(p + "ffn/experts/gate"), a(p + "ffn/experts/up")],
                                     groups)
      layer["experts_d"] = a(p + "ffn/experts/down")
      if cfg.num_shared_experts > 0:
        layer["shared_gu"] = _grouped([a(p + "ffn/shared/gate"), a(p + "ffn/shared/up")],
                                      groups)
        layer["shared_d"] = a(p + "ffn/shared/down")
    out["layers"].append(layer)
  return out


def pack(flat: Mapping[str, object], cfg: ModelConfig, dtype: Optional[str] = None) -> dict:
  """`pack_host` with one group, as jax arrays on the default device (one-device users: tests,
  tools; an engine places its weights through `rollout.placement`)."""
  return jax.tree.map(jnp.asarray, pack_host(flat, cfg, dtype))
