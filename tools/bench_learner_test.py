"""The learner benchmark runs end to end on a very small config and reports sane numbers."""

import sys

import pytest

from moe.config import ModelConfig
from tools import bench_learner


def test_bench_runs_and_reports_mfu():
  cfg = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, max_seq_len=16)
  r = bench_learner.bench(cfg, seq_len=16, batch_rows=2, steps=2, warmup=1,
                          objective="policy", mesh_shape=(1, 1, 1, 1), micro_batches=1,
                          peak_tflops=1.0)
  assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
  assert 0 < r["mfu"] < 1
  assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 1.0)


def test_cli_rejects_unknown_chip():
  with pytest.raises(ValueError, match="unknown chip"):
    bench_learner.main(["--gin", "moe/configs/tiny.gin", "--seq_len", "8", "--batch_rows", "1",
                        "--steps", "1", "--warmup", "0", "--chip", "abacus"])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
