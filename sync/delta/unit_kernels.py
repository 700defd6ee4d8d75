"""Kernels for the unit-step chunk forms: SPARSE_UNIT and DENSE_UNIT (see `chunk_format`).

What: `unit_apply(raw, out)` adds a decompressed SPARSE_UNIT body into `out` in place, like
`sparse_kernels.sparse_apply` does for SPARSE, and returns the same changes hash. The body
holds one code per change, (gap << 1) | sign, where the sign bit says +1 or -1 in the word's
integer bit pattern (one ulp down or up within a sign), and an exception list for the other
steps. Folding the sign into the gap code roughly halves the bytes zstd's entropy stage must
produce per bf16 change, and the kernel reads one or two planes instead of five. The hash is
optional here: a caller that checks the rebuilt chunk's xxh3 anyway (check="result", or chunks
with many changes) skips it; when it is wanted, the loops store each change's key in an
L1-resident block and a separate loop mixes and sums the block, which LLVM vectorizes (64-bit
multiplies in vector registers), instead of mixing change by change.

`dense_unit_apply` applies a DENSE_UNIT body: a 2-bit symbol per element (0 same, 1 +1,
2 -1; four per byte) and a list of exceptions (position, zig-zag difference). Above ~20%
changed, walking positions one change at a time costs more than one streaming pass over the
chunk; for 16-bit words the pass is SWAR: one multiply spreads a byte's four symbols into the
four 16-bit lanes of a u64, and a carry-free lane-wise add applies them (memory-bound, where
the per-element loop is not).

Both forms list the other steps as exceptions: the gaps between their indices (3 byte planes)
and their zig-zag differences, decoded and checked in one compiled pass (`_exceptions`). Like
`sparse_kernels` (whose splitmix64 finaliser, block size and loop choice this module shares),
the kernels are compiled through `jit` (numba loading and the on-disk kernel cache), and
everything also runs as numpy code when numba is missing (bit-identical, tested).
"""

import numpy as np

from sync.delta import chunk_format as fmt
from sync.delta import jit
from sync.delta import sparse_kernels

HAVE_NUMBA = sparse_kernels.HAVE_NUMBA
numba = sparse_kernels.numba
# numba reads module globals as compile-time constants: the hash's and the shared loop
# choice's, bound here.
_C = fmt.HASH_C
_S24, _S40 = fmt.KEY_OLD_SHIFT, fmt.KEY_NEW_SHIFT
_ONE, _ZERO = np.uint64(1), np.uint64(0)
_BLOCK, _ONE_PASS_BYTES = sparse_kernels.BLOCK, sparse_kernels.ONE_PASS_BYTES
_mix = sparse_kernels.mix_nb if HAVE_NUMBA else None

UNIT_HEAD = fmt.UNIT_HEAD
_UNIT_HEAD_SIZE = 9
DENSE_UNIT_HEAD = fmt.DENSE_UNIT_HEAD
_SPREAD = np.uint64(1 + (1 << 14) + (1 << 28) + (1 << 42))  # byte -> its 2-bit fields in lanes
_LANES3 = np.uint64(0x0003000300030003)
_LANES1 = np.uint64(0x0001000100010001)
_LOW15 = np.uint64(0x7FFF7FFF7FFF7FFF)
_HIGH1 = np.uint64(0x8000800080008000)
# Elements copied ahead of the changes when a kernel fills `out` from a separate base (32 KiB
# of bf16: the block and the changes' reads and writes stay in L1/L2).
_FILL = 16384
_NO_EXC_IDX = np.zeros(0, np.int64)
_NO_EXC_VAL = np.zeros(0, np.uint64)


if HAVE_NUMBA:
  # Module-level, not per kernel: a cached kernel must reach other kernels through globals
  # (see `jit`), so the word-size flag `small` is an argument here (a constant in each kernel).

  @jit.njit(nogil=True)
  def _block_hash(ka, kb, m, small):
    """The changes hash of one block: ka = key (small words) or pos * C + old, kb = new."""
    acc = _ZERO
    if small:
      for j in range(m):
        acc += _mix(ka[j])
    else:
      for j in range(m):
        acc += _mix(_mix(ka[j]) ^ kb[j])
    return acc

  @jit.njit(nogil=True, inline="always")
  def _keep(ka, kb, j, p, old, new, small):
    if small:
      ka[j] = np.uint64(p) | (old << _S24) | (new << _S40)
    else:
      ka[j] = np.uint64(p) * _C + old
      kb[j] = new

  @jit.njit(nogil=True)
  def _copy(out, src, a, b):
    for q in range(np.uint64(a), np.uint64(b)):  # unsigned: vectorized
      out[q] = src[q]


