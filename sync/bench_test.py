"""Tests for the benchmark library and the tools/bench_sync.py entry point (tiny sizes)."""

import json
import os
import sys

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sync import bench
from sync import synthetic


def test_synthetic_rows_hit_their_fractions_and_beat_xor():
  rows = [bench.measure(b, n, label, repeats=1)
          for label, b, n in bench.synthetic_pairs(300_000, [0.04, 0.25])]
  assert rows[0].changed == pytest.approx(0.04, rel=0.15)
  assert rows[1].changed == pytest.approx(0.25, rel=0.15)
  for r in rows:
    assert r.ratio > 1.5 * r.xor_ratio and r.encode_GBps > 0 and r.memcpy_GBps > 0
    assert r.apply_GBps > 0 and r.decode_fresh_GBps > 0 and r.memcpy_fresh_GBps > 0
    assert r.decode_pool_GBps > 0 and r.decode_vs_memcpy == r.decode_pool_GBps / r.memcpy_GBps
    assert r.apply_vs_memcpy == r.apply_GBps / r.memcpy_GBps
  assert rows[0].kinds == {"sparse_unit": sum(rows[0].kinds.values())}
  table = bench.markdown(rows)
  assert "| synthetic bf16, 4% target |" in table and "apply / memcpy" in table
  report = bench.terabyte_report(rows[0])
  assert set(report) == {"full shard swap", "delta scatter on device"}
  assert all(v["end_to_end_s"] > 0 for v in report.values())


def test_from_checkpoints_npz_and_orbax(tmp_path):
  master = synthetic.init_master({"a": (64, 64), "b": (64,)}, 1)
  step0 = {"params": {k: v.copy() for k, v in master.items()}, "step": np.array(0)}
  synthetic.rl_step(master, 0.04, 2)
  step1 = {"params": dict(master), "step": np.array(1)}
  ckpt = ocp.PyTreeCheckpointer()
  ckpt.save(str(tmp_path / "s0"), step0)
  ckpt.save(str(tmp_path / "s1"), step1)
  flat = bench.load_flat(str(tmp_path / "s1"), ml_dtypes.bfloat16)
  assert set(flat) == {"params/a", "params/b", "step"}
  assert flat["params/a"].dtype == ml_dtypes.bfloat16 and flat["step"].dtype.kind == "i"
  row = bench.from_checkpoints(str(tmp_path / "s0"), str(tmp_path / "s1"),
                               ml_dtypes.bfloat16, repeats=1)
  assert 0.02 < row.changed < 0.06 and row.ratio > 10
  np.savez(tmp_path / "a.npz", **synthetic.cast(step0["params"]))
  np.savez(tmp_path / "b.npz", **synthetic.cast(step1["params"]))
  row = bench.from_checkpoints(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), repeats=1)
  assert row.ratio > 10


def test_command_line_entry_point(tmp_path):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tools import bench_sync  # pylint: disable=g-import-not-at-top
  out = tmp_path / "r.json"
  assert bench_sync.main(["--size", "200000", "--fractions", "0.04", "--repeats", "1",
                          "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["rows"][0]["ratio"] > 20 and "terabyte" in report
  assert report["rows"][0]["apply_vs_memcpy"] > 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
