"""Tests for the fused sparse-apply kernel: numba and numpy paths are bit-identical.

Exact comparisons only (integer bit patterns and 64-bit hashes): no float tolerance applies.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import zstandard

from sync.delta import chunk_format as fmt
from sync.delta import codec
from sync.delta import sparse_kernels


def _sparse_body(dtype, n=70_000, frac=0.04, seed=0):
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  base = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
  new = base.copy()
  idx = rng.random(n) < frac
  idx[[0, n - 1]] = True
  new[idx] += rng.integers(1, 3, idx.sum()).astype(dtype)  # +-ulps, wrapping at the edges
  new[idx.nonzero()[0][::7]] -= dtype(5)
  new[1000:1000 + 3] = info.max  # large jumps use the high value planes
  kind, payload, _, ch = codec.encode_chunk(base, new, zstandard.ZstdCompressor(level=1))
  assert kind == codec.SPARSE
  return base, new, zstandard.ZstdDecompressor().decompress(payload), ch


def test_numba_is_installed():
  assert sparse_kernels.HAVE_NUMBA  # pinned in requirements.txt; the fallback is tested below


@pytest.mark.parametrize("frac", [0.005, 0.1])  # the kernel's blocked and one-pass loops
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_numba_and_numpy_paths_are_bit_identical(dtype, frac):
  base, new, raw, ch = _sparse_body(dtype, frac=frac)
  pos = np.flatnonzero(base != new)
  assert ch == fmt.changes_hash(pos, base[pos], new[pos]) != 0
  for use_numba in (True, False):
    out = base.copy()
    assert sparse_kernels.sparse_apply(raw, out, use_numba=use_numba) == ch
    np.testing.assert_array_equal(out, new)
    sparse_kernels.sparse_apply(raw, out, undo=True, use_numba=use_numba)
    np.testing.assert_array_equal(out, base)
  wrong = base.copy()
  wrong[pos[len(pos) // 2]] ^= 1  # other bits before a change: another hash, both paths
  hashes = {sparse_kernels.sparse_apply(raw, wrong.copy(), use_numba=u) for u in (True, False)}
  assert len(hashes) == 1 and ch not in hashes


@pytest.mark.parametrize("frac", [0.005, 0.1])
@pytest.mark.parametrize("use_numba", [True, False])
def test_malformed_bodies_leave_the_chunk_unchanged(use_numba, frac):
  base, _, raw, _ = _sparse_body(np.uint16, frac=frac)
  short = base[:-5].copy()  # the last position lies outside: rejected after partial writes
  assert sparse_kernels.sparse_apply(raw, short, use_numba=use_numba) is None
  np.testing.assert_array_equal(short, base[:-5])
  out = base.copy()
  assert sparse_kernels.sparse_apply(raw[:-1], out, use_numba=use_numba) is None
  assert sparse_kernels.sparse_apply(raw[:2], out, use_numba=use_numba) is None
  np.testing.assert_array_equal(out, base)


def test_delta_roundtrip_without_numba_matches():
  code = ("import numpy as np, ml_dtypes\n"
          "from sync import delta, synthetic, weights\n"
          "from sync.delta import sparse_kernels, unit_kernels\n"
          "assert not sparse_kernels.HAVE_NUMBA and not unit_kernels.HAVE_NUMBA\n"
          "for frac, kind in ((0.04, 'sparse_unit'), (0.3, 'dense_unit')):\n"
          "  m = synthetic.init_master({'w': (300, 500)}, 1)\n"
          "  b = synthetic.cast(m); synthetic.rl_step(m, frac, 2); n = synthetic.cast(m)\n"
          "  blob = delta.encode(b, n, chunk_elems=30_000)\n"
          "  h = {k: v.copy() for k, v in b.items()}\n"
          "  out, st = delta.apply_inplace(h, blob, expect_parent=weights.digest(b, 30_000))\n"
          "  assert set(st.chunks) == {kind}, st.chunks\n"
          "  assert np.array_equal(weights.words(out['w']), weights.words(n['w']))\n")
  env = dict(os.environ, SYNC_NO_NUMBA="1",
             PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=False, timeout=120)
  assert res.returncode == 0, res.stderr


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