def _make_unit_kernel(isz: int, undo: bool, want_hash: bool, fill: bool):
  """The numba SPARSE_UNIT kernel for words of `isz` bytes (loops as the SPARSE kernel's in
  `sparse_kernels`; the hash per block, see the module docstring). `undo`, `want_hash` and
  `fill` are fixed per compiled kernel, and indices are unsigned: that keeps per-change
  branches on the flags and negative-index wrap-around checks out of the one-pass loop, and
  kept the fill's copy loops vectorized."""
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)
  small = isz <= 2
  head = np.uint64(_UNIT_HEAD_SIZE)

  @jit.njit(nogil=True)
  def kernel(raw, nnz, cb, exc_idx, exc_val, count, out, src):
    """Applies the first `count` changes; returns (-1, hash or 0), or (k, 0) if a position
    lies outside `out`: then only the first k changes were applied. `exc_idx` (increasing,
    < nnz) and `exc_val` (the differences) are the decoded exceptions. With `fill`, `out`
    starts as scratch and `src` holds the base: it is copied into `out` a few cache-sized
    blocks ahead of the changes (the changes then read and write cache-hot memory); without
    it `src` is not read (pass `out`)."""
    n = out.size
    un = np.uint64(nnz)
    copied = np.int64(0)
    ne = exc_idx.size
    e = 0
    nxt = exc_idx[0] if ne > 0 else np.int64(nnz)
    p = np.int64(-1)
    acc = _ZERO
    ka = np.empty(_BLOCK if want_hash else 1, np.uint64)
    kb = np.empty(_BLOCK if want_hash and not small else 1, np.uint64)
    if nnz * _ONE_PASS_BYTES >= n * isz:  # dense enough for one pass (see `sparse_kernels`)
      j = 0
      for i in range(count):
        # The code's byte planes, written out here: a helper function (even numba-inlined)
        # made this loop 4-10x slower. Unsigned indices: no wrap-around checks.
        ui = np.uint64(i)
        c = np.uint64(raw[head + ui])
        if cb > 1:
          c |= np.uint64(raw[head + un + ui]) << np.uint64(8)
        if cb > 2:
          c |= np.uint64(raw[head + 2 * un + ui]) << np.uint64(16)
        if cb > 3:
          c |= np.uint64(raw[head + 3 * un + ui]) << np.uint64(24)
        p += np.int64(c >> _ONE) + 1
        if p >= n:
          return i, _ZERO
        if fill and p >= copied:
          end = min(n, max(p + 1, copied + _FILL))
          _copy(out, src, copied, end)
          copied = end
        if i == nxt:
          d = exc_val[e]
          e += 1
          nxt = exc_idx[e] if e < ne else np.int64(nnz)
        else:
          d = (_ZERO - (c & _ONE)) | _ONE  # sign bit set: -1, else +1
        up = np.uint64(p)
        old = np.uint64(out[up])
        new = ((old - d) if undo else (old + d)) & mask
        out[up] = new
        if want_hash:
          _keep(ka, kb, j, p, old, new, small)
          j += 1
          if j == _BLOCK:
            acc += _block_hash(ka, kb, j, small)
            j = 0
      if want_hash:
        acc += _block_hash(ka, kb, j, small)
      if fill:
        _copy(out, src, copied, n)
      return -1, acc
    pos = np.empty(_BLOCK, np.uint64)
    olds = np.empty(_BLOCK, np.uint64)
    for s0 in range(0, count, _BLOCK):
      m = min(_BLOCK, count - s0)
      for j in range(m):
        ui = np.uint64(s0 + j)
        c = np.uint64(raw[head + ui])
        if cb > 1:
          c |= np.uint64(raw[head + un + ui]) << np.uint64(8)
        if cb > 2:
          c |= np.uint64(raw[head + 2 * un + ui]) << np.uint64(16)
        if cb > 3:
          c |= np.uint64(raw[head + 3 * un + ui]) << np.uint64(24)
        p += np.int64(c >> _ONE) + 1
        pos[j] = np.uint64(p)
      if p >= n:
        return s0, _ZERO
      if fill and p >= copied:
        end = min(n, max(p + 1, copied + _FILL))
        _copy(out, src, copied, end)
        copied = end
      for j in range(m):
        olds[j] = np.uint64(out[pos[j]])
      for j in range(m):
        i = s0 + j
        if i == nxt:
          d = exc_val[e]
          e += 1
          nxt = exc_idx[e] if e < ne else np.int64(nnz)
        else:  # the sign is the low bit of the code's low byte
          d = (_ZERO - np.uint64(raw[head + np.uint64(i)] & 1)) | _ONE
        old = olds[j]
        new = ((old - d) if undo else (old + d)) & mask
        out[pos[j]] = new
        if want_hash:
          _keep(ka, kb, j, pos[j], old, new, small)
      if want_hash:
        acc += _block_hash(ka, kb, m, small)
    if fill:
      _copy(out, src, copied, n)
    return -1, acc

  return kernel


