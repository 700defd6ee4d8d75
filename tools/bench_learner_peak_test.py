"""bench_learner's measured peak: the matmul probe and MFU against it in the same run."""

import sys

import pytest

from moe.config import ModelConfig
from tools import bench_learner


def test_matmul_peak_reports_the_best_size():
  r = bench_learner.matmul_peak(sizes=(32, 64), repeats=2)
  assert set(r["rates"]) == {32, 64} and all(v > 0 for v in r["rates"].values())
  assert r["flops"] == max(r["rates"].values()) and r["rates"][r["n"]] == r["flops"]


def test_bench_measures_its_peak_when_none_is_given():
  cfg = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, max_seq_len=16)
  r = bench_learner.bench(cfg, seq_len=16, batch_rows=2, steps=1, warmup=1, objective="next_token",
                          mesh_shape=(1, 1, 1, 1), micro_batches=1, measure_peak=True)
  assert r["peak_source"].startswith("best measured float32 matmul")
  assert r["peak_tflops"] == pytest.approx(max(r["matmul_tflops_by_n"].values()))
  assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / r["peak_tflops"])
  given = bench_learner.bench(cfg, seq_len=16, batch_rows=2, steps=1, warmup=0,
                              objective="next_token", mesh_shape=(1, 1, 1, 1), micro_batches=1,
                              peak_tflops=2.0, measure_peak=True)
  assert given["peak_source"] == "given" and "matmul_tflops_by_n" not in given


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
