"""Fused sparse-apply kernel: rebuild positions and values, scatter them, checksum the changes.

What: `sparse_apply(raw, out)` takes the decompressed body of a SPARSE chunk payload (see
`codec`: u32 count, three gap byte planes, the value byte planes of zig-zag differences) and
adds the changes into `out` in place, in one pass over the changed elements; it returns the
*changes hash* of what it did. `changes_hash(pos, old, new)` is the same hash computed with
numpy (the encoder's side, and the tests' reference).

Why a compiled kernel: in numpy the same work is five passes (gap planes -> gaps, cumsum ->
positions, value planes -> zig-zag codes, un-zig-zag, `np.add.at`), each materialising an array
of the changed count, and `np.add.at` alone costs more than a memcpy of the whole chunk. The
kernel reads each payload byte once and touches each changed element once. It is compiled with
numba (`nogil=True`: threads apply different chunks at the same time). If numba is not
installed, the same functions run as numpy code with bit-identical results (tested both ways).

The changes hash, the sum over changed elements i of mix(pos_i | old_i << 24 | new_i << 40)
for words of up to 16 bits (an injective 56-bit key: positions are < 2**24), or of
mix(mix(pos_i * C + old_i) ^ new_i) for wider words, mod 2**64 (`mix`: the splitmix64
finaliser; one mix per element instead of two made the bf16 kernel 1.4x faster), is
order-independent (so numpy can compute it vectorised)
and covers every (position, old bits, new bits) triple. `delta` records it per chunk; it lets a
sampler whose held weights are verifiably the parent version check an in-place apply at a cost
proportional to the changed elements (see `delta.apply_inplace`, check="changes").

`unit_apply` does the same for a SPARSE_UNIT body (`codec`): one code per change,
(gap << 1) | sign, where the sign bit says +1 or -1 in the word's integer bit pattern (one ulp
down or up within a sign), and a short list of exceptions (change index, zig-zag difference) for
the other steps. Folding the sign into the gap code halves the bytes zstd's entropy stage must
produce (5 -> ~2 per bf16 change at 4%, 2.5x faster to decompress) and the kernel reads one or
two planes instead of five (1.7x faster at 4%). The hash is optional there: a caller that
checks the rebuilt chunk's xxh3 anyway (check="result", or chunks with many changes, where the
per-change mixing costs more than one hash pass over the chunk) skips it.

`dense_unit_apply` applies a DENSE_UNIT body: a 2-bit symbol per element (0 same, 1 +1,
2 -1; four per byte) and a list of exceptions (position, zig-zag difference). Above ~20%
changed, walking positions one change at a time (~1 ns each) costs more than one streaming
pass over the chunk; for 16-bit words the pass is SWAR: one multiply spreads a byte's four
symbols into the four 16-bit lanes of a u64, and a carry-free lane-wise add applies them
(memory-bound; measured 2x faster than the per-element loop and at memcpy speed).
"""

import os
import struct

import numpy as np

_HEAD = struct.Struct("<I")  # the SPARSE body's element count (`codec._SPARSE_HEAD`)
_HEAD_SIZE = 4
# SPARSE_UNIT body head: count, exceptions, bytes per code (`codec._UNIT_HEAD`).
UNIT_HEAD = struct.Struct("<IIB")
_UNIT_HEAD_SIZE = 9
# DENSE_UNIT body head: elements, exceptions (`codec._DENSE_UNIT_HEAD`).
DENSE_UNIT_HEAD = struct.Struct("<II")
_SPREAD = np.uint64(1 + (1 << 14) + (1 << 28) + (1 << 42))  # byte -> its 2-bit fields in lanes
_LANES3 = np.uint64(0x0003000300030003)
_LANES1 = np.uint64(0x0001000100010001)
_LOW15 = np.uint64(0x7FFF7FFF7FFF7FFF)
_HIGH1 = np.uint64(0x8000800080008000)
_NO_EXC_IDX = np.zeros(0, np.int64)
_NO_EXC_VAL = np.zeros(0, np.uint64)
_C = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S24, _S40 = np.uint64(24), np.uint64(40)
_BLOCK = 256  # changes per gather/scatter block of the kernel (L1-resident scratch)
# One pass when changes are at most ~80 bytes apart on average, else gather in blocks. Measured
# on bf16 (per 64 MB, kernel ms, one pass / blocks): 2.2% changed 7.9 / 6.3, 2.6% 5.4 / 7.2,
# 3% 3.9 / 6.9, 1% 10.3 / 3.1.
_ONE_PASS_BYTES = 80
_ONE = np.uint64(1)
_ZERO = np.uint64(0)

