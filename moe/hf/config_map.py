"""config.json <-> ModelConfig for Mixtral and Qwen3-MoE.

Import accepts what transformers 5.24 writes and what older versions wrote: the RoPE base from
`rope_parameters.rope_theta` (transformers 5) or a top-level `rope_theta` (4.x); the expert count
from `num_experts` (Qwen3 as published) or `num_local_experts` (Mixtral, and Qwen3 as 5.24 writes
it); the dtype from `dtype` (5.x) or `torch_dtype` (4.x). Export writes both spellings of the RoPE
base and dtype so old and new readers agree.

Anything our model cannot represent is a `CheckpointError`, never silently dropped: RoPE scaling,
sliding-window attention, attention biases, activations other than SiLU, and (Qwen3) a dense/MoE
layer pattern from `decoder_sparse_step` / `mlp_only_layers` that is not "the first k layers
dense".
"""

from __future__ import annotations

from typing import Any, Mapping

from moe.config import ModelConfig
from moe.hf.errors import CheckpointError
from moe.hf.names import ARCHITECTURES, arch_spec

_DTYPES = ("float32", "bfloat16", "float16")


def architecture_of(hf: Mapping[str, Any], where: str = "config.json") -> str:
  """The architecture named by `architectures` (or implied by `model_type`)."""
  archs = hf.get("architectures") or []
  if isinstance(archs, str):
    archs = [archs]
  if archs:
    if len(archs) != 1:
      raise CheckpointError(f"{where}: expected one architecture, got {archs}")
    arch = archs[0]
  else:
    by_type = {s.model_type: a for a, s in ARCHITECTURES.items()}
    if hf.get("model_type") not in by_type:
      raise CheckpointError(f"{where}: no `architectures` and unknown model_type "
                            f"{hf.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}")
    arch = by_type[hf["model_type"]]
  spec = arch_spec(arch, where)
  if hf.get("model_type", spec.model_type) != spec.model_type:
    raise CheckpointError(f"{where}: model_type {hf.get('model_type')!r} does not match "
                          f"architecture {arch} (expected {spec.model_type!r})")
  return arch


def dtype_of(hf: Mapping[str, Any]):
  """The checkpoint's declared parameter dtype name, or None when absent or unsupported."""
  d = hf.get("dtype") or hf.get("torch_dtype")
  if isinstance(d, str):
    d = d.replace("torch.", "")
  return d if d in _DTYPES else None


def _rope_theta(hf, where):
  rp = hf.get("rope_parameters")
  if isinstance(rp, Mapping) and "full_attention" in rp and "rope_theta" not in rp:
    rp = rp["full_attention"]  # per-layer-type form
  if isinstance(rp, Mapping):
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
      raise CheckpointError(f"{where}: rope_type {rope_type!r} is not supported (only default)")
    if "rope_theta" in rp:
      return float(rp["rope_theta"])
  scaling = hf.get("rope_scaling")
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    raise CheckpointError(f"{where}: rope_scaling {scaling} is not supported")
  if "rope_theta" in hf:
    return float(hf["rope_theta"])
  raise CheckpointError(f"{where}: no RoPE base (rope_parameters.rope_theta or rope_theta)")


def _req(hf, key, where):
  if key not in hf or hf[key] is None:
    raise CheckpointError(f"{where}: missing required field {key!r}")
  return hf[key]


def _dense_prefix(hf, num_layers, num_experts, where) -> int:
  """Qwen3's per-layer dense/MoE choice, reduced to a count of leading dense layers."""
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  only = set(int(i) for i in (hf.get("mlp_only_layers") or []))
  dense = [i for i in range(num_layers)
           if i in only or not (num_experts > 0 and (i + 1) % step == 0)]
  if dense != list(range(len(dense))):
    raise CheckpointError(
        f"{where}: dense layers {dense} (from decoder_sparse_step={step}, mlp_only_layers="
        f"{sorted(only)}) are not a prefix of the layers; only the first k layers may be dense")
  return len(dense)


