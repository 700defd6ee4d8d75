"""Shared fixtures for the rollout tests: tiny configs and models (test-only helpers).

Tolerance policy (float32 everywhere in these tests): the sampler and the model compute the same
formulas with different matmul shapes, so results differ by float32 rounding only (observed
<= 1e-6 on log-probabilities of these tiny models). Comparisons use atol 1e-5 on logits and
log-probabilities -- ten times the observed gap, far below any real bug (a wrong mask, norm, or
expert changes log-probabilities by >= 1e-2). Token and routing comparisons are exact.
"""

from __future__ import annotations

from moe import build
from moe.config import ModelConfig

ATOL = 1e-5


def tiny_config(**kw) -> ModelConfig:
  base = dict(vocab_size=259, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
              max_seq_len=64, init_std=0.2)
  base.update(kw)
  return ModelConfig(**base)


def tiny_model(seed: int = 0, **kw):
  return build.create(tiny_config(**kw), seed=seed)
