"""Model hyperparameters: one frozen dataclass of explicit values.

Model families (Mixtral, Qwen3-MoE, DeepSeek-V3-like) differ only by these values; layers receive
the fields they need, never the model's name. Presets live in `moe/configs/*.gin`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

ROUTER_TYPES = ("softmax", "sigmoid")
EXPERT_IMPLS = ("auto", "ragged", "dispatch", "grouped")
EXPERT_DISPATCHES = ("all_to_all", "psum")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyperparameters of the MoE decoder.

  Attributes:
    vocab_size: vocabulary size.
    hidden_size: model width (`embed` axis).
    num_layers: decoder layers.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    head_dim: per-head width; defaults to hidden_size // num_heads.
    intermediate_size: hidden width of the dense feed-forward layers (first_k_dense layers).
    moe_intermediate_size: hidden width of each routed expert.
    num_experts: routed experts per MoE layer.
    num_experts_per_tok: experts each token uses (k).
    num_shared_experts: always-on experts added to every token (DeepSeek/Qwen2-MoE style).
    shared_intermediate_size: hidden width of the shared expert block (defaults to
      num_shared_experts * moe_intermediate_size).
    first_k_dense: the first this many layers use a dense feed-forward layer instead of MoE.
    router_type: "softmax" (Mixtral / Qwen: softmax over experts, top-k) or "sigmoid"
      (DeepSeek-V3: sigmoid scores, top-k of score + bias, the bias steered aux-loss-free).
    norm_topk_prob: renormalise the k gate weights to sum to one.
    routed_scaling_factor: multiplies routed-expert output (DeepSeek-V3 uses 2.5).
    rope_theta: RoPE base.
    rms_norm_eps: RMSNorm epsilon.
    qk_norm: RMSNorm on each query/key head (Qwen3).
    tie_word_embeddings: share the embedding matrix with the LM head.
    fp32_lm_head: compute the LM head matmul in float32 whatever the compute dtype.
    max_seq_len: longest sequence the model is used with (sizes caches and RoPE checks).
    attention_query_chunk: query rows per causal chunk of the full-sequence attention
      (moe/attention.py, training and scoring): chunk i is scored against the keys up to its
      end only, so the blocks above the diagonal are never computed; 0 scores the whole
      [T, T] square. Results are the same either way.
    param_dtype: storage dtype of parameters ("float32", "bfloat16").
    dtype: compute dtype of activations and matmuls.
    expert_impl: "ragged" (dropless grouped matmul, `jax.lax.ragged_dot`; efficient on GPU/TPU),
      "dispatch" (sort into per-expert capacity buffers, batched matmul; fast on CPU),
      "grouped" (dropless, expert groups padded to blocks, batched matmul; moe.experts), or
      "auto" (ragged off the CPU; on the CPU dispatch with a capacity factor, and dropless the
      cheaper of dispatch and grouped for the layer's token count).
    capacity_factor: per-expert capacity of the dispatch path as a multiple of the even share
      (tokens * k / experts). None means dropless (capacity = all tokens). Under expert
      parallelism it sizes the all-to-all's per-shard buffers instead (moe/expert_parallel.py).
    expert_dispatch: how routed experts run on a mesh with an expert axis > 1: "all_to_all"
      (expert parallelism: each token goes only to the shards of its experts,
      moe/expert_parallel.py) or "psum" (every expert shard sees every token of its batch
      shard, partial outputs summed over (expert, tensor); a benchmark baseline).
    load_balance_loss_weight: weight of the Switch-style load-balancing loss.
    router_z_loss_weight: weight of the router z-loss (mean squared logsumexp of router logits).
    router_bias_update_rate: step size of the aux-loss-free bias update (sigmoid routers).
    init_std: standard deviation of the normal initialiser.
  """

  vocab_size: int = 259
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: Optional[int] = None
  intermediate_size: int = 128
  moe_intermediate_size: int = 64
  num_experts: int = 4
  num_experts_per_tok: int = 2
  num_shared_experts: int = 0
  shared_intermediate_size: Optional[int] = None
  first_k_dense: int = 0
  router_type: str = "softmax"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qk_norm: bool = False
  tie_word_embeddings: bool = False
  fp32_lm_head: bool = True
  max_seq_len: int = 512
  attention_query_chunk: int = 128
  param_dtype: str = "float32"
  dtype: str = "float32"
  expert_impl: str = "auto"
  capacity_factor: Optional[float] = None
  expert_dispatch: str = "all_to_all"
  load_balance_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.001
  router_bias_update_rate: float = 1e-3
  init_std: float = 0.02

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"ModelConfig: {msg}")
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "num_experts", "num_experts_per_tok", "max_seq_len"):
      need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
    need(self.num_heads % self.num_kv_heads == 0,
         f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    need(self.num_experts_per_tok <= self.num_experts,
         f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})")
    need(0 <= self.first_k_dense <= self.num_layers,
         f"first_k_dense ({self.first_k_dense}) must lie in [0, num_layers]")
    need(self.router_type in ROUTER_TYPES, f"router_type must be one of {ROUTER_TYPES}")
    need(self.expert_impl in EXPERT_IMPLS, f"expert_impl must be one of {EXPERT_IMPLS}")
    need(self.expert_dispatch in EXPERT_DISPATCHES,
         f"expert_dispatch must be one of {EXPERT_DISPATCHES}")
    need(self.capacity_factor is None or self.capacity_factor > 0,
         "capacity_factor must be positive or None")
    need(self.attention_query_chunk >= 0, "attention_query_chunk must be >= 0")
    need(self.resolved_head_dim % 2 == 0, "head_dim must be even (RoPE)")
    for f in ("param_dtype", "dtype"):
      need(getattr(self, f) in ("float32", "bfloat16", "float16"),
           f"{f} must be float32, bfloat16 or float16")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.first_k_dense

  @property
  def resolved_shared_intermediate_size(self) -> int:
    return self.shared_intermediate_size or self.num_shared_experts * self.moe_intermediate_size

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def routing_dtype(self):
    """The compact integer dtype of recorded routing."""
    return jnp.uint8 if self.num_experts <= 256 else jnp.int16

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)
