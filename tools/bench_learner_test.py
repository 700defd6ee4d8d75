"""The learner benchmark on a very small config: its figures, on a scripted clock, are exact."""

import json
import sys

import numpy as np
import pytest

from moe.config import ModelConfig
from tools import bench_learner


CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=16)
# Model FLOPs of one trained token of CFG at length 16, counted by hand (PaLM appendix B:
# 6 x the parameters a token multiplies with + 12 L H D_head T for attention):
#   attention q, k, v, o: 32*2*16 + 2*(32*1*16) + 2*16*32 = 3072; two norms 64;
#   the 2 routed experts it uses: 2 * 3*32*32 = 6144; router 32*4 = 128; final norm 32;
#   LM head 32*32 = 1024 (untied; the embedding lookup is no matmul)  -> 10464 parameters;
#   attention: 12 * 1 layer * 2 heads * 16 * 16 tokens = 6144.
FLOPS_PER_TOKEN = 6 * 10464 + 6144


class _Clock:
  """Stands in for `time` in tools.bench_learner: each train step takes `step_s` seconds."""

  def __init__(self, step_s):
    self.now, self.step_s = 0.0, step_s

  def perf_counter(self):
    return self.now


def test_bench_reports_throughput_and_mfu_of_known_steps(monkeypatch):
  """With a clock on which every train step takes 0.25 s, the report's figures follow from the
  batch (2 rows x 16 tokens), the hand-counted FLOPs and the given peak; warm-up steps must not
  count. A wrong token count, FLOP count, averaging or peak fails."""
  clock = _Clock(0.25)

  class TimedLearner(bench_learner.learner_lib.Learner):

    def train_step(self, batch):
      out = super().train_step(batch)
      clock.now += clock.step_s
      return out

  monkeypatch.setattr(bench_learner, "time", clock)
  monkeypatch.setattr(bench_learner.learner_lib, "Learner", TimedLearner)
  r = bench_learner.bench(CFG, seq_len=16, batch_rows=2, steps=2, warmup=1,
                          objective="policy", mesh_shape=(1, 1, 1, 1), micro_batches=1,
                          peak_tflops=1e-6)
  tokens_per_s = 2 * 16 / 0.25
  assert r["step_time_s"] == 0.25 and r["tokens_per_s"] == tokens_per_s
  assert r["model_tflops_per_s"] == pytest.approx(tokens_per_s * FLOPS_PER_TOKEN / 1e12)
  assert r["mfu"] == pytest.approx(tokens_per_s * FLOPS_PER_TOKEN / 1e6)  # peak: 1 MFLOP/s
  assert r["devices"] == 1 and np.isfinite(r["final_loss"])


def test_expert_impls_are_timed_in_one_process_against_the_first(monkeypatch):
  """Dispatch and grouped experts on the same batch: the same loss (the same function), and the
  ratio is each step time over the first's, on a clock where grouped steps take half as long."""
  steps = {"dispatch": 0.4, "grouped": 0.2}
  clock = _Clock(0.0)

  class TimedLearner(bench_learner.learner_lib.Learner):

    def train_step(self, batch):
      out = super().train_step(batch)
      clock.now += steps[self.model_cfg.expert_impl]
      return out

  monkeypatch.setattr(bench_learner, "time", clock)
  monkeypatch.setattr(bench_learner.learner_lib, "Learner", TimedLearner)
  kw = dict(seq_len=16, batch_rows=2, steps=2, warmup=1, objective="next_token",
            mesh_shape=(1, 1, 1, 1), micro_batches=1, peak_tflops=1e-6)
  runs = {impl: bench_learner.bench(CFG.replace(expert_impl=impl), **kw) for impl in steps}
  r = bench_learner.compare_runs(runs)
  assert r["step_time_over_first"] == pytest.approx({"dispatch": 1.0, "grouped": 0.5})
  assert r["loss_diff_from_first"]["grouped"] < 1e-5


def test_query_chunks_are_timed_in_one_process_and_give_the_same_loss(capsys):
  """Whole-square attention (0) against causal chunks of 8 rows, each timed twice in order: the
  same loss (chunking changes no result), one report keyed by value and repeat."""
  assert bench_learner.main(["--gin_file=moe/configs/tiny.gin", "--seq_len", "32",
                             "--batch_rows", "2", "--steps", "1", "--warmup", "1",
                             "--query_chunks", "0,8,0,8"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert list(r["by_attention_query_chunk"]) == ["0", "8", "0#2", "8#2"]
  assert r["step_time_over_first"]["0"] == 1.0
  assert max(r["loss_diff_from_first"].values()) < 1e-5


def test_cli_rejects_unknown_chip():
  with pytest.raises(ValueError, match="unknown chip"):
    bench_learner.main(["--gin_file=moe/configs/tiny.gin", "--seq_len", "8", "--batch_rows", "1",
                        "--steps", "1", "--warmup", "0", "--chip", "abacus"])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
