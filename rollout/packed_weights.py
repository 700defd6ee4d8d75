"""The sampler's weight layout: flat model weights packed for fast decoding.

What: `pack(flat, cfg, dtype)` turns the flat weights (`moe.params.flatten` names) into a pytree
laid out for the decode forward passes in `rollout.forward`:
  * q, k and v are fused into one [D, (H + 2 KV) * head_dim] matrix and o is flattened to
    [H * head_dim, D], so attention needs two matmuls instead of four;
  * each SwiGLU's gate and up are fused ([.., D, 2I]), so experts need two batched matmuls;
  * the LM head is materialised as [D, V] (the embedding's transpose when tied).

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


def pack(flat: Mapping[str, object], cfg: ModelConfig, dtype: Optional[str] = None) -> dict:
  """Packs flat weights into the sampler layout (jax arrays on the default device).

  Args:
    flat: {name: array} as produced by `moe.params.flatten` (numpy or jax arrays).
    cfg: the model's config.
    dtype: compute dtype of the packed weights; None keeps `cfg.dtype`. Norm scales and the
      router always stay float32 (the model computes them in float32).

  Returns:
    A pytree of jax arrays (see the module docstring).
  """
  validate(flat, cfg)
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
        "wqkv": np.concatenate([a(p + "attn/q").reshape(d, -1), a(p + "attn/k").reshape(d, -1),
                                a(p + "attn/v").reshape(d, -1)], axis=1),
        "wo": a(p + "attn/o").reshape(-1, d),
    }
    if cfg.qk_norm:
      layer["q_norm"] = a(p + "attn/q_norm/scale", np.float32)
      layer["k_norm"] = a(p + "attn/k_norm/scale", np.float32)
    if li < cfg.first_k_dense:
      layer["mlp_gu"] = np.concatenate([a(p + "ffn/gate"), a(p + "ffn/up")], axis=1)
      layer["mlp_d"] = a(p + "ffn/down")
    else:
      layer["router_w"] = a(p + "ffn/router/weight", np.float32)
      if cfg.router_type == "sigmoid":
        layer["router_b"] = a(p + "ffn/router/bias", np.float32)
      layer["experts_gu"] = np.concatenate([a(p + "ffn/experts/gate"), a(p + "ffn/experts/up")],
                                           axis=2)
      layer["experts_d"] = a(p + "ffn/experts/down")
      if cfg.num_shared_experts > 0:
        layer["shared_gu"] = np.concatenate([a(p + "ffn/shared/gate"), a(p + "ffn/shared/up")],
                                            axis=1)
        layer["shared_d"] = a(p + "ffn/shared/down")
    out["layers"].append(layer)
  return jax.tree.map(jnp.asarray, out)
