"""Tests for the unit-step kernels (SPARSE_UNIT, DENSE_UNIT): numba and numpy paths agree
bit for bit, undo is exact, and malformed bodies leave the chunk unchanged.

Exact comparisons only (integer bit patterns and 64-bit hashes): no float tolerance applies.
"""

import sys

import numpy as np
import pytest
import zstandard

from sync.delta import chunk_format as fmt
from sync.delta import codec
from sync.delta import unit_kernels


def _unit_body(dtype, n=70_000, frac=0.04, seed=0, exceptions=True):
  """A SPARSE_UNIT body: +-1 steps (wrapping at the edges), a few other steps if asked."""
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  base = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
  new = base.copy()
  idx = np.flatnonzero(rng.random(n) < frac)
  idx = np.union1d(idx, [0, n - 1])
  new[idx] += np.where(rng.random(idx.size) < 0.5, dtype(1), info.max).astype(dtype)
  if exceptions:
    new[idx[5::5]] += dtype(7)  # steps of 8 or 6: exceptions (1/5 of the changes)
    new[idx[3]] = base[idx[3]] ^ info.max  # a large jump
  kind, payload, _, ch = codec.encode_chunk(base, new, zstandard.ZstdCompressor(level=1))
  assert kind == codec.SPARSE_UNIT
  return base, new, zstandard.ZstdDecompressor().decompress(payload), ch


