"""Lossless per-chunk codec for the difference between two weight chunks.

What: `encode_chunk(base, new)` turns two equally long unsigned-integer views of the same
tensor chunk (the bit patterns of bf16/fp16/fp32 weights) into a compressed payload, and
`decode_chunk` rebuilds `new` bit-exactly from `base` and that payload.

Why this encoding. An RL step on the sampler's bf16 copy leaves ~95-99% of the weights
bit-identical, and a weight that does change usually moves by one or two ulps. Two facts follow:

* Positions carry most of the information. We store them as gaps (number of unchanged
  elements before each changed one). With a changed fraction p the gaps are roughly geometric,
  whose entropy, -log2-weighted, is H(p)/p bits per changed element (6 bits at p=4%). The gaps
  are split into byte planes (low bytes, then middle, then high) so zstd's Huffman stage sees a
  stream of small symbols and the upper planes collapse to almost nothing.
* Values are stored as the *integer difference of bit patterns*, zig-zag mapped, not as XOR.
  IEEE floats are sign-magnitude, so within one sign the bit pattern is monotonic in the value:
  a step of k ulps is a difference of exactly k, even across an exponent boundary. XOR instead
  smears a +1 carry over several low bits (x ^ (x+1) = 0b0111..1), costing ~2 bits of entropy
  where the zig-zag difference costs ~1. Zig-zag maps +-1 to 2/1, so the high byte planes are
  all zero and vanish under zstd.

For dense changes (e.g. 25% of a chunk changed, or fp32 masters) the position stream stops
paying for itself, so the encoder also tries a DENSE form (zig-zag difference of every element,
byte-plane split, zstd) and keeps the smaller. Chunks that are identical cost a few bytes (SAME).
Tensors without a usable base are stored RAW (byte planes of the new bits, zstd).

Every zstd frame carries its own content checksum, so a flipped bit in a payload fails loudly
in `decode_chunk`; the caller additionally checks a hash of every rebuilt chunk.
"""

import struct

import numpy as np
import zstandard

SAME = 0  # Chunk unchanged: empty payload.
SPARSE = 1  # Gap byte planes + zig-zag value byte planes.
DENSE = 2  # Zig-zag difference of every element, byte planes.
RAW = 3  # New bits only (no base), byte planes.
KIND_NAMES = {SAME: "same", SPARSE: "sparse", DENSE: "dense", RAW: "raw"}

# Try the dense form too once this fraction of a chunk has changed; below it, sparse is always
# smaller (measured: at 10% changed the sparse payload is ~0.6x the dense one).
_DENSE_TRY_FRACTION = 0.1
# Gaps are stored in three byte planes, so a chunk may hold at most 2**24 elements.
MAX_CHUNK_ELEMS = 1 << 24

_SPARSE_HEAD = struct.Struct("<I")  # number of changed elements


class CodecError(ValueError):
  """A payload is damaged or does not fit the chunk it is applied to."""


def _signed(dtype):
  return np.dtype(f"i{np.dtype(dtype).itemsize}")


def _planes(words: np.ndarray) -> bytes:
  """Byte-plane split: all low bytes, then all next bytes, ... (little-endian)."""
  return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).tobytes()


def _unplanes(buf, dtype, count: int) -> np.ndarray:
  itemsize = np.dtype(dtype).itemsize
  planes = np.frombuffer(buf, np.uint8, count * itemsize).reshape(itemsize, count)
  return np.ascontiguousarray(planes.T).view(dtype).reshape(count)


