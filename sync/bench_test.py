"""Tests for the weight-sync benchmark library (tiny sizes; the entry point is tested in
tools/bench_sync_test.py)."""

import sys

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sync import bench
from sync import delta
from sync import synthetic


def test_synthetic_rows_hit_their_fractions_and_beat_xor():
  rows = [bench.measure(b, n, label, repeats=1)
          for label, b, n in bench.synthetic_pairs(300_000, [0.04, 0.25])]
  assert rows[0].changed == pytest.approx(0.04, rel=0.15)
  assert rows[1].changed == pytest.approx(0.25, rel=0.15)
  for r in rows:
    assert r.ratio > 1.5 * r.xor_ratio and r.encode_GBps > 0 and r.memcpy_GBps > 0
    assert r.apply_GBps > 0 and r.decode_fresh_GBps > 0 and r.memcpy_fresh_GBps > 0
    assert r.decode_pool_GBps > 0 and r.apply_changes_GBps > 0
  assert rows[0].kinds == {"sparse_unit": sum(rows[0].kinds.values())}
  table = bench.markdown(rows)
  assert "| synthetic bf16, 4% target |" in table and "apply / memcpy" in table
  report = bench.terabyte_report(rows[0])
  assert set(report) == {"full shard swap", "delta scatter on device"}
  assert all(v["end_to_end_s"] > 0 for v in report.values())


class _Clock:
  """Stands in for `time` in `sync.bench`: only the scripted operations move it."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now


class _Proxy:
  """A module with some attributes replaced (the rest are the real module's)."""

  def __init__(self, real, **replaced):
    self._real = real
    self.__dict__.update(replaced)

  def __getattr__(self, name):
    return getattr(self._real, name)


def test_row_holds_the_median_rate_of_each_timed_operation(monkeypatch):
  """Every timed operation takes scripted seconds on a fake clock; the row must turn each into
  GB/s of model bytes (a hand-counted 8320) from its own median, and each "X / memcpy" must
  divide the right two. A row that swapped two columns, took a mean or a minimum, or counted the
  wrong bytes fails; the operations themselves still run for real (and are checked bit-exact)."""
  clock = _Clock()
  # Seconds per repeat, chosen so that median, mean, min and max all differ (exact in binary).
  script = {"encode": [1.0, 9.0, 2.0], "apply_result": [4.0, 3.0, 40.0],
            "apply_changes": [5.0, 5.5, 60.0], "memcpy": [0.5, 0.25, 5.0],
            "decode_out": [8.0, 7.0, 70.0], "decode_pool": [2.0, 20.0, 1.5],
            "decode_fresh": [3.0, 30.0, 2.5], "memcpy_fresh": [1.5, 1.75, 0.125],
            "xor_encode": [6.0, 0.5, 6.5], "xor_decode": [7.5, 7.25, 0.25]}
  left = {k: list(v) for k, v in script.items()}
  running = []  # the scripted operation in progress: ones it calls inside are not timed again

  def timed(name, fn):
    def wrapped(*args, **kw):
      if running:
        return fn(*args, **kw)
      running.append(name)
      try:
        out = fn(*args, **kw)
      finally:
        running.pop()
      clock.now += left[name(kw) if callable(name) else name].pop(0)
      return out
    return wrapped

  decode_kind = lambda kw: ("decode_out" if "out" in kw else
                            "decode_fresh" if kw.get("recycle") is False else "decode_pool")
  apply_kind = lambda kw: "apply_changes" if "expect_parent" in kw else "apply_result"
  monkeypatch.setattr(bench, "time", clock)
  monkeypatch.setattr(bench, "delta", _Proxy(
      delta, encode_to=timed("encode", delta.encode_to),
      apply_inplace=timed(apply_kind, delta.apply_inplace),
      decode=timed(decode_kind, delta.decode)))
  for attr, name in [("memcpy_into", "memcpy"), ("memcpy_fresh", "memcpy_fresh"),
                     ("xor_zstd_encode", "xor_encode"), ("xor_zstd_decode", "xor_decode")]:
    monkeypatch.setattr(bench, attr, timed(name, getattr(bench, attr)))

  master = synthetic.init_master({"a": (64, 64), "b": (64,)}, 1)
  base = synthetic.cast(master)
  synthetic.rl_step(master, 0.04, 2)
  r = bench.measure(base, synthetic.cast(master), "scripted", repeats=3, workers=2)
  assert all(v == [] for v in left.values()), left  # each operation timed once per repeat
  nb = (64 * 64 + 64) * 2  # bf16
  gbps = lambda seconds: nb / seconds / 1e9
  assert r.params == 64 * 64 + 64 and r.workers == 2 and r.repeats == 3
  want = {"encode_GBps": 2.0, "apply_GBps": 4.0, "apply_changes_GBps": 5.5, "memcpy_GBps": 0.5,
          "decode_GBps": 8.0, "decode_pool_GBps": 2.0, "decode_fresh_GBps": 3.0,
          "memcpy_fresh_GBps": 1.5, "xor_encode_GBps": 6.0, "xor_decode_GBps": 7.25}
  assert {k: getattr(r, k) for k in want} == pytest.approx({k: gbps(s) for k, s in want.items()})
  # X / memcpy = memcpy's median seconds / X's median seconds.
  assert r.decode_vs_memcpy == pytest.approx(0.5 / 2.0)
  assert r.decode_out_vs_memcpy == pytest.approx(0.5 / 8.0)
  assert r.apply_vs_memcpy == pytest.approx(0.5 / 4.0)
  assert r.apply_changes_vs_memcpy == pytest.approx(0.5 / 5.5)
  assert "| scripted | " in bench.markdown([r]) and "**0.25**" in bench.markdown([r])


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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