try:
  if os.environ.get("SYNC_NO_NUMBA"):  # for measuring and testing the fallback in a process
    raise ImportError("SYNC_NO_NUMBA is set")
  import numba  # pylint: disable=g-import-not-at-top
except ImportError:
  numba = None

HAVE_NUMBA = numba is not None


def _mix_np(x: np.ndarray) -> np.ndarray:
  x = (x ^ (x >> _S30)) * _M1
  x = (x ^ (x >> _S27)) * _M2
  return x ^ (x >> _S31)


def changes_hash(pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
  """The changes hash of elements `pos` going from bits `old` to bits `new` (numpy)."""
  if not len(pos):
    return 0
  p, o, n = pos.astype(np.uint64), old.astype(np.uint64), new.astype(np.uint64)
  with np.errstate(over="ignore"):
    if old.itemsize <= 2:  # 24 + 16 + 16 bits: one injective key, one mix
      h = _mix_np(p | (o << _S24) | (n << _S40))
    else:
      h = _mix_np(_mix_np(p * _C + o) ^ n)
  return int(h.sum(dtype=np.uint64))


def _parse(raw, n: int, itemsize: int) -> int:
  """The element count of a SPARSE body, after checking its length; -1 if malformed."""
  if len(raw) < _HEAD.size:
    return -1
  (nnz,) = _HEAD.unpack_from(raw)
  if not 0 < nnz <= n or len(raw) != _HEAD.size + nnz * (3 + itemsize):
    return -1
  return nnz


def _sparse_apply_np(raw: np.ndarray, nnz: int, out: np.ndarray, undo: bool):
  from sync import codec  # pylint: disable=g-import-not-at-top  (codec imports this module)
  pos = codec._gaps_to_pos(raw[_HEAD.size:], nnz)  # pylint: disable=protected-access
  if pos[-1] >= out.size:
    return -1, 0
  vals = codec._unzigzag(  # pylint: disable=protected-access
      codec._unplanes(raw[_HEAD.size + 3 * nnz:], out.dtype, nnz))  # pylint: disable=protected-access
  old = out[pos]
  new = old - vals if undo else old + vals  # unsigned: wraps
  out[pos] = new  # positions are distinct (gaps >= 0)
  return 0, changes_hash(pos, old, new)


def _make_kernel(isz: int):
  """The numba kernel for words of `isz` bytes (a compile-time constant: loops unroll)."""
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)
  small = isz <= 2
  planes = tuple(range(isz))

  @numba.njit(nogil=True, cache=False, inline="always")
  def mix(x):
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)

  @numba.njit(nogil=True, cache=False)
  def kernel(raw, nnz, count, out, undo):
    """Applies the first `count` changes; returns (-1, hash), or (k, 0) if a position lies
    outside `out`: then only the first k changes were applied.

    Changes more than _ONE_PASS_BYTES apart on average (bf16 below 2.5% changed) go in blocks of
    _BLOCK: first the positions are decoded and the old words gathered in a tight loop (many
    cache misses in flight: there nearly every change is its own miss, and a loop that also
    scatters and hashes keeps too few outstanding, 3x slower at 1%), then values are rebuilt,
    written and hashed from L1. Denser changes go in one pass.
    """
    n = out.size
    g0 = _HEAD_SIZE
    v0 = g0 + 3 * nnz
    p = -1
    acc = _ZERO
    if nnz * _ONE_PASS_BYTES >= n * isz:  # dense: one pass (hardware prefetch follows the
      for i in range(count):  # stream; blocking measured 1.8x slower at 4%)
        p += 1 + (np.int64(raw[g0 + i]) | (np.int64(raw[g0 + nnz + i]) << 8) |
                  (np.int64(raw[g0 + 2 * nnz + i]) << 16))
        if p >= n:
          return i, _ZERO
        z = _ZERO
        for b in numba.literal_unroll(planes):
          z |= np.uint64(raw[v0 + b * nnz + i]) << np.uint64(8 * b)
        d = (z >> _ONE) ^ (_ZERO - (z & _ONE))
        old = np.uint64(out[p])
        new = ((old - d) if undo else (old + d)) & mask
        out[p] = new
        if small:
          acc += mix(np.uint64(p) | (old << _S24) | (new << _S40))
        else:
          acc += mix(mix(np.uint64(p) * _C + old) ^ new)
      return -1, acc
    pos = np.empty(_BLOCK, np.int64)
    olds = np.empty(_BLOCK, np.uint64)
    for s0 in range(0, count, _BLOCK):
      m = min(_BLOCK, count - s0)
      for j in range(m):
        i = s0 + j
        p += 1 + (np.int64(raw[g0 + i]) | (np.int64(raw[g0 + nnz + i]) << 8) |
                  (np.int64(raw[g0 + 2 * nnz + i]) << 16))
        pos[j] = p
      if p >= n:  # positions increase, so the block's last is outside iff any is
        return s0, _ZERO
      for j in range(m):
        olds[j] = np.uint64(out[pos[j]])
      for j in range(m):
        i = s0 + j
        z = _ZERO
        for b in numba.literal_unroll(planes):
          z |= np.uint64(raw[v0 + b * nnz + i]) << np.uint64(8 * b)
        d = (z >> _ONE) ^ (_ZERO - (z & _ONE))
        old = olds[j]
        new = ((old - d) if undo else (old + d)) & mask
        out[pos[j]] = new
        if small:
          acc += mix(np.uint64(pos[j]) | (old << _S24) | (new << _S40))
        else:
          acc += mix(mix(np.uint64(pos[j]) * _C + old) ^ new)
    return -1, acc

  return kernel