def _zigzag(diff_unsigned: np.ndarray) -> np.ndarray:
  """Maps a wrapped difference d (as unsigned) to (d << 1) ^ (d >> (bits-1)) (unsigned)."""
  bits = diff_unsigned.itemsize * 8
  s = diff_unsigned.view(_signed(diff_unsigned.dtype))
  return ((s << 1) ^ (s >> (bits - 1))).view(diff_unsigned.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
  one = z.dtype.type(1)
  return (z >> one) ^ (-(z & one).view(_signed(z.dtype))).view(z.dtype)


def _gap_planes(pos: np.ndarray) -> bytes:
  gaps = np.diff(pos, prepend=-1) - 1
  g = gaps.astype("<u4")
  return np.ascontiguousarray(g.view(np.uint8).reshape(-1, 4)[:, :3].T).tobytes()


def _gaps_to_pos(buf, count: int) -> np.ndarray:
  planes = np.frombuffer(buf, np.uint8, count * 3).reshape(3, count)
  g = np.zeros((count, 4), np.uint8)
  g[:, :3] = planes.T  # interleave the planes back into little-endian uint32 gaps
  g = g.view("<u4").reshape(count)
  g += np.uint32(1)
  pos = np.cumsum(g, dtype=np.int64)
  pos -= 1
  return pos


def encode_chunk(base, new, cctx: zstandard.ZstdCompressor):
  """Encodes `new` relative to `base` (same length, same unsigned dtype).

  Args:
    base: 1-D unsigned-integer array, the bit patterns of the parent chunk, or None for RAW.
    new: 1-D unsigned-integer array of the same dtype and length.
    cctx: a zstd compressor (one per thread; created with write_checksum=True).

  Returns:
    (kind, payload bytes, number of changed elements).
  """
  if base is None:
    return RAW, cctx.compress(_planes(new)), new.size
  changed = base != new
  pos = np.flatnonzero(changed)
  nnz = pos.size
  if nnz == 0:
    return SAME, b"", 0
  values = _zigzag(new[pos] - base[pos])
  sparse = cctx.compress(_SPARSE_HEAD.pack(nnz) + _gap_planes(pos) + _planes(values))
  if nnz < _DENSE_TRY_FRACTION * new.size:
    return SPARSE, sparse, nnz
  dense = cctx.compress(_planes(_zigzag(new - base)))
  if len(dense) < len(sparse):
    return DENSE, dense, nnz
  return SPARSE, sparse, nnz


def decode_chunk(kind: int, payload, base, out, dctx: zstandard.ZstdDecompressor):
  """Writes the chunk rebuilt from `base` and `payload` into `out` (same dtype and length).

  `base` may be `out` itself (in-place apply) for every kind. Raises CodecError on a damaged
  payload or one that does not fit the chunk.
  """
  n = out.size
  itemsize = out.itemsize
  try:
    if kind == SAME:
      if len(payload):
        raise CodecError("SAME chunk with a payload")
      if base is not out:
        np.copyto(out, base)
      return
    limit = _SPARSE_HEAD.size + n * (3 + itemsize)
    size = zstandard.frame_content_size(payload)
    if not 0 <= size <= limit:  # -1: unknown size; also guards against decompression bombs
      raise CodecError("payload frame has a missing or implausible content size")
    raw = dctx.decompress(payload)
    if kind == RAW:
      if len(raw) != n * itemsize:
        raise CodecError("RAW payload has the wrong length")
      out[...] = _unplanes(raw, out.dtype, n)
    elif kind == DENSE:
      if len(raw) != n * itemsize:
        raise CodecError("DENSE payload has the wrong length")
      np.add(base, _unzigzag(_unplanes(raw, out.dtype, n)), out=out)
    elif kind == SPARSE:
      (nnz,) = _SPARSE_HEAD.unpack_from(raw)
      if not 0 < nnz <= n or len(raw) != _SPARSE_HEAD.size + nnz * (3 + itemsize):
        raise CodecError("SPARSE payload has the wrong length")
      pos = _gaps_to_pos(memoryview(raw)[_SPARSE_HEAD.size:], nnz)
      if pos[-1] >= n:
        raise CodecError("SPARSE position outside the chunk")
      values = _unzigzag(_unplanes(memoryview(raw)[_SPARSE_HEAD.size + 3 * nnz:], out.dtype, nnz))
      if base is not out:
        np.copyto(out, base)
      np.add.at(out, pos, values)  # unsigned, wraps: exact inverse of the encoder's subtraction
    else:
      raise CodecError(f"unknown chunk kind {kind}")
  except zstandard.ZstdError as e:
    raise CodecError(f"zstd: {e}") from e
