"""Model FLOPs and model-FLOPs utilisation (MFU) of the learner.

Training FLOPs per token follow the PaLM appendix-B convention:
    6 * N_active  +  12 * L * H * D_head * T
where N_active counts the parameters every token multiplies with (attention, dense feed-forward,
shared experts, the k routed experts it uses, the router, the LM head; not the embedding lookup
and not the E - k unused experts), 6 = 2 (multiply-add) x 3 (forward, backward wrt activations
and wrt weights), and the second term is attention's QK^T and AV matmuls over a context of T
tokens (forward + backward), counted without the causal-mask saving, as PaLM does. Recomputation
(e.g. the no-grad proximal pass of decoupled PPO) is deliberately not counted: MFU measures
useful model FLOPs. `proximal_pass_flops_per_token` gives that extra forward separately for
hardware-utilisation accounting.
"""

from __future__ import annotations

from typing import Optional

from moe import build
from moe.config import ModelConfig

# Dense peak FLOP/s per chip, bf16 (vendor datasheets; without sparsity).
PEAK_FLOPS = {
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "b200": 2250e12,
    "tpu_v4": 275e12,
    "tpu_v5e": 197e12,
    "tpu_v5p": 459e12,
}


def active_matmul_params(cfg: ModelConfig) -> int:
  """Parameters a token multiplies with (excludes the embedding lookup and unused experts).

  With tied embeddings the embedding matrix is the LM head, so it is counted once.
  """
  active = build.active_param_count(cfg)
  if not cfg.tie_word_embeddings:
    active -= cfg.vocab_size * cfg.hidden_size  # the lookup table is not a matmul
  return int(active)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """12 * L * H * D_head * T: QK^T and AV, forward and backward."""
  return 12.0 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Model FLOPs of one trained token (forward + backward)."""
  return 6.0 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def proximal_pass_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """The extra no-grad forward of decoupled PPO: 2 * N_active + attention forward."""
  return 2.0 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len) / 3.0


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops_per_chip: float,
        num_chips: int = 1) -> float:
  """Model-FLOPs utilisation: achieved model FLOP/s over the chips' peak."""
  if peak_flops_per_chip <= 0 or num_chips <= 0:
    raise ValueError("peak_flops_per_chip and num_chips must be positive")
  return tokens_per_s * train_flops_per_token(cfg, seq_len) / (peak_flops_per_chip * num_chips)


def peak_flops(name: Optional[str]) -> Optional[float]:
  """Datasheet peak for a chip name in PEAK_FLOPS (None passes through)."""
  if name is None:
    return None
  if name not in PEAK_FLOPS:
    raise ValueError(f"unknown chip {name!r}; known: {sorted(PEAK_FLOPS)}")
  return PEAK_FLOPS[name]
