import json
import os
import sys

import pytest

from experiment import reporting


def test_metrics_tensorboard_and_plots(tmp_path):
  rep = reporting.Reporter(str(tmp_path), progress=False)
  for s in range(1, 4):
    rep.log("pretrain", s, {"loss": 3.0 / s, "tokens_per_s": 100.0, "ignored": "text"})
  for s in range(1, 4):
    rep.log("rl", s, {"reward": 0.1 * s, "pass_rate": 0.05 * s, "staleness_mean": 1.0,
                      "staleness_max": 2, "sampler_kl": 1e-4, "tokens_per_s": 50.0})
  rep.log("eval", 0, {"pass1": 0.1})
  rep.log("eval", 3, {"pass1": 0.3})
  rep.close()
  recs = reporting.read_metrics(str(tmp_path))
  assert len(recs) == 8 and recs[0]["phase"] == "pretrain" and "ignored" not in recs[0]
  assert recs[3]["reward"] == pytest.approx(0.1)
  tb = os.listdir(tmp_path / "tensorboard")
  assert any(f.startswith("events.out.tfevents") for f in tb)
  paths = reporting.make_plots(str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ["heldout_pass_rate.png", "kl.png", "pretrain_loss.png", "reward.png",
                   "staleness.png", "throughput.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_summary_table():
  t = reporting.summary_table([("a", "1"), ("longer key", "2")])
  assert "longer key | 2" in t and "a          | 1" in t


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