def _head_dim(hf, heads):
  """An explicit head_dim, or None when it is the default hidden_size // num_heads."""
  hd = hf.get("head_dim")
  if not hd or int(hd) == int(hf.get("hidden_size", 0)) // heads:
    return None
  return int(hd)


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
  """A ModelConfig from a Mixtral or Qwen3-MoE config.json dict.

  param_dtype/dtype come from the config's `dtype`/`torch_dtype` (float32 when absent).
  """
  arch = architecture_of(hf, where)
  spec = ARCHITECTURES[arch]
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
  if hf.get("attention_bias"):
    raise CheckpointError(f"{where}: attention_bias=true is not supported")
  if hf.get("use_sliding_window"):
    raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
  max_pos = int(hf.get("max_position_embeddings", 4096))
  window = hf.get("sliding_window")
  # Qwen3 has an explicit switch (checked above); Mixtral applies any window that is set.
  if "use_sliding_window" not in hf and window is not None and int(window) < max_pos:
    raise CheckpointError(f"{where}: sliding_window={window} < max_position_embeddings="
                          f"{max_pos} is not supported (full attention only)")
  heads = int(_req(hf, "num_attention_heads", where))
  num_layers = int(_req(hf, "num_hidden_layers", where))
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise CheckpointError(f"{where}: missing num_experts / num_local_experts")
  num_experts = int(num_experts)
  if spec.dense_layers:
    first_k_dense = _dense_prefix(hf, num_layers, num_experts, where)
    moe_inter = int(_req(hf, "moe_intermediate_size", where))
    norm_topk = bool(hf.get("norm_topk_prob", False))
  else:
    first_k_dense = 0
    moe_inter = int(_req(hf, "intermediate_size", where))
    norm_topk = True  # Mixtral always renormalises the top-k softmax weights
  dt = dtype_of(hf) or "float32"
  try:
    return ModelConfig(
        vocab_size=int(_req(hf, "vocab_size", where)),
        hidden_size=int(_req(hf, "hidden_size", where)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=_head_dim(hf, heads),
        intermediate_size=int(hf.get("intermediate_size") or moe_inter),
        moe_intermediate_size=moe_inter,
        num_experts=num_experts,
        num_experts_per_tok=int(_req(hf, "num_experts_per_tok", where)),
        first_k_dense=first_k_dense,
        router_type="softmax",
        norm_topk_prob=norm_topk,
        rope_theta=_rope_theta(hf, where),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=spec.qk_norm,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_pos,
        param_dtype=dt,
        dtype=dt,
        load_balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
  except ValueError as e:  # ModelConfig's own validation
    raise CheckpointError(f"{where}: {e}") from e


def config_to_hf(cfg: ModelConfig, arch: str) -> dict:
  """A config.json dict for `cfg` as architecture `arch`.

  Raises CheckpointError when `cfg` uses something the architecture cannot express (sigmoid
  routers, shared experts, routed scaling, dense layers in Mixtral, a qk-norm mismatch).
  """
  spec = arch_spec(arch, "config_to_hf")

  def need(cond, msg):
    if not cond:
      raise CheckpointError(f"cannot export as {arch}: {msg}")

  need(cfg.router_type == "softmax", f"router_type {cfg.router_type!r} (softmax only)")
  need(cfg.num_shared_experts == 0, "shared experts are not part of this architecture")
  need(cfg.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
  need(cfg.qk_norm == spec.qk_norm, f"qk_norm must be {spec.qk_norm}")
  need(spec.dense_layers or cfg.first_k_dense == 0, "dense layers (first_k_dense > 0)")
  need(spec.dense_layers or cfg.norm_topk_prob, "Mixtral always renormalises top-k weights")
  out = {
      "architectures": [arch],
      "model_type": spec.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "num_experts_per_tok": cfg.num_experts_per_tok,
      "router_aux_loss_coef": cfg.load_balance_loss_weight,
      "initializer_range": cfg.init_std,
      "attention_dropout": 0.0,
      "use_cache": True,
      "dtype": cfg.param_dtype,
      "torch_dtype": cfg.param_dtype,
  }
  if spec.dense_layers:
    out.update({
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense)),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    })
  else:
    out.update({
        "num_local_experts": cfg.num_experts,
        "intermediate_size": cfg.moe_intermediate_size,
        "sliding_window": None,
    })
  return out
