"""Tests for the per-chunk codec: every kind round-trips bit-exactly and bad payloads fail."""

import sys

import numpy as np
import pytest
import zstandard

from sync.delta import chunk_format as fmt
from sync.delta import codec


def _ctx():
  return (zstandard.ZstdCompressor(level=1, write_checksum=True),
          zstandard.ZstdDecompressor())


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8, np.uint64])
def test_zigzag_roundtrip_covers_extremes(dtype):
  info = np.iinfo(dtype)
  x = np.array([0, 1, 2, info.max, info.max - 1, info.max // 2, info.max // 2 + 1], dtype)
  np.testing.assert_array_equal(fmt.unzigzag(fmt.zigzag(x)), x)
  # Small signed steps map to small codes: +1 -> 2, -1 -> 1.
  np.testing.assert_array_equal(fmt.zigzag(np.array([1, info.max], dtype)), [2, 1])


@pytest.mark.parametrize("frac,kind", [(0.0, codec.SAME), (0.01, codec.SPARSE),
                                       (0.9, codec.DENSE)])
def test_kinds_roundtrip(frac, kind):
  cctx, dctx = _ctx()
  rng = np.random.default_rng(0)
  base = rng.integers(0, 1 << 16, 50_000, dtype=np.uint16)
  new = base.copy()
  idx = rng.random(base.size) < frac
  new[idx] += rng.integers(1, 3, idx.sum()).astype(np.uint16)
  got_kind, payload, nnz, _ = codec.encode_chunk(base, new, cctx)
  assert got_kind == kind and nnz == idx.sum()
  out = np.empty_like(base)
  codec.decode_chunk(got_kind, payload, base, out, dctx)
  np.testing.assert_array_equal(out, new)
  inplace = base.copy()  # base is out: apply in place
  codec.decode_chunk(got_kind, payload, inplace, inplace, dctx)
  np.testing.assert_array_equal(inplace, new)


def test_gaps_span_all_three_planes():
  cctx, dctx = _ctx()
  base = np.zeros(1 << 20, np.uint32)
  new = base.copy()
  new[[0, 1, 300, 70_000, (1 << 20) - 1]] = [1, 5, 0xFFFFFFFF, 7, 9]
  kind, payload, *_ = codec.encode_chunk(base, new, cctx)
  assert kind == codec.SPARSE
  out = np.empty_like(base)
  codec.decode_chunk(kind, payload, base, out, dctx)
  np.testing.assert_array_equal(out, new)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_unit_steps_fold_into_the_gap_codes(dtype):
  """+-1 steps give SPARSE_UNIT (smaller than SPARSE); gaps up to 2**24 - 1 need 4 code
  bytes; other steps are exceptions; every decoding path agrees."""
  cctx, dctx = _ctx()
  n = 1 << 24
  base = np.zeros(n, dtype)
  base[::4096] = np.arange(n // 4096, dtype=dtype)
  new = base.copy()
  pos = np.array([0, 1, 2, 300, 70_000, 5_000_000, n - 1])
  new[pos] += np.array([1, -1, 1, -1, 1, 1, -1]).astype(dtype)  # +-1, wrapping below 0
  kind, payload, nnz, ch = codec.encode_chunk(base, new, cctx)
  assert kind == codec.SPARSE_UNIT and nnz == pos.size
  raw = dctx.decompress(payload)
  assert fmt.UNIT_HEAD.unpack_from(raw) == (pos.size, 0, 4)  # gap n - 5_000_002: 4 bytes
  got_pos, values = codec.decode_changes(kind, payload, n, dtype, dctx)
  np.testing.assert_array_equal(got_pos, pos)
  np.testing.assert_array_equal(values, new[pos] - base[pos])
  out = np.empty_like(base)
  codec.decode_chunk(kind, payload, base, out, dctx)
  np.testing.assert_array_equal(out, new)
  inplace = base.copy()
  assert codec.apply_chunk(kind, payload, inplace, dctx) == ch
  np.testing.assert_array_equal(inplace, new)
  assert codec.apply_chunk(kind, payload, inplace, dctx, undo=True, hash_limit=0.0) is None
  np.testing.assert_array_equal(inplace, base)
  # Many steps that are not +-1: SPARSE; a few: exceptions inside SPARSE_UNIT.
  rng = np.random.default_rng(0)
  many = base.copy()
  idx = np.flatnonzero(rng.random(n) < 0.001)
  many[idx] += rng.integers(1, 3, idx.size).astype(dtype)
  assert codec.encode_chunk(base, many, cctx)[0] == codec.SPARSE
  few = base.copy()
  few[idx] += dtype(1)
  few[idx[::20]] += dtype(2)  # 1/20 of the changes are steps of 3
  kind, payload, _, ch = codec.encode_chunk(base, few, cctx)
  assert kind == codec.SPARSE_UNIT and fmt.UNIT_HEAD.unpack_from(
      dctx.decompress(payload))[1] == idx[::20].size
  out = base.copy()
  assert codec.apply_chunk(kind, payload, out, dctx) == ch
  np.testing.assert_array_equal(out, few)
  sparse = cctx.compress(fmt.SPARSE_HEAD.pack(idx.size) + fmt.gap_planes(idx) +
                         fmt.planes(fmt.zigzag(few[idx] - base[idx])))
  assert len(payload) < len(sparse)


@pytest.mark.parametrize("frac", [0.25, 0.9])
def test_busy_unit_steps_use_dense_unit(frac):
  cctx, dctx = _ctx()
  rng = np.random.default_rng(1)
  base = rng.integers(0, 1 << 16, 50_001, dtype=np.uint16)
  new = base.copy()
  idx = np.flatnonzero(rng.random(base.size) < frac)
  new[idx] += np.where(rng.random(idx.size) < 0.5, 1, 0xFFFF).astype(np.uint16)
  new[idx[::50]] += np.uint16(9)  # exceptions
  kind, payload, nnz, ch = codec.encode_chunk(base, new, cctx)
  assert kind == codec.DENSE_UNIT and nnz == idx.size and ch == 0
  np.testing.assert_array_equal(codec.decode_changes(kind, payload, base.size, np.uint16, dctx),
                                new - base)
  out = np.empty_like(base)
  codec.decode_chunk(kind, payload, base, out, dctx)
  np.testing.assert_array_equal(out, new)
  inplace = base.copy()
  assert codec.apply_chunk(kind, payload, inplace, dctx) is None  # no changes hash: hash whole
  np.testing.assert_array_equal(inplace, new)
  codec.apply_chunk(kind, payload, inplace, dctx, undo=True)
  np.testing.assert_array_equal(inplace, base)
  with pytest.raises(codec.CodecError):  # a payload for another chunk length
    codec.apply_chunk(kind, payload, base[:-1].copy(), dctx)
  # Steps that are mostly not +-1: the plain forms.
  other = base.copy()
  other[idx] += np.uint16(3)
  assert codec.encode_chunk(base, other, cctx)[0] in (codec.SPARSE, codec.DENSE)


def test_raw_roundtrip_and_damage_detected():
  cctx, dctx = _ctx()
  new = np.arange(1000, dtype=np.uint16)
  kind, payload, *_ = codec.encode_chunk(None, new, cctx)
  out = np.empty_like(new)
  codec.decode_chunk(kind, payload, None, out, dctx)
  np.testing.assert_array_equal(out, new)
  bad = bytearray(payload)
  bad[len(bad) // 2] ^= 0x10
  with pytest.raises(codec.CodecError):
    codec.decode_chunk(kind, bytes(bad), None, out, dctx)


def test_payload_for_a_smaller_chunk_is_rejected():
  cctx, dctx = _ctx()
  base = np.zeros(100, np.uint16)
  new = base.copy()
  new[99] = 3
  kind, payload, *_ = codec.encode_chunk(base, new, cctx)
  with pytest.raises(codec.CodecError):
    codec.decode_chunk(kind, payload, base[:50], np.empty(50, np.uint16), dctx)
  with pytest.raises(codec.CodecError):  # declared content size far above the chunk: a bomb
    codec.decode_chunk(codec.DENSE, cctx.compress(bytes(10_000)), base, np.empty_like(base),
                       dctx)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