def _make_dense_kernel(isz: int, fill: bool):
  """The numba DENSE_UNIT kernel for words of `isz` bytes: one element at a time. `fill`
  (fixed per compiled kernel): read the old bits from `src`, else from `out` (in place: a
  kernel that reads a second array that may alias `out` is not vectorized)."""
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)

  @jit.njit(nogil=True)
  def kernel(packed, src, out, undo):
    """out = (src if fill else out) + (undo: -) every element's symbol; returns whether a
    symbol 3 was seen."""
    bad = False
    for i in range(out.size):
      s = (np.uint64(packed[i >> 2]) >> np.uint64(2 * (i & 3))) & np.uint64(3)
      bad |= s == 3
      d = (_ZERO - (s >> _ONE)) | (s & _ONE)  # 0, 1 or all ones (-1)
      old = np.uint64(src[i]) if fill else np.uint64(out[i])
      out[i] = ((old - d) if undo else (old + d)) & mask
    return bad

  return kernel


def _make_swar16(fill: bool):
  """DENSE_UNIT for 16-bit words, four per u64 lane group (`fill` as `_make_dense_kernel`)."""

  @jit.njit(nogil=True)
  def swar16(packed, src64, out64, undo):
    """out64 = (src64 if fill else out64) +- symbols; returns whether a symbol 3 was seen.
    Lane-wise add/subtract without carries between lanes (the SWAR identities)."""
    bad = _ZERO
    for j in range(out64.size):
      s = (np.uint64(packed[j]) * _SPREAD) & _LANES3  # the byte's 4 symbols, one per lane
      bad |= s & (s >> _ONE)
      a = (s & _LANES1) | (((s >> _ONE) & _LANES1) * np.uint64(0xFFFF))  # 0, 1 or 0xFFFF
      x = src64[j] if fill else out64[j]
      if undo:
        out64[j] = ((x | _HIGH1) - (a & _LOW15)) ^ ((x ^ ~a) & _HIGH1)
      else:
        out64[j] = ((x & _LOW15) + (a & _LOW15)) ^ ((x ^ a) & _HIGH1)
    return bad != _ZERO

  return swar16


if HAVE_NUMBA:
  # Every variant is compiled on first use (numba compiles each dispatcher lazily).
  _UNIT_KERNELS = {(isz, undo, want, fill): _make_unit_kernel(isz, undo, want, fill)
                   for isz in (1, 2, 4, 8) for undo in (False, True)
                   for want in (False, True) for fill in (False, True)}
  _DENSE_KERNELS = {(isz, fill): _make_dense_kernel(isz, fill)
                    for isz in (1, 2, 4, 8) for fill in (False, True)}
  _SWAR16 = {fill: _make_swar16(fill) for fill in (False, True)}

  @jit.njit(nogil=True)
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

  @jit.njit(nogil=True)
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
  pos = np.cumsum(fmt.planes_to_u64(buf[e0:e0 + 3 * nexc], nexc, 3).astype(np.int64) + 1) - 1
  z = fmt.planes_to_u64(buf[e0 + 3 * nexc:e0 + (3 + itemsize) * nexc], nexc, itemsize)
  mask = ~_ZERO if itemsize == 8 else np.uint64((1 << (8 * itemsize)) - 1)
  vals = ((z >> _ONE) ^ (_ZERO - (z & _ONE))) & mask  # un-zig-zag, as `itemsize` words
  if pos[-1] >= limit or not np.all(vals):
    return None
  if packed.size and np.any((packed[pos >> 2] >> (2 * (pos & 3)).astype(np.uint8)) & 3):
    return None
  return pos, vals


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
  c = fmt.planes_to_u64(buf[_UNIT_HEAD_SIZE:_UNIT_HEAD_SIZE + cb * nnz], nnz, cb)
  pos = np.cumsum((c >> _ONE).astype(np.int64) + 1) - 1
  if pos[-1] >= out.size:
    return -1, 0
  d = np.where(c & _ONE, ~_ZERO, _ONE)
  d[idx] = vals
  old = out[pos]
  dd = d.astype(out.dtype)  # wraps to the word width: -1 -> all ones
  new = old - dd if undo else old + dd  # unsigned: wraps
  out[pos] = new  # positions are distinct (gaps >= 0)
  return 0, fmt.changes_hash(pos, old, new) if want_hash else 0


