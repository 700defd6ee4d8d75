"""FLOPs formula against a hand count for a small config (exact integer arithmetic)."""

import sys

import pytest

from moe import build
from moe.config import ModelConfig
from rl import flops

CFG = ModelConfig(vocab_size=100, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                  num_experts_per_tok=2, first_k_dense=1, tie_word_embeddings=False,
                  max_seq_len=64)


def test_active_params_hand_count():
  d, hd = 16, 8
  attn = d * 2 * hd + 2 * d * 1 * hd + 2 * hd * d  # q, k, v, o
  norms = 2 * d
  dense = 3 * d * 32
  moe_used = 2 * 3 * d * 8 + d * 4  # k experts + router
  head = d * 100
  want = 2 * (attn + norms) + dense + moe_used + d + head  # + final norm
  assert flops.active_matmul_params(CFG) == want
  # Total = active + unused experts + embedding table.
  assert build.param_count(build.abstract(CFG)) == want + 2 * 3 * d * 8 + 100 * d


def test_train_flops_and_mfu():
  n = flops.active_matmul_params(CFG)
  per_token = 6 * n + 12 * 2 * 2 * 8 * 32
  assert flops.train_flops_per_token(CFG, 32) == per_token
  assert flops.mfu(1000.0, CFG, 32, peak_flops_per_chip=per_token * 1000.0) == pytest.approx(1.0)
  assert flops.mfu(1000.0, CFG, 32, per_token * 1000.0, num_chips=4) == pytest.approx(0.25)
  with pytest.raises(ValueError):
    flops.peak_flops("abacus")
  assert flops.peak_flops("h200") == 989e12


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