@pytest.mark.parametrize("exceptions", [True, False])
@pytest.mark.parametrize("frac", [0.005, 0.1])  # the blocked and one-pass loops
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_unit_numba_and_numpy_paths_are_bit_identical(dtype, frac, exceptions):
  base, new, raw, ch = _unit_body(dtype, frac=frac, exceptions=exceptions)
  pos = np.flatnonzero(base != new)
  assert ch == fmt.changes_hash(pos, base[pos], new[pos]) != 0
  nexc = unit_kernels.UNIT_HEAD.unpack_from(raw)[1]
  assert (nexc > 0) == exceptions
  for use_numba in (True, False):
    out = base.copy()
    assert unit_kernels.unit_apply(raw, out, use_numba=use_numba) == ch
    np.testing.assert_array_equal(out, new)
    assert unit_kernels.unit_apply(raw, out, undo=True, want_hash=False, use_numba=use_numba) == 0
    np.testing.assert_array_equal(out, base)
    assert unit_kernels.unit_apply(raw, out, want_hash=False, use_numba=use_numba) == 0
    np.testing.assert_array_equal(out, new)
  wrong = base.copy()
  wrong[pos[len(pos) // 2]] ^= 1
  hashes = {unit_kernels.unit_apply(raw, wrong.copy(), use_numba=u) for u in (True, False)}
  assert len(hashes) == 1 and ch not in hashes


def _with_exceptions(raw, idx, vals_z, itemsize):
  """`raw` (a body without exceptions) with the given exception indices and zig-zag values."""
  nnz, _, cb = unit_kernels.UNIT_HEAD.unpack_from(raw)
  planes = fmt.gap_planes(np.asarray(idx, np.int64))
  vals = np.asarray(vals_z, f"<u{itemsize}")
  vplanes = np.ascontiguousarray(vals.view(np.uint8).reshape(-1, itemsize).T).tobytes()
  return (unit_kernels.UNIT_HEAD.pack(nnz, len(idx), cb) + raw[unit_kernels.UNIT_HEAD.size:] + planes +
          vplanes)


@pytest.mark.parametrize("frac", [0.005, 0.1])
@pytest.mark.parametrize("use_numba", [True, False])
def test_malformed_unit_bodies_leave_the_chunk_unchanged(use_numba, frac):
  base, _, raw, _ = _unit_body(np.uint16, frac=frac, exceptions=False)
  short = base[:-5].copy()  # the last position lies outside: rejected after partial writes
  assert unit_kernels.unit_apply(raw, short, use_numba=use_numba) is None
  np.testing.assert_array_equal(short, base[:-5])
  nnz, _, cb = unit_kernels.UNIT_HEAD.unpack_from(raw)
  bad = [raw[:-1], raw[:5], raw + b"\0",
         unit_kernels.UNIT_HEAD.pack(nnz, 0, 0) + raw[9:],  # code width 0
         unit_kernels.UNIT_HEAD.pack(nnz, 0, 5) + raw[9:],  # code width 5
         unit_kernels.UNIT_HEAD.pack(nnz + 1, 0, cb) + raw[9:],  # count does not fit the length
         _with_exceptions(raw, [nnz], [4], 2),  # exception beyond the changes
         _with_exceptions(raw, [2, nnz + 5], [4, 4], 2),
         _with_exceptions(raw, [4], [0], 2)]  # an exception that changes nothing
  assert unit_kernels.unit_apply(_with_exceptions(raw, [2, 9], [4, 6], 2), base.copy(),
                            use_numba=use_numba) is not None  # well-formed exceptions apply
  out = base.copy()
  for body in bad:
    assert unit_kernels.unit_apply(body, out, use_numba=use_numba) is None
  np.testing.assert_array_equal(out, base)


@pytest.mark.parametrize("frac", [0.005, 0.1])  # the blocked and one-pass loops
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_unit_fill_from_a_separate_base_equals_copy_then_apply(dtype, frac):
  """With `src`, `out` starts as garbage and ends as src + changes (what `decode` runs)."""
  base, new, raw, ch = _unit_body(dtype, n=100_000, frac=frac)
  src = base.copy()
  src.flags.writeable = False  # a caller's read-only base
  for use_numba in (True, False):
    out = np.full_like(base, 0xAB)
    assert unit_kernels.unit_apply(raw, out, use_numba=use_numba, src=src) == ch
    np.testing.assert_array_equal(out, new)
    out = np.full_like(base, 0xAB)
    assert unit_kernels.unit_apply(raw, out, undo=True, want_hash=False, use_numba=use_numba,
                                   src=new) == 0
    np.testing.assert_array_equal(out, base)
    short = np.empty(base.size - 5, dtype)  # a position outside: rejected, base untouched
    assert unit_kernels.unit_apply(raw, short, use_numba=use_numba, src=src[:-5]) is None
  np.testing.assert_array_equal(src, base)


def _dense_body(dtype, n, frac=0.3, seed=0, exceptions=True):
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  base = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
  new = base.copy()
  idx = np.flatnonzero(rng.random(n) < frac)
  new[idx] += np.where(rng.random(idx.size) < 0.5, dtype(1), info.max).astype(dtype)
  if exceptions:
    new[idx[5::40]] += dtype(7)
    new[n - 1] = base[n - 1] ^ info.max  # an exception in the last (partial) byte
  kind, payload, _, _ = codec.encode_chunk(base, new, zstandard.ZstdCompressor(level=1))
  assert kind == codec.DENSE_UNIT
  return base, new, zstandard.ZstdDecompressor().decompress(payload)


@pytest.mark.parametrize("n", [4096, 4097, 4099])  # SWAR lanes plus a tail of 0, 1, 3
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_dense_unit_numba_and_numpy_paths_are_bit_identical(dtype, n):
  for exceptions in (True, False):
    base, new, raw = _dense_body(dtype, n, exceptions=exceptions)
    assert (unit_kernels.DENSE_UNIT_HEAD.unpack_from(raw)[1] > 0) == exceptions
    for use_numba in (True, False):
      out = base.copy()
      assert unit_kernels.dense_unit_apply(raw, out, use_numba=use_numba)
      np.testing.assert_array_equal(out, new)
      assert unit_kernels.dense_unit_apply(raw, out, undo=True, use_numba=use_numba)
      np.testing.assert_array_equal(out, base)
      src = np.zeros(n + 1, dtype)[1:]  # filling from a separate (unaligned, read-only) base
      src[...] = base
      src.flags.writeable = False
      out = np.full_like(base, 0xAB)
      assert unit_kernels.dense_unit_apply(raw, out, use_numba=use_numba, src=src)
      np.testing.assert_array_equal(out, new)
  unaligned = np.zeros(n + 1, dtype)[1:]  # a chunk that does not start on 8 bytes
  unaligned[...] = base
  assert unit_kernels.dense_unit_apply(raw, unaligned)
  np.testing.assert_array_equal(unaligned, new)


def _dense_with(raw, packed=None, exc=None):
  """`raw` (a uint16 DENSE_UNIT body without exceptions) with other symbols or exceptions."""
  n, _ = unit_kernels.DENSE_UNIT_HEAD.unpack_from(raw)
  h = unit_kernels.DENSE_UNIT_HEAD.size
  packed = raw[h:h + -(-n // 4)] if packed is None else packed
  pos, vals = exc or ([], [])
  planes = fmt.gap_planes(np.asarray(pos, np.int64))
  v = np.ascontiguousarray(np.asarray(vals, "<u2").view(np.uint8).reshape(-1, 2).T).tobytes()
  return unit_kernels.DENSE_UNIT_HEAD.pack(n, len(pos)) + bytes(packed) + planes + v


@pytest.mark.parametrize("use_numba", [True, False])
def test_malformed_dense_unit_bodies_leave_the_chunk_unchanged(use_numba):
  base, _, raw = _dense_body(np.uint16, 4099, exceptions=False)
  h = unit_kernels.DENSE_UNIT_HEAD.size
  packed = np.frombuffer(raw, np.uint8, 1025, h).copy()
  zero = np.flatnonzero(((packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3)
                        .reshape(-1)[:4099] == 0)
  three = packed.copy()
  three[700] |= 0xC0  # a symbol 3, found only while applying: undone
  pad = packed.copy()
  pad[-1] |= 0x40  # a padding symbol beyond the 4099th element
  busy = np.flatnonzero(((packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3)
                        .reshape(-1)[:4099] != 0)
  bad = [raw[:-1], raw + b"\0", raw[:5],
         unit_kernels.DENSE_UNIT_HEAD.pack(4098, 0) + raw[h:],  # another element count
         _dense_with(raw, three), _dense_with(raw, pad),
         _dense_with(raw, exc=([4099], [4])),  # outside the chunk
         _dense_with(raw, exc=([zero[2], 5000], [4, 4])),
         _dense_with(raw, exc=([zero[1]], [0])),  # changes nothing
         _dense_with(raw, exc=([busy[0]], [4]))]  # on an element that has a symbol
  assert unit_kernels.dense_unit_apply(_dense_with(raw, exc=([zero[1], zero[9]], [4, 6])),
                                  base.copy(), use_numba=use_numba)
  out = base.copy()
  for body in bad:
    assert not unit_kernels.dense_unit_apply(body, out, use_numba=use_numba)
    np.testing.assert_array_equal(out, base)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
