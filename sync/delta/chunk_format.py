"""The binary format of one chunk's payload: kinds, body layouts, and the changes hash.

What: the definitions the encoder (`codec`) and the two decoding kernel modules
(`sparse_kernels`, `unit_kernels`) share, so that each of them imports this module and none
reaches into another's private names. A chunk is a slice of one tensor's bit patterns (an
unsigned-integer view, `itemsize` bytes per element, at most MAX_CHUNK_ELEMS elements). Its
record in a blob (`api`) carries a kind and a payload; every payload except SAME's is one zstd
frame (with content size and checksum) of a body laid out as follows, little-endian, where
"k planes" of `count` integers means k byte planes: all their lowest bytes, then all next
bytes, and so on (`planes`, `planes_to_u64`):

* SAME: no payload; the chunk equals its base.
* SPARSE: u32 count; the gaps (unchanged elements before each changed one) as 3 planes; the
  zig-zag differences of the changed elements' bits (`zigzag`) as `itemsize` planes.
* DENSE: the zig-zag difference of every element, `itemsize` planes.
* RAW: the new bits of every element, `itemsize` planes (no base).
* SPARSE_UNIT: u32 count, u32 exceptions, u8 code bytes `cb` (UNIT_HEAD); one code
  (gap << 1) | sign per change as `cb` planes, where sign 0 is a step of +1 in the integer bit
  pattern and 1 a step of -1; then the exceptions, the changes that are other steps: the gaps
  between their change indices (3 planes) and their zig-zag differences (`itemsize` planes).
  For an exception the code's sign bit is ignored.
* DENSE_UNIT: u32 elements, u32 exceptions (DENSE_UNIT_HEAD); a 2-bit symbol per element
  (0 same, 1 +1, 2 -1; element i in bits 2 * (i % 4) of byte i // 4, padding bits 0); then the
  exceptions: the gaps between their positions (3 planes) and their zig-zag differences. An
  exception's symbol is 0.

Differences are of the integer bit patterns and wrap (unsigned arithmetic), so adding them is
exactly undone by subtracting them. Gaps fit 3 bytes because a chunk has at most 2**24
elements.

The *changes hash* of a sparse chunk (`changes_hash`), recorded per SPARSE / SPARSE_UNIT chunk:
the sum mod 2**64 over changed elements i of mix(pos_i | old_i << 24 | new_i << 40) for words
of up to 16 bits (an injective 56-bit key: positions are < 2**24), or of
mix(mix(pos_i * HASH_C + old_i) ^ new_i) for wider words, where `mix` is the splitmix64
finaliser and old / new are the element's bits before and after. The sum is order-independent,
so numpy computes it vectorized and the kernels accumulate it while they write; one mix per
element for small words keeps the bf16 kernels fast.
"""

import struct

import numpy as np

SAME = 0  # Chunk unchanged: empty payload.
SPARSE = 1  # Gap byte planes + zig-zag value byte planes.
DENSE = 2  # Zig-zag difference of every element, byte planes.
RAW = 3  # New bits only (no base), byte planes.
SPARSE_UNIT = 4  # (gap << 1 | sign) code planes + exceptions (blob format >= 3).
DENSE_UNIT = 5  # 2-bit symbol per element + exceptions (blob format >= 3).
KIND_NAMES = {SAME: "same", SPARSE: "sparse", DENSE: "dense", RAW: "raw",
              SPARSE_UNIT: "sparse_unit", DENSE_UNIT: "dense_unit"}
SPARSE_KINDS = (SPARSE, SPARSE_UNIT)

# Gaps are stored in three byte planes, so a chunk may hold at most 2**24 elements.
MAX_CHUNK_ELEMS = 1 << 24

SPARSE_HEAD = struct.Struct("<I")  # SPARSE: number of changed elements
UNIT_HEAD = struct.Struct("<IIB")  # SPARSE_UNIT: changed elements, exceptions, bytes per code
DENSE_UNIT_HEAD = struct.Struct("<II")  # DENSE_UNIT: elements, exceptions