def _make_unit_kernel(isz: int):
  """The numba SPARSE_UNIT kernel for words of `isz` bytes (see `_make_kernel` for the loops).

  The changes hash is not mixed change by change: the loops store each change's key in an
  L1-resident block and a separate loop mixes and sums the block, which LLVM vectorizes
  (AVX-512 64-bit multiplies here): per 128 MB at 4% changed the hash went from ~3.5 ms to
  ~0.6 ms.
  """
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)
  small = isz <= 2

  @numba.njit(nogil=True, cache=False, inline="always")
  def mix(x):
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)

  @numba.njit(nogil=True, cache=False)
  def block_hash(ka, kb, m):
    """The changes hash of one block: ka = key (small words) or pos * C + old, kb = new."""
    acc = _ZERO
    if small:
      for j in range(m):
        acc += mix(ka[j])
    else:
      for j in range(m):
        acc += mix(mix(ka[j]) ^ kb[j])
    return acc

  @numba.njit(nogil=True, cache=False, inline="always")
  def keep(ka, kb, j, p, old, new):
    if small:
      ka[j] = np.uint64(p) | (old << _S24) | (new << _S40)
    else:
      ka[j] = np.uint64(p) * _C + old
      kb[j] = new

  @numba.njit(nogil=True, cache=False)
  def kernel(raw, nnz, cb, exc_idx, exc_val, count, out, undo, want_hash):
    """Applies the first `count` changes; returns (-1, hash or 0), or (k, 0) if a position
    lies outside `out`: then only the first k changes were applied. `exc_idx` (increasing,
    < nnz) and `exc_val` (the differences) are the decoded exceptions."""
    n = out.size
    ne = exc_idx.size
    e = 0
    nxt = exc_idx[0] if ne > 0 else np.int64(nnz)
    p = np.int64(-1)
    acc = _ZERO
    ka = np.empty(_BLOCK, np.uint64)
    kb = np.empty(_BLOCK if not small else 1, np.uint64)
    if nnz * _ONE_PASS_BYTES >= n * isz:  # dense enough for one pass (see `_make_kernel`)
      j = 0
      for i in range(count):
        # The code's byte planes, written out here: a helper function (even numba-inlined)
        # made this loop 4x slower.
        c = np.int64(raw[_UNIT_HEAD_SIZE + i])
        if cb > 1:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + nnz + i]) << 8
        if cb > 2:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + 2 * nnz + i]) << 16
        if cb > 3:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + 3 * nnz + i]) << 24
        p += 1 + (c >> 1)
        if p >= n:
          return i, _ZERO
        if i == nxt:
          d = exc_val[e]
          e += 1
          nxt = exc_idx[e] if e < ne else np.int64(nnz)
        else:
          d = (_ZERO - np.uint64(c & 1)) | _ONE  # sign bit set: -1, else +1
        old = np.uint64(out[p])
        new = ((old - d) if undo else (old + d)) & mask
        out[p] = new
        if want_hash:
          keep(ka, kb, j, p, old, new)
          j += 1
          if j == _BLOCK:
            acc += block_hash(ka, kb, j)
            j = 0
      if want_hash:
        acc += block_hash(ka, kb, j)
      return -1, acc
    pos = np.empty(_BLOCK, np.int64)
    olds = np.empty(_BLOCK, np.uint64)
    for s0 in range(0, count, _BLOCK):
      m = min(_BLOCK, count - s0)
      for j in range(m):
        i = s0 + j
        c = np.int64(raw[_UNIT_HEAD_SIZE + i])
        if cb > 1:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + nnz + i]) << 8
        if cb > 2:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + 2 * nnz + i]) << 16
        if cb > 3:
          c |= np.int64(raw[_UNIT_HEAD_SIZE + 3 * nnz + i]) << 24
        p += 1 + (c >> 1)
        pos[j] = p
      if p >= n:
        return s0, _ZERO
      for j in range(m):
        olds[j] = np.uint64(out[pos[j]])
      for j in range(m):
        i = s0 + j
        if i == nxt:
          d = exc_val[e]
          e += 1
          nxt = exc_idx[e] if e < ne else np.int64(nnz)
        else:  # the sign is the low bit of the code's low byte
          d = (_ZERO - np.uint64(raw[_UNIT_HEAD_SIZE + i] & 1)) | _ONE
        old = olds[j]
        new = ((old - d) if undo else (old + d)) & mask
        out[pos[j]] = new
        if want_hash:
          keep(ka, kb, j, pos[j], old, new)
      if want_hash:
        acc += block_hash(ka, kb, m)
    return -1, acc

  return kernel