def unit_apply(raw, out: np.ndarray, undo: bool = False, want_hash: bool = True,
               use_numba: bool | None = None, src: np.ndarray | None = None):
  """Adds (or with `undo` subtracts) a SPARSE_UNIT body's changes into `out`, in place.

  Args:
    raw: the decompressed SPARSE_UNIT payload (bytes-like).
    out: 1-D C-contiguous unsigned-integer chunk (the bit patterns), modified in place.
    undo: subtract instead (the exact inverse).
    want_hash: compute the changes hash (else 0 is returned on success).
    use_numba: force one implementation (default: numba when installed).
    src: if given (and not `out`), the base chunk: `out` is scratch and receives src + the
      changes, copied in the same pass as the changes are applied (one trip through memory
      instead of a copy and then a scatter). On failure `out` then holds garbage.

  Returns:
    The changes hash (0 without `want_hash`), or None if the body is malformed (see
    `parse_unit`, or a position outside `out`); then `out` is unchanged (unless `src`).
  """
  buf = np.frombuffer(raw, np.uint8)
  if use_numba is None:
    use_numba = HAVE_NUMBA
  if use_numba and not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  fill = src is not None and src is not out
  parsed = parse_unit(buf, out.size, out.itemsize, use_numba)
  if parsed is None:
    return None
  nnz, cb, idx, vals = parsed
  if not use_numba:
    if fill:
      np.copyto(out, src)
    status, h = _unit_apply_np(buf, nnz, cb, idx, vals, out, undo, want_hash)
    return None if status < 0 else int(h)
  kernel = _UNIT_KERNELS[out.itemsize, bool(undo), bool(want_hash), fill]
  applied, h = kernel(buf, nnz, cb, idx, vals, nnz, out, src if fill else out)
  if applied >= 0:  # a position outside the chunk: take back the changes applied before it
    if not fill:
      _UNIT_KERNELS[out.itemsize, not undo, False, False](buf, nnz, cb, idx, vals, applied,
                                                           out, out)
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
                     use_numba: bool | None = None, src: np.ndarray | None = None) -> bool:
  """Adds (or with `undo` subtracts) a DENSE_UNIT body's changes into `out`, in place.

  Args:
    raw: the decompressed DENSE_UNIT payload (bytes-like).
    out: 1-D C-contiguous unsigned-integer chunk (the bit patterns), modified in place.
    undo: subtract instead (the exact inverse).
    use_numba: force one implementation (default: numba when installed).
    src: if given (and not `out`), the base chunk: `out` is scratch and receives src + the
      changes in one pass. On failure `out` then holds garbage.

  Returns:
    True, or False if the body is malformed (see `parse_dense_unit`; or a symbol 3); then
    `out` is unchanged (unless `src`).
  """
  if use_numba is None:
    use_numba = HAVE_NUMBA
  if use_numba and not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  parsed = parse_dense_unit(np.frombuffer(raw, np.uint8), out.size, out.itemsize, use_numba)
  if parsed is None:
    return False
  packed, pos, vals = parsed
  fill = src is not None and src is not out
  if fill and not use_numba:
    np.copyto(out, src)

  def run(back, s):
    if not use_numba:
      return _dense_np(packed, out, back)
    if out.itemsize != 2:
      return _DENSE_KERNELS[out.itemsize, s is not out](packed, s, out, back)
    m = out.size // 4 * 4
    bad = _SWAR16[s is not out](packed, s[:m].view(np.uint64), out[:m].view(np.uint64), back)
    if m < out.size:  # the last 1-3 elements
      bad |= _DENSE_KERNELS[2, s is not out](packed[m // 4:], s[m:], out[m:], back)
    return bad

  if run(undo, src if fill and use_numba else out):
    if not fill:
      run(not undo, out)  # exact inverse: symbol 3 adds -1 both ways
    return False
  if len(pos):  # positions are distinct
    if use_numba:
      _scatter_nb(out, pos, vals, undo)
    else:
      (np.subtract if undo else np.add).at(out, pos, vals.astype(out.dtype))
  return True


def warm_up() -> None:
  """Compiles the unit kernels `delta` runs, for the common word sizes (once per process):
  in place with and without the changes hash, undo, and filling from a (read-only) base."""
  if HAVE_NUMBA:
    for dt in (np.uint16, np.uint32):
      four = bytes([4]) + bytes(np.dtype(dt).itemsize - 1)  # an exception: a step of +2
      frozen = np.zeros(8, dt)  # a read-only base (filling `out` from it) types differently
      frozen.flags.writeable = False
      for nexc in (0, 1):
        body = UNIT_HEAD.pack(1, nexc, 1) + bytes(1) + (bytes(3) + four) * nexc
        dense = DENSE_UNIT_HEAD.pack(5, nexc) + bytes(2) + (bytes(3) + four) * nexc
        for undo, want in ((False, True), (False, False), (True, False)):
          unit_apply(body, np.zeros(1, dt), undo=undo, want_hash=want)
        for src in (frozen, frozen.copy()):
          unit_apply(body, np.zeros(1, dt), want_hash=False, src=src[:1])
          dense_unit_apply(dense, np.zeros(5, dt), src=src[:5])
        for undo in (False, True):
          dense_unit_apply(dense, np.zeros(5, dt), undo=undo)
