"""Tests that the weight-sync benchmark compares like with like: every baseline (memcpy, fresh
copy, XOR+zstd encode and decode) runs on the codec's threads, `--workers 2,1` gives a table
per thread count, and the ratios come from the memcpy measured in the same row."""

import json
import sys
import time

import numpy as np
import pytest
import zstandard

from sync import bench
from sync import synthetic
from sync import weights
from sync.delta import parallel
from tools import bench_sync


def _pair(shapes, fraction=0.04, seed=1):
  master = synthetic.init_master(shapes, seed)
  base = synthetic.cast(master)
  synthetic.rl_step(master, fraction, seed + 1)
  return base, synthetic.cast(master)


_SHAPES = {"a": (512, 512), "b": (256, 512), "c": (300,), "d": (128, 256)}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_baselines_are_exact_and_independent_of_the_threads(workers):
  base, new = _pair(_SHAPES)
  held = {k: v.copy() for k, v in base.items()}
  # Chunks far smaller than the tensors, so every tensor is split across the threads.
  bench.memcpy_into(held, new, workers, chunk_elems=1000)
  fresh = bench.memcpy_fresh(new, workers)
  blobs = bench.xor_zstd_encode(base, new, workers=workers)
  dec = bench.xor_zstd_decode(base, blobs, workers=workers)
  for k in new:
    for got in (held[k], fresh[k], dec[k]):
      assert got.dtype == new[k].dtype and got.shape == new[k].shape
      np.testing.assert_array_equal(weights.words(got), weights.words(new[k]))
    assert not np.shares_memory(fresh[k], new[k])
    # One plain zstd frame per tensor, whatever the threads: the ratio does not move with them.
    xor = weights.words(base[k]) ^ weights.words(new[k])
    assert zstandard.ZstdDecompressor().decompress(blobs[k]) == xor.tobytes()
    assert blobs[k] == zstandard.ZstdCompressor(level=1).compress(xor)


@pytest.mark.parametrize("workers", [1, 2])
def test_measure_runs_every_baseline_on_the_codecs_threads(monkeypatch, workers):
  calls = []
  real = parallel.map_all

  def recording(pool, fn, items, w):
    if fn.__module__ == bench.__name__:
      calls.append((fn.__qualname__, w, None if pool is None else pool._max_workers))
    return real(pool, fn, items, w)

  monkeypatch.setattr(parallel, "map_all", recording)
  base, new = _pair(_SHAPES)
  row = bench.measure(base, new, "t", repeats=2, workers=workers)
  assert row.workers == workers
  # Per repeat: memcpy into held buffers, fresh copy, XOR+zstd encode and decode.
  names = sorted({c[0] for c in calls})
  assert names == ["_copy_chunks.<locals>.copy", "memcpy_fresh.<locals>.<lambda>",
                   "xor_zstd_decode.<locals>.one", "xor_zstd_encode.<locals>.one"], names
  assert len(calls) == 2 * 4
  # All of them on `workers` threads: the caller plus workers - 1 pool threads.
  helpers = workers - 1 if workers > 1 else None
  assert all(w == workers and p == helpers for _, w, p in calls), calls


def test_ratio_divides_by_the_memcpy_measured_in_the_same_row(monkeypatch):
  """A memcpy made 1 s slower must show as memcpy below 1 s of model bytes and lift every
  'X / memcpy' ratio of that row above 1 (the codec's own work on this tiny pair is ms)."""
  real = bench.memcpy_into

  def slow(dst, src, workers=1, **kw):
    time.sleep(1.0)  # An injected cost, not a wait for another thread.
    return real(dst, src, workers, **kw)

  monkeypatch.setattr(bench, "memcpy_into", slow)
  base, new = _pair({"a": (256, 256)})
  row = bench.measure(base, new, "slowed", repeats=1, workers=2)
  assert row.memcpy_GBps <= weights.nbytes(new) / 1.0 / 1e9
  assert row.apply_changes_vs_memcpy > 1 and row.decode_vs_memcpy > 1


def test_command_line_entry_point(tmp_path):
  out = tmp_path / "r.json"
  assert bench_sync.main(["--size", "200000", "--fractions", "0.04", "--repeats", "1",
                          "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["rows"][0]["ratio"] > 20 and "terabyte" in report
  assert report["rows"][0]["apply_vs_memcpy"] > 0


def test_command_line_prints_one_table_per_thread_count(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert bench_sync.main(["--size", "300000", "--fractions", "0.04,0.25", "--repeats", "1",
                          "--workers", "2,1", "--no_sim", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  rows = json.loads(out.read_text())["rows"]
  assert [(r["label"], r["workers"]) for r in rows] == [
      ("synthetic bf16, 4% target", 2), ("synthetic bf16, 4% target", 1),
      ("synthetic bf16, 25% target", 2), ("synthetic bf16, 25% target", 1)]
  for w in (2, 1):
    assert f"{w} thread(s) for ours and for every baseline" in text
  # Each printed row names its threads and shows the ratio of its own measured rates.
  for r in rows:
    cells = f"| {r['label']} | {r['changed']:.2%} | {r['workers']} | "
    line = next(l for l in text.splitlines()
                if l.startswith(cells) and f"{r['memcpy_GBps']:.2f} |" in l)
    assert f"**{r['apply_changes_GBps'] / r['memcpy_GBps']:.2f}**" in line
    assert f"{r['decode_pool_GBps']:.2f} / {r['xor_decode_GBps']:.2f} |" in line
  header = text.splitlines()[[i for i, l in enumerate(text.splitlines())
                              if l.startswith("| update |")][0]]
  assert "threads, ours = baselines" in header and "ratio ours / XOR+zstd" in header


def test_first_swap_rows_show_the_compile_the_cache_and_the_warm_up(tmp_path, capsys):
  # Four fresh processes: one compiles at start-up (filling a temporary cache), one compiles
  # inside its first delta, one loads inside it, one is readied by the start-up warm-up.
  out = tmp_path / "r.json"
  assert bench_sync.main(["--first_swap", "--first_swap_params", "262144",
                          "--json", str(out)]) == 0
  rows = {r["label"]: r for r in json.loads(out.read_text())["first_swap"]}
  labels = [label for label, _, _ in bench_sync.FIRST_SWAP_MODES]
  assert set(labels) < set(rows)
  cold, cached, warm = (rows[label] for label in labels)
  assert cold["cache_dir"] is None and cold["compiled_in_first"] > 0 and cold["cache_hits"] == 0
  assert cached["cache_misses"] == 0 and cached["compiled_in_first"] > 0
  assert warm["cache_misses"] == 0 and warm["compiled_in_first"] == 0
  assert warm["warm_up_s"] is not None and cold["warm_up_s"] is None
  text = capsys.readouterr().out
  for r in rows.values():
    assert f"| {r['label']} | " in text and f"| {r['first_s']:.3f} | {r['later_s']:.3f} |" in text


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