def _make_dense_kernel(isz: int):
  """The numba DENSE_UNIT kernel for words of `isz` bytes: one element at a time."""
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)

  @numba.njit(nogil=True, cache=False)
  def kernel(packed, out, undo):
    """Adds (undo: subtracts) every element's symbol; returns whether a symbol 3 was seen."""
    bad = False
    for i in range(out.size):
      s = (np.uint64(packed[i >> 2]) >> np.uint64(2 * (i & 3))) & np.uint64(3)
      bad |= s == 3
      d = (_ZERO - (s >> _ONE)) | (s & _ONE)  # 0, 1 or all ones (-1)
      old = np.uint64(out[i])
      out[i] = ((old - d) if undo else (old + d)) & mask
    return bad

  return kernel


if HAVE_NUMBA:
  _KERNELS = {isz: _make_kernel(isz) for isz in (1, 2, 4, 8)}
  _UNIT_KERNELS = {isz: _make_unit_kernel(isz) for isz in (1, 2, 4, 8)}
  _DENSE_KERNELS = {isz: _make_dense_kernel(isz) for isz in (1, 2, 4, 8)}

  @numba.njit(nogil=True, cache=False)
  def _dense_swar16(packed, out64, undo):
    """DENSE_UNIT for 16-bit words, four per u64 lane group; returns whether a symbol 3 was
    seen. Lane-wise add/subtract without carries between lanes (the SWAR identities)."""
    bad = _ZERO
    for j in range(out64.size):
      s = (np.uint64(packed[j]) * _SPREAD) & _LANES3  # the byte's 4 symbols, one per lane
      bad |= s & (s >> _ONE)
      a = (s & _LANES1) | (((s >> _ONE) & _LANES1) * np.uint64(0xFFFF))  # 0, 1 or 0xFFFF
      x = out64[j]
      if undo:
        out64[j] = ((x | _HIGH1) - (a & _LOW15)) ^ ((x ^ ~a) & _HIGH1)
      else:
        out64[j] = ((x & _LOW15) + (a & _LOW15)) ^ ((x ^ a) & _HIGH1)
    return bad != _ZERO


