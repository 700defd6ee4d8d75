"""Tests for real learner versions: they change, round-trip bit-exactly and beat XOR+zstd."""

import json
import sys

import numpy as np
import pytest

from moe.config import ModelConfig
from sync import bench
from sync import delta
from sync import weights
from tools import bench_sync
from tools import train_deltas

CFG = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=16, param_dtype="float32",
                  dtype="float32")


def test_consecutive_learner_versions_compress_bit_exactly():
  versions = list(train_deltas.learner_versions(CFG, steps=2, learning_rate=1e-4, rows=2,
                                                seq_len=8))
  assert [v for v, _, _ in versions] == [0, 1, 2]
  assert all(np.isfinite(loss) for _, _, loss in versions[1:])
  (_, a, _), (_, b, _) = versions[1:]
  assert any(str(x.dtype) == "bfloat16" for x in b.values())
  row = bench.measure(a, b, "learner", repeats=1)
  assert 0 < row.changed < 1
  assert row.ratio > row.xor_ratio  # real steps: ours still beats plain XOR+zstd
  held = {k: v.copy() for k, v in a.items()}
  out, _ = delta.apply_inplace(held, delta.encode(a, b))
  assert all(np.array_equal(weights.words(out[k]), weights.words(b[k])) for k in b)


def test_command_line_learner_mode(tmp_path):
  small = ["vocab_size=16", "hidden_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1",
           "intermediate_size=64", "moe_intermediate_size=32", "num_experts=4",
           "max_seq_len=64"]
  out = tmp_path / "r.json"
  args = ["--learner_steps", "2", "--learner_lrs", "1e-4", "--repeats", "1", "--no_sim",
          "--json", str(out)]
  for b in small:
    args.append(f"--gin.ModelConfig.{b}")
  assert bench_sync.main(args) == 0
  report = json.loads(out.read_text())
  assert [r["label"] for r in report["rows"]] == ["learner lr=0.0001 v0->v1",
                                                  "learner lr=0.0001 v1->v2"]
  (summary,) = report["learner"]
  assert summary["lr"] == 1e-4 and len(summary["changed"]) == 2
  assert all(0 < c < 1 for c in summary["changed"])
  assert all(r > x for r, x in zip(summary["ratio"], summary["xor_ratio"]))


def test_steps_must_be_positive():
  with pytest.raises(ValueError):
    next(train_deltas.learner_versions(CFG, steps=0, learning_rate=1e-4))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
