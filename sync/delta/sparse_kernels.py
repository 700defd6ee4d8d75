"""Fused sparse-apply kernel: rebuild positions and values, scatter them, checksum the changes.

What: `sparse_apply(raw, out)` takes the decompressed body of a SPARSE chunk payload (see
`chunk_format`: u32 count, three gap byte planes, the value byte planes of zig-zag differences)
and adds the changes into `out` in place, in one pass over the changed elements; it returns the
*changes hash* of what it did (defined in `chunk_format`, whose `changes_hash` is the numpy
reference the encoder uses). The module also holds the compiled splitmix64 finaliser, the
block size and the loop choice that `unit_kernels` shares.

Why a compiled kernel: in numpy the same work is five passes (gap planes -> gaps, cumsum ->
positions, value planes -> zig-zag codes, un-zig-zag, `np.add.at`), each materialising an array
of the changed count, and `np.add.at` alone costs more than a memcpy of the whole chunk. The
kernel reads each payload byte once and touches each changed element once. It is compiled with
numba (`nogil=True`: threads apply different chunks at the same time) and cached on disk
(`jit`: numba loading and the kernel cache). If numba is not installed, the same functions
run as numpy code with bit-identical results (tested both ways).

The changes hash covers every (position, old bits, new bits) triple and is order-independent;
`api` records it per chunk; it lets a sampler whose held weights are verifiably the parent
version check an in-place apply at a cost proportional to the changed elements (see
`api.apply_inplace`, check="changes").

The SPARSE_UNIT and DENSE_UNIT forms have their kernels in `unit_kernels`.
"""

import numpy as np

from sync.delta import chunk_format as fmt
from sync.delta import jit

_HEAD = fmt.SPARSE_HEAD
_HEAD_SIZE = 4
# numba reads module globals as compile-time constants: the hash's, bound here.
_C = fmt.HASH_C
_M1, _M2 = fmt.MIX_M1, fmt.MIX_M2
_S30, _S27, _S31 = fmt.MIX_S1, fmt.MIX_S2, fmt.MIX_S3
_S24, _S40 = fmt.KEY_OLD_SHIFT, fmt.KEY_NEW_SHIFT
BLOCK = 256  # changes per gather/scatter block of the kernel (L1-resident scratch)
# One pass when changes are at most ~80 bytes apart on average, else gather in blocks. Measured
# on bf16 (per 64 MB, kernel ms, one pass / blocks): 2.2% changed 7.9 / 6.3, 2.6% 5.4 / 7.2,
# 3% 3.9 / 6.9, 1% 10.3 / 3.1.
ONE_PASS_BYTES = 80
_ONE = np.uint64(1)
_ZERO = np.uint64(0)

numba = jit.numba  # None without numba (or with SYNC_NO_NUMBA set: see `jit`)
HAVE_NUMBA = jit.HAVE_NUMBA

if HAVE_NUMBA:

  @jit.njit(nogil=True, inline="always")
  def mix_nb(x):
    """The splitmix64 finaliser on one uint64 (`chunk_format.mix` element-wise) for the
    kernels here and in `unit_kernels`."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _parse(raw, n: int, itemsize: int) -> int:
  """The element count of a SPARSE body, after checking its length; -1 if malformed."""
  if len(raw) < _HEAD.size:
    return -1
  (nnz,) = _HEAD.unpack_from(raw)
  if not 0 < nnz <= n or len(raw) != _HEAD.size + nnz * (3 + itemsize):
    return -1
  return nnz


def _sparse_apply_np(raw: np.ndarray, nnz: int, out: np.ndarray, undo: bool):
  pos = fmt.gaps_to_pos(raw[_HEAD.size:], nnz)
  if pos[-1] >= out.size:
    return -1, 0
  vals = fmt.unzigzag(fmt.unplanes(raw[_HEAD.size + 3 * nnz:], out.dtype, nnz))
  old = out[pos]
  new = old - vals if undo else old + vals  # unsigned: wraps
  out[pos] = new  # positions are distinct (gaps >= 0)
  return 0, fmt.changes_hash(pos, old, new)


def _make_kernel(isz: int):
  """The numba kernel for words of `isz` bytes (a compile-time constant: loops unroll)."""
  mask = ~_ZERO if isz == 8 else np.uint64((1 << (8 * isz)) - 1)
  small = isz <= 2
  planes = tuple(range(isz))


  @jit.njit(nogil=True)
  def kernel(raw, nnz, count, out, undo):
    """Applies the first `count` changes; returns (-1, hash), or (k, 0) if a position lies
    outside `out`: then only the first k changes were applied.

    Changes more than ONE_PASS_BYTES apart on average (bf16 below 2.5% changed) go in blocks of
    BLOCK: first the positions are decoded and the old words gathered in a tight loop (many
    cache misses in flight: there nearly every change is its own miss, and a loop that also
    scatters and hashes keeps too few outstanding, 3x slower at 1%), then values are rebuilt,
    written and hashed from L1. Denser changes go in one pass.
    """
    n = out.size
    g0 = _HEAD_SIZE
    v0 = g0 + 3 * nnz
    p = -1
    acc = _ZERO
    if nnz * ONE_PASS_BYTES >= n * isz:  # dense: one pass (hardware prefetch follows the
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
          acc += mix_nb(np.uint64(p) | (old << _S24) | (new << _S40))
        else:
          acc += mix_nb(mix_nb(np.uint64(p) * _C + old) ^ new)
      return -1, acc
    pos = np.empty(BLOCK, np.int64)
    olds = np.empty(BLOCK, np.uint64)
    for s0 in range(0, count, BLOCK):
      m = min(BLOCK, count - s0)
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
          acc += mix_nb(np.uint64(pos[j]) | (old << _S24) | (new << _S40))
        else:
          acc += mix_nb(mix_nb(np.uint64(pos[j]) * _C + old) ^ new)
    return -1, acc

  return kernel


if HAVE_NUMBA:
  _KERNELS = {isz: _make_kernel(isz) for isz in (1, 2, 4, 8)}


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


def warm_up() -> None:
  """Compiles the SPARSE kernels for the common word sizes (once per process; `codec.warm_up`
  compiles every kernel the codec runs)."""
  if HAVE_NUMBA:
    body = _HEAD.pack(1) + bytes(3) + bytes(8)
    for dt in (np.uint16, np.uint32):
      sparse_apply(body[:_HEAD.size + 3 + np.dtype(dt).itemsize], np.zeros(1, dt))
      sparse_apply(body[:_HEAD.size + 3 + np.dtype(dt).itemsize], np.zeros(1, dt), undo=True)