if HAVE_NUMBA:

  @numba.njit(nogil=True, cache=False)
  def _exceptions_nb(buf, e0, nexc, isz, limit, packed):
    """Decodes and checks an exception list (see `_exceptions`) in one compiled pass."""
    pos = np.empty(nexc, np.int64)
    vals = np.empty(nexc, np.uint64)
    mask = ~_ZERO if isz == 8 else (_ONE << np.uint64(8 * isz)) - _ONE
    v0 = e0 + 3 * nexc
    p = np.int64(-1)
    for i in range(nexc):
      p += 1 + (np.int64(buf[e0 + i]) | (np.int64(buf[e0 + nexc + i]) << 8) |
                (np.int64(buf[e0 + 2 * nexc + i]) << 16))
      z = _ZERO
      for b in range(isz):
        z |= np.uint64(buf[v0 + b * nexc + i]) << np.uint64(8 * b)
      v = ((z >> _ONE) ^ (_ZERO - (z & _ONE))) & mask
      if p >= limit or v == _ZERO:
        return False, pos, vals
      if packed.size and (packed[p >> 2] >> (2 * (p & 3))) & 3:
        return False, pos, vals
      pos[i] = p
      vals[i] = v
    return True, pos, vals

  @numba.njit(nogil=True, cache=False)
  def _scatter_nb(out, pos, vals, undo):
    for i in range(pos.size):
      if undo:
        out[pos[i]] -= vals[i]
      else:
        out[pos[i]] += vals[i]

_NO_PACKED = np.zeros(0, np.uint8)


def _exceptions(buf, e0: int, nexc: int, itemsize: int, limit: int, packed, use_numba: bool):
  """An exception list: the gaps between `nexc` increasing indices (3 byte planes), then their
  zig-zag differences (`itemsize` planes) from `buf[e0:]`, as (int64 indices, uint64
  differences), or None if an index reaches `limit`, a difference is 0, or (dense) an index's
  symbol is not 0."""
  if not nexc:
    return _NO_EXC_IDX, _NO_EXC_VAL
  if use_numba:
    ok, pos, vals = _exceptions_nb(buf, e0, nexc, itemsize, limit, packed)
    return (pos, vals) if ok else None
  pos = np.cumsum(_planes_to_u64(buf[e0:e0 + 3 * nexc], nexc, 3).astype(np.int64) + 1) - 1
  z = _planes_to_u64(buf[e0 + 3 * nexc:e0 + (3 + itemsize) * nexc], nexc, itemsize)
  mask = ~_ZERO if itemsize == 8 else np.uint64((1 << (8 * itemsize)) - 1)
  vals = ((z >> _ONE) ^ (_ZERO - (z & _ONE))) & mask  # un-zig-zag, as `itemsize` words
  if pos[-1] >= limit or not np.all(vals):
    return None
  if packed.size and np.any((packed[pos >> 2] >> (2 * (pos & 3)).astype(np.uint8)) & 3):
    return None
  return pos, vals


def _planes_to_u64(buf: np.ndarray, count: int, nplanes: int) -> np.ndarray:
  """`count` little-endian integers stored as `nplanes` byte planes, as uint64."""
  out = np.zeros(count, np.uint64)
  for b in range(nplanes):
    out |= buf[b * count:(b + 1) * count].astype(np.uint64) << np.uint64(8 * b)
  return out


def parse_unit(buf: np.ndarray, n: int, itemsize: int, use_numba: bool = False):
  """Checks a SPARSE_UNIT body's layout and decodes its exceptions.

  Returns:
    (count, bytes per code, exception indices (int64), exception differences (uint64, to
    add)), or None if the body is malformed: wrong length, code width outside 1..4,
    exception index not below the count, or an exception that changes
    nothing.
  """
  if len(buf) < _UNIT_HEAD_SIZE:
    return None
  nnz, nexc, cb = UNIT_HEAD.unpack_from(buf)
  if not (0 < nnz <= n and nexc <= nnz and 1 <= cb <= 4 and
          len(buf) == _UNIT_HEAD_SIZE + nnz * cb + nexc * (3 + itemsize)):
    return None
  exc = _exceptions(buf, _UNIT_HEAD_SIZE + nnz * cb, nexc, itemsize, nnz, _NO_PACKED,
                    use_numba)
  return None if exc is None else (nnz, cb, *exc)


