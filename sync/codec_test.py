"""Tests for the per-chunk codec: every kind round-trips bit-exactly and bad payloads fail."""

import sys

import numpy as np
import pytest
import zstandard

from sync import codec


def _ctx():
  return (zstandard.ZstdCompressor(level=1, write_checksum=True),
          zstandard.ZstdDecompressor())


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8, np.uint64])
def test_zigzag_roundtrip_covers_extremes(dtype):
  info = np.iinfo(dtype)
  x = np.array([0, 1, 2, info.max, info.max - 1, info.max // 2, info.max // 2 + 1], dtype)
  np.testing.assert_array_equal(codec._unzigzag(codec._zigzag(x)), x)
  # Small signed steps map to small codes: +1 -> 2, -1 -> 1.
  np.testing.assert_array_equal(codec._zigzag(np.array([1, info.max], dtype)), [2, 1])


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