# The changes hash: the multiplier of the wide-word key and the splitmix64 finaliser's
# constants and shifts (the kernels use them as compile-time constants).
HASH_C = np.uint64(0x9E3779B97F4A7C15)
MIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_M2 = np.uint64(0x94D049BB133111EB)
MIX_S1, MIX_S2, MIX_S3 = np.uint64(30), np.uint64(27), np.uint64(31)
KEY_OLD_SHIFT, KEY_NEW_SHIFT = np.uint64(24), np.uint64(40)  # small-word key: pos | old | new


def signed(dtype) -> np.dtype:
  """The signed integer dtype of the same width."""
  return np.dtype(f"i{np.dtype(dtype).itemsize}")


def planes(words: np.ndarray) -> bytes:
  """Byte-plane split: all low bytes, then all next bytes, ... (little-endian)."""
  return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).tobytes()


def unplanes(buf, dtype, count: int) -> np.ndarray:
  """Inverse of `planes` (shift-or of each plane: no strided transpose)."""
  dtype = np.dtype(dtype)
  p = np.frombuffer(buf, np.uint8, count * dtype.itemsize).reshape(dtype.itemsize, count)
  out = p[0].astype(dtype)
  for i in range(1, dtype.itemsize):
    out |= p[i].astype(dtype) << dtype.type(8 * i)
  return out


def planes_to_u64(buf: np.ndarray, count: int, nplanes: int) -> np.ndarray:
  """`count` little-endian integers stored as `nplanes` byte planes, as uint64."""
  out = np.zeros(count, np.uint64)
  for b in range(nplanes):
    out |= buf[b * count:(b + 1) * count].astype(np.uint64) << np.uint64(8 * b)
  return out


def zigzag(diff_unsigned: np.ndarray) -> np.ndarray:
  """Maps a wrapped difference d (as unsigned) to (d << 1) ^ (d >> (bits-1)) (unsigned)."""
  bits = diff_unsigned.itemsize * 8
  s = diff_unsigned.view(signed(diff_unsigned.dtype))
  return ((s << 1) ^ (s >> (bits - 1))).view(diff_unsigned.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
  """Inverse of `zigzag`."""
  one = z.dtype.type(1)
  return (z >> one) ^ (-(z & one).view(signed(z.dtype))).view(z.dtype)


def gap_planes(pos: np.ndarray) -> bytes:
  """The gaps before increasing positions `pos` (unchanged elements in between), 3 planes."""
  gaps = np.diff(pos, prepend=-1) - 1
  g = gaps.astype("<u4")
  return np.ascontiguousarray(g.view(np.uint8).reshape(-1, 4)[:, :3].T).tobytes()


def gaps_to_pos(buf, count: int) -> np.ndarray:
  """Inverse of `gap_planes`: `count` positions (intp, increasing) from 3 gap planes."""
  p = np.frombuffer(buf, np.uint8, count * 3)
  g = p[:count].astype(np.uint32)
  g |= p[count:2 * count].astype(np.uint32) << np.uint32(8)
  g |= p[2 * count:].astype(np.uint32) << np.uint32(16)
  g += np.uint32(1)
  pos = np.cumsum(g, dtype=np.intp)
  pos -= 1
  return pos


def mix(x: np.ndarray) -> np.ndarray:
  """The splitmix64 finaliser, element-wise on uint64."""
  x = (x ^ (x >> MIX_S1)) * MIX_M1
  x = (x ^ (x >> MIX_S2)) * MIX_M2
  return x ^ (x >> MIX_S3)


def changes_hash(pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
  """The changes hash of elements `pos` going from bits `old` to bits `new` (numpy)."""
  if not len(pos):
    return 0
  p, o, n = pos.astype(np.uint64), old.astype(np.uint64), new.astype(np.uint64)
  with np.errstate(over="ignore"):
    if old.itemsize <= 2:  # 24 + 16 + 16 bits: one injective key, one mix
      h = mix(p | (o << KEY_OLD_SHIFT) | (n << KEY_NEW_SHIFT))
    else:
      h = mix(mix(p * HASH_C + o) ^ n)
  return int(h.sum(dtype=np.uint64))