def _unit_apply_np(buf, nnz, cb, idx, vals, out, undo, want_hash):
  c = _planes_to_u64(buf[_UNIT_HEAD_SIZE:_UNIT_HEAD_SIZE + cb * nnz], nnz, cb)
  pos = np.cumsum((c >> _ONE).astype(np.int64) + 1) - 1
  if pos[-1] >= out.size:
    return -1, 0
  d = np.where(c & _ONE, ~_ZERO, _ONE)
  d[idx] = vals
  old = out[pos]
  dd = d.astype(out.dtype)  # wraps to the word width: -1 -> all ones
  new = old - dd if undo else old + dd  # unsigned: wraps
  out[pos] = new  # positions are distinct (gaps >= 0)
  return 0, changes_hash(pos, old, new) if want_hash else 0


def unit_apply(raw, out: np.ndarray, undo: bool = False, want_hash: bool = True,
               use_numba: bool | None = None):
  """Adds (or with `undo` subtracts) a SPARSE_UNIT body's changes into `out`, in place.

  Args:
    raw: the decompressed SPARSE_UNIT payload (bytes-like).
    out: 1-D C-contiguous unsigned-integer chunk (the bit patterns), modified in place.
    undo: subtract instead (the exact inverse).
    want_hash: compute the changes hash (else 0 is returned on success).
    use_numba: force one implementation (default: numba when installed).

  Returns:
    The changes hash (0 without `want_hash`), or None if the body is malformed (see
    `parse_unit`, or a position outside `out`); then `out` is unchanged.
  """
  buf = np.frombuffer(raw, np.uint8)
  if use_numba is None:
    use_numba = HAVE_NUMBA
  if use_numba and not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  parsed = parse_unit(buf, out.size, out.itemsize, use_numba)
  if parsed is None:
    return None
  nnz, cb, idx, vals = parsed
  if not use_numba:
    status, h = _unit_apply_np(buf, nnz, cb, idx, vals, out, undo, want_hash)
    return None if status < 0 else int(h)
  kernel = _UNIT_KERNELS[out.itemsize]
  applied, h = kernel(buf, nnz, cb, idx, vals, nnz, out, undo, want_hash)
  if applied >= 0:  # a position outside the chunk: take back the changes applied before it
    kernel(buf, nnz, cb, idx, vals, applied, out, not undo, False)
    return None
  return int(h)


def sparse_apply(raw, out: np.ndarray, undo: bool = False, use_numba: bool | None = None):
  """Adds (or with `undo` subtracts) a SPARSE body's changes into `out`, in place.

  Args:
    raw: the decompressed SPARSE payload (bytes-like).
    out: 1-D C-contiguous unsigned-integer chunk (the bit patterns), modified in place.
    undo: subtract instead (the exact inverse: unsigned arithmetic wraps).
    use_numba: force one implementation (default: numba when installed).

  Returns:
    The changes hash of the (position, bits before, bits after) triples, or None if the body
    is malformed (wrong length, or a position outside `out`); then `out` is unchanged.
  """
  buf = np.frombuffer(raw, np.uint8)
  nnz = _parse(buf, out.size, out.itemsize)
  if nnz < 0:
    return None
  if use_numba is None:
    use_numba = HAVE_NUMBA
  if use_numba and not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  if not use_numba:
    status, h = _sparse_apply_np(buf, nnz, out, undo)
    return None if status < 0 else int(h)
  kernel = _KERNELS[out.itemsize]
  applied, h = kernel(buf, nnz, nnz, out, undo)
  if applied >= 0:  # a position outside the chunk: take back the changes applied before it
    kernel(buf, nnz, applied, out, not undo)
    return None
  return int(h)


def parse_dense_unit(buf: np.ndarray, n: int, itemsize: int, use_numba: bool = False):
  """Checks a DENSE_UNIT body's layout and decodes its exceptions.

  Returns:
    (packed symbols (uint8), exception positions (int64), exception differences (uint64)),
    or None if malformed: wrong element count or length, padding symbols
    set, an exception position outside the chunk, an exception whose symbol is
    not 0, or one that changes nothing. (Symbol 3 is caught while applying.)
  """
  h = DENSE_UNIT_HEAD.size
  if len(buf) < h:
    return None
  count, nexc = DENSE_UNIT_HEAD.unpack_from(buf)
  nbytes = -(-n // 4)
  if count != n or nexc > n or len(buf) != h + nbytes + nexc * (3 + itemsize):
    return None
  packed = buf[h:h + nbytes]
  if n % 4 and packed[-1] >> (2 * (n % 4)):
    return None
  exc = _exceptions(buf, h + nbytes, nexc, itemsize, n, packed, use_numba)
  return None if exc is None else (packed, *exc)


def _dense_np(packed: np.ndarray, out: np.ndarray, undo: bool) -> bool:
  sym = ((packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1)[:out.size]
  if np.any(sym == 3):
    return True
  d = sym.astype(out.dtype)
  d[sym == 2] = np.iinfo(out.dtype).max  # -1, wrapped
  (np.subtract if undo else np.add)(out, d, out=out)  # unsigned: wraps
  return False


def dense_unit_apply(raw, out: np.ndarray, undo: bool = False,
                     use_numba: bool | None = None) -> bool:
  """Adds (or with `undo` subtracts) a DENSE_UNIT body's changes into `out`, in place.

  Args:
    raw: the decompressed DENSE_UNIT payload (bytes-like).
    out: 1-D C-contiguous unsigned-integer chunk (the bit patterns), modified in place.
    undo: subtract instead (the exact inverse).
    use_numba: force one implementation (default: numba when installed).

  Returns:
    True, or False if the body is malformed (see `parse_dense_unit`; or a symbol 3); then
    `out` is unchanged.
  """
  if use_numba is None:
    use_numba = HAVE_NUMBA
  if use_numba and not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  parsed = parse_dense_unit(np.frombuffer(raw, np.uint8), out.size, out.itemsize, use_numba)
  if parsed is None:
    return False
  packed, pos, vals = parsed

  def run(back):
    if not use_numba:
      return _dense_np(packed, out, back)
    if out.itemsize != 2:
      return _DENSE_KERNELS[out.itemsize](packed, out, back)
    m = out.size // 4 * 4
    bad = _dense_swar16(packed, out[:m].view(np.uint64), back)
    if m < out.size:  # the last 1-3 elements
      bad |= _DENSE_KERNELS[2](packed[m // 4:], out[m:], back)
    return bad

  if run(undo):
    run(not undo)  # exact inverse: symbol 3 adds -1 both ways
    return False
  if len(pos):  # positions are distinct
    if use_numba:
      _scatter_nb(out, pos, vals, undo)
    else:
      (np.subtract if undo else np.add).at(out, pos, vals.astype(out.dtype))
  return True


def warm_up() -> None:
  """Compiles the kernel for the common word sizes (a few seconds, once per process)."""
  if HAVE_NUMBA:
    body = _HEAD.pack(1) + bytes(3) + bytes(8)
    for dt in (np.uint16, np.uint32):
      sparse_apply(body[:_HEAD.size + 3 + np.dtype(dt).itemsize], np.zeros(1, dt))
      sparse_apply(body[:_HEAD.size + 3 + np.dtype(dt).itemsize], np.zeros(1, dt), undo=True)
      isz = np.dtype(dt).itemsize
      four = bytes([4]) + bytes(isz - 1)  # one exception: a step of +2 (zig-zag 4)
      for nexc in (0, 1):
        unit_apply(UNIT_HEAD.pack(1, nexc, 1) + bytes(1) + (bytes(3) + four) * nexc,
                   np.zeros(1, dt))
        dense_unit_apply(DENSE_UNIT_HEAD.pack(5, nexc) + bytes(2) + (bytes(3) + four) * nexc,
                         np.zeros(5, dt))
