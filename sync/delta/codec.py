"""Lossless per-chunk codec for the difference between two weight chunks.

What: `encode_chunk(base, new)` turns two equally long unsigned-integer views of the same
tensor chunk (the bit patterns of bf16/fp16/fp32 weights) into a compressed payload, and
`decode_chunk` rebuilds `new` bit-exactly from `base` and that payload. The payload layouts
are defined in `chunk_format`; this module chooses between them and drives the kernels.

Why this encoding. An RL step on the sampler's bf16 copy leaves most weights bit-identical,
and a weight that does change usually moves by one or two ulps. Three facts follow:

* Positions carry most of the information. We store them as gaps (number of unchanged
  elements before each changed one). With a changed fraction p the gaps are roughly geometric,
  whose entropy is H(p)/p bits per changed element. The gaps are split into byte planes (low
  bytes, then middle, then high) so zstd's Huffman stage sees a stream of small symbols and the
  upper planes collapse to almost nothing.
* Values are stored as the *integer difference of bit patterns*, zig-zag mapped, not as XOR.
  IEEE floats are sign-magnitude, so within one sign the bit pattern is monotonic in the value:
  a step of k ulps is a difference of exactly k, even across an exponent boundary. XOR instead
  smears a +1 carry over several low bits (x ^ (x+1) = 0b0111..1), costing ~2 bits of entropy
  where the zig-zag difference costs ~1. Zig-zag maps +-1 to 2/1, so the high byte planes are
  all zero and vanish under zstd.
* Most changes are one step: +-1 in the integer bit pattern (real learner steps with AdamW at
  RL learning rates: small weights have small ulps). The SPARSE_UNIT form folds that sign into
  the gap: one code (gap << 1) | sign per change, plus an exception list for other steps.
  Against SPARSE (3 gap planes + the value planes) that is a little smaller and, more to the
  point, zstd's Huffman stage has half the symbols to decode and the kernel a third of the
  bytes to read. The encoder uses SPARSE_UNIT when at most a quarter of the changes are
  exceptions, SPARSE otherwise.

For dense changes the position stream stops paying for itself. With mostly +-1 steps the
encoder then uses DENSE_UNIT: a 2-bit symbol per element (same, +1, -1) plus the exception
list. From ~20% changed it is about as small as SPARSE_UNIT and decodes in one streaming pass
instead of one step per change (see `unit_kernels`). For other steps it can also use a DENSE
form (zig-zag difference of every element, byte-plane split, zstd). On +-1 ulp updates SPARSE
stays smaller than DENSE up to about half the elements changed and is also much cheaper to
compress, so the encoder first estimates the changed fraction from a small sample (32 blocks
of 512 elements) and only then does the work of one form: below 20% sparse; from 20%
DENSE_UNIT if the steps allow it; else sparse below 40%, dense above 60%, both (keep the
smaller) in between. A wrong estimate costs size, never correctness.
Chunks that are identical cost a few bytes (SAME). Tensors without a usable base are stored RAW
(byte planes of the new bits, zstd).

Decoding: `apply_chunk` adds a payload's changes into a chunk in place (or subtracts them
again to undo: unsigned arithmetic wraps, so the subtraction is the exact inverse), with a cost
proportional to the changed elements (DENSE_UNIT: one streaming pass); SPARSE, SPARSE_UNIT and
DENSE_UNIT chunks go through the fused kernels in `sparse_kernels` and `unit_kernels` (numba
when installed); the sparse ones also return the chunk's *changes hash*. The encoder computes
the same hash (`chunk_format.changes_hash`) over (position, old bits, new bits) of every
changed element, so a caller that knows its chunk held the parent's bits can check the result
without hashing the whole chunk. `decode_changes` / `apply_changes` are the plain numpy forms
(DENSE and RAW use them).

Every zstd frame carries its own content checksum, so a flipped bit in a payload fails loudly
in `decode_changes`; the caller additionally checks a hash of every rebuilt chunk.
"""

import logging
import threading
import time

import numpy as np
import zstandard

from sync.delta import chunk_format as fmt
from sync.delta import jit
from sync.delta import sparse_kernels
from sync.delta import unit_kernels

# The chunk kinds `encode_chunk` returns and the chunk size limit (`chunk_format`).
SAME, SPARSE, DENSE, RAW = fmt.SAME, fmt.SPARSE, fmt.DENSE, fmt.RAW
SPARSE_UNIT, DENSE_UNIT = fmt.SPARSE_UNIT, fmt.DENSE_UNIT
KIND_NAMES, SPARSE_KINDS = fmt.KIND_NAMES, fmt.SPARSE_KINDS
MAX_CHUNK_ELEMS = fmt.MAX_CHUNK_ELEMS
log = logging.getLogger(__name__)

# Below this sampled changed fraction only the sparse form is built, above _DENSE_ONLY only the
# dense one; in between both (see the module docstring).
_SPARSE_ONLY = 0.4
_DENSE_ONLY = 0.6
_SAMPLE_BLOCKS = 32
_SAMPLE_BLOCK = 512

_SPARSE_HEAD = fmt.SPARSE_HEAD
_UNIT_HEAD = fmt.UNIT_HEAD
_MAX_EXCEPTIONS = 1 / 4  # of the changes, for SPARSE_UNIT and DENSE_UNIT
_DENSE_UNIT_HEAD = fmt.DENSE_UNIT_HEAD
_DENSE_UNIT_FROM = 0.2  # sampled changed fraction from which DENSE_UNIT is tried first


class CodecError(ValueError):
  """A payload is damaged or does not fit the chunk it is applied to."""


def _unit_body(pos: np.ndarray, diff: np.ndarray):
  """The SPARSE_UNIT body for changes `diff` (wrapped differences) at positions `pos`, or None
  if more than _MAX_EXCEPTIONS of them are not +-1 steps."""
  minus = diff == np.iinfo(diff.dtype).max  # -1, wrapped
  exc = np.flatnonzero(~minus & (diff != 1))
  if exc.size > _MAX_EXCEPTIONS * pos.size:
    return None
  gaps = np.diff(pos, prepend=-1) - 1
  codes = (gaps.astype(np.uint32) << np.uint32(1)) | minus
  cb = max(1, (int(codes.max()).bit_length() + 7) // 8)
  code_planes = np.ascontiguousarray(codes.view(np.uint8).reshape(-1, 4)[:, :cb].T)
  idx = fmt.gap_planes(exc)
  return (_UNIT_HEAD.pack(pos.size, exc.size, cb) + code_planes.tobytes() + idx +
          fmt.planes(fmt.zigzag(diff[exc])))


def _dense_unit_body(diff: np.ndarray, nnz: int):
  """The DENSE_UNIT body for the wrapped differences `diff` (`nnz` of them nonzero), or None
  if more than _MAX_EXCEPTIONS of the changes are not +-1 steps."""
  one = diff == 1
  minus = diff == np.iinfo(diff.dtype).max
  exc = np.flatnonzero((diff != 0) & ~one & ~minus)
  if exc.size > _MAX_EXCEPTIONS * nnz:
    return None
  sym = one.view(np.uint8) | (minus.view(np.uint8) << np.uint8(1))
  sym = np.concatenate([sym, np.zeros(-sym.size % 4, np.uint8)]).reshape(-1, 4)
  packed = sym[:, 0] | (sym[:, 1] << 2) | (sym[:, 2] << 4) | (sym[:, 3] << 6)
  idx = fmt.gap_planes(exc)
  return (_DENSE_UNIT_HEAD.pack(diff.size, exc.size) + packed.tobytes() + idx +
          fmt.planes(fmt.zigzag(diff[exc])))


def sample_fraction(base: np.ndarray, new: np.ndarray) -> float:
  """Changed fraction estimated from evenly spread blocks (exact for small chunks)."""
  n = new.size
  if n <= 2 * _SAMPLE_BLOCKS * _SAMPLE_BLOCK:
    return np.count_nonzero(base != new) / max(1, n)
  starts = np.linspace(0, n - _SAMPLE_BLOCK, _SAMPLE_BLOCKS).astype(np.intp)
  idx = (starts[:, None] + np.arange(_SAMPLE_BLOCK)).reshape(-1)
  return np.count_nonzero(base[idx] != new[idx]) / idx.size


def encode_chunk(base, new, cctx: zstandard.ZstdCompressor):
  """Encodes `new` relative to `base` (same length, same unsigned dtype).

  Args:
    base: 1-D unsigned-integer array, the bit patterns of the parent chunk, or None for RAW.
    new: 1-D unsigned-integer array of the same dtype and length.
    cctx: a zstd compressor (one per thread; created with write_checksum=True).

  Returns:
    (kind, payload bytes, number of changed elements, changes hash): the last is
    `chunk_format.changes_hash` of the changed elements for SPARSE and SPARSE_UNIT chunks, 0 for
    the other kinds.
  """
  if base is None:
    return RAW, cctx.compress(fmt.planes(new)), new.size, 0
  frac = sample_fraction(base, new)
  if frac >= _DENSE_UNIT_FROM:
    diff = new - base  # unsigned: wraps, exactly undone by the decoder's addition
    nnz = int(np.count_nonzero(diff))
    if nnz == 0:
      return SAME, b"", 0, 0
    body = _dense_unit_body(diff, nnz)
    if body is not None:
      return DENSE_UNIT, cctx.compress(body), nnz, 0
    if frac >= _DENSE_ONLY:
      return DENSE, cctx.compress(fmt.planes(fmt.zigzag(diff))), nnz, 0
  pos = np.flatnonzero(base != new)
  nnz = pos.size
  if nnz == 0:
    return SAME, b"", 0, 0
  old, upd = base[pos], new[pos]
  diff = upd - old
  body = _unit_body(pos, diff)
  kind = SPARSE if body is None else SPARSE_UNIT
  if body is None:
    body = _SPARSE_HEAD.pack(nnz) + fmt.gap_planes(pos) + fmt.planes(fmt.zigzag(diff))
  sparse = cctx.compress(body)
  if nnz < _SPARSE_ONLY * new.size:
    return kind, sparse, nnz, fmt.changes_hash(pos, old, upd)
  dense = cctx.compress(fmt.planes(fmt.zigzag(new - base)))
  if len(dense) < len(sparse):
    return DENSE, dense, nnz, 0
  return kind, sparse, nnz, fmt.changes_hash(pos, old, upd)


def _decompress(kind: int, payload, n: int, itemsize: int, dctx):
  """A payload's zstd frame decompressed (None for SAME), with the size checks."""
  if kind == SAME:
    if len(payload):
      raise CodecError("SAME chunk with a payload")
    return None
  if kind not in KIND_NAMES:
    raise CodecError(f"unknown chunk kind {kind}")
  if kind == SPARSE_UNIT:
    limit = _UNIT_HEAD.size + n * (7 + itemsize)
  elif kind == DENSE_UNIT:
    limit = _DENSE_UNIT_HEAD.size + -(-n // 4) + n * (3 + itemsize)
  else:
    limit = _SPARSE_HEAD.size + n * (3 + itemsize)
  try:
    size = zstandard.frame_content_size(payload)
    if not 0 <= size <= limit:  # -1: unknown size; also guards against decompression bombs
      raise CodecError("payload frame has a missing or implausible content size")
    return dctx.decompress(payload)
  except zstandard.ZstdError as e:
    raise CodecError(f"zstd: {e}") from e


def apply_chunk(kind: int, payload, out: np.ndarray, dctx: zstandard.ZstdDecompressor,
                undo: bool = False, hash_limit: float = 1.0, src: np.ndarray | None = None):
  """Adds a payload's changes into the chunk `out` in place (`undo`: subtracts them).

  Args:
    kind: the chunk kind.
    payload: its payload.
    out: 1-D C-contiguous unsigned-integer view of the chunk (the base's bits on entry).
    dctx: a zstd decompressor (one per thread).
    undo: subtract instead (exact inverse; RAW chunks cannot be undone).
    hash_limit: return the changes hash of a SPARSE / SPARSE_UNIT chunk only if at most this
      fraction of its elements changed (0: never; SPARSE_UNIT then skips computing it).
    src: if given (and not `out`), the base chunk; `out` is scratch and receives src + the
      changes (the unit kinds copy and apply in one pass through memory).

  Returns:
    The changes hash (see `chunk_format`), or None where it was not asked for or the kind has none.

  Raises:
    CodecError: damaged payload, or one that does not fit the chunk; `out` is unchanged
      (garbage with `src`).
  """
  if src is out:
    src = None
  if kind == DENSE_UNIT:
    raw = _decompress(kind, payload, out.size, out.itemsize, dctx)
    if not unit_kernels.dense_unit_apply(raw, out, undo, src=src):
      raise CodecError("DENSE_UNIT payload has the wrong length or layout")
    return None
  if kind not in SPARSE_KINDS:
    apply_changes(kind, decode_changes(kind, payload, out.size, out.dtype, dctx), out, src,
                  undo=undo)
    return None
  raw = _decompress(kind, payload, out.size, out.itemsize, dctx)
  if src is not None and kind == SPARSE:
    np.copyto(out, src)
    src = None
  # Both bodies start with the u32 change count (checked by the kernels' parsers).
  nnz = _SPARSE_HEAD.unpack_from(raw)[0] if len(raw) >= _SPARSE_HEAD.size else 0
  want = 0 < nnz <= hash_limit * out.size
  if kind == SPARSE:
    h = sparse_kernels.sparse_apply(raw, out, undo)
  else:
    h = unit_kernels.unit_apply(raw, out, undo, want_hash=want, src=src)
  if h is None:
    raise CodecError(f"{KIND_NAMES[kind].upper()} payload has the wrong length or layout, or "
                     "a position outside the chunk")
  return h if want else None


def decode_changes(kind: int, payload, n: int, dtype, dctx: zstandard.ZstdDecompressor):
  """What a payload changes in a chunk of `n` elements of unsigned `dtype` (no side effects).

  Returns:
    SAME: None; SPARSE, SPARSE_UNIT: (positions (intp, increasing), values to add); DENSE,
    DENSE_UNIT: the difference to add to every element; RAW: the new elements.

  Raises:
    CodecError: damaged payload, or one that does not fit the chunk.
  """
  dtype = np.dtype(dtype)
  itemsize = dtype.itemsize
  raw = _decompress(kind, payload, n, itemsize, dctx)
  if raw is None:
    return None
  if kind == DENSE_UNIT:
    diff = np.zeros(n, dtype)
    if not unit_kernels.dense_unit_apply(raw, diff, use_numba=False):
      raise CodecError("DENSE_UNIT payload has the wrong length or layout")
    return diff
  if kind in (RAW, DENSE):
    if len(raw) != n * itemsize:
      raise CodecError(f"{KIND_NAMES[kind].upper()} payload has the wrong length")
    words = fmt.unplanes(raw, dtype, n)
    return words if kind == RAW else fmt.unzigzag(words)
  if kind == SPARSE_UNIT:
    parsed = unit_kernels.parse_unit(np.frombuffer(raw, np.uint8), n, itemsize)
    if parsed is None:
      raise CodecError("SPARSE_UNIT payload has the wrong length or layout")
    nnz, cb, idx, vals = parsed
    c = fmt.planes_to_u64(np.frombuffer(raw, np.uint8, nnz * cb, _UNIT_HEAD.size), nnz, cb)
    pos = np.cumsum((c >> np.uint64(1)).astype(np.intp) + 1) - 1
    if pos[-1] >= n:
      raise CodecError("SPARSE_UNIT position outside the chunk")
    values = np.where(c & np.uint64(1), ~np.uint64(0), np.uint64(1))
    values[idx] = vals
    return pos, values.astype(dtype)
  (nnz,) = _SPARSE_HEAD.unpack_from(raw)
  if not 0 < nnz <= n or len(raw) != _SPARSE_HEAD.size + nnz * (3 + itemsize):
    raise CodecError("SPARSE payload has the wrong length")
  pos = fmt.gaps_to_pos(memoryview(raw)[_SPARSE_HEAD.size:], nnz)
  if pos[-1] >= n:
    raise CodecError("SPARSE position outside the chunk")
  values = fmt.unzigzag(
      fmt.unplanes(memoryview(raw)[_SPARSE_HEAD.size + 3 * nnz:], dtype, nnz))
  return pos, values


def apply_changes(kind: int, changes, out: np.ndarray, base=None, undo: bool = False) -> None:
  """Writes base + changes into `out` (in place when `base` is None or is `out`).

  `undo=True` subtracts instead (the exact inverse, for rolling back an in-place apply);
  RAW chunks cannot be undone and are rejected with `undo`.
  """
  src = out if base is None else base
  op = np.subtract if undo else np.add
  if kind == SAME:
    if src is not out:
      np.copyto(out, src)
  elif kind in SPARSE_KINDS:
    if src is not out:
      np.copyto(out, src)
    pos, values = changes
    op.at(out, pos, values)  # positions are distinct (gaps >= 0), unsigned arithmetic wraps
  elif kind in (DENSE, DENSE_UNIT):
    op(src, changes, out=out)
  elif kind == RAW and not undo:
    out[...] = changes
  else:
    raise CodecError(f"cannot apply chunk kind {kind} (undo={undo})")


def decode_chunk(kind: int, payload, base, out, dctx: zstandard.ZstdDecompressor):
  """Writes the chunk rebuilt from `base` and `payload` into `out` (same dtype and length).

  `base` may be `out` itself (in-place apply) for every kind. Raises CodecError on a damaged
  payload or one that does not fit the chunk; `out` then holds garbage unless it is `base`.
  """
  if base is None and kind != RAW:
    raise CodecError(f"chunk kind {kind} needs a base")
  apply_chunk(kind, payload, out, dctx, hash_limit=0.0, src=base)  # the caller hashes the result


_warm_lock = threading.Lock()
_warm_s = None


def warm_up() -> float:
  """Readies the numba kernels `apply_chunk` runs for the common word sizes, so that no
  caller's first timed or served apply pays for compiling them; returns the seconds it took in
  this process (the first call's; later calls return at once).

  From the on-disk kernel cache (`jit`) that is a fraction of a second; without one, or the
  first time after the kernels' sources changed, numba compiles them (seconds).
  """
  global _warm_s
  with _warm_lock:
    if _warm_s is None:
      t0 = time.perf_counter()
      sparse_kernels.warm_up()
      unit_kernels.warm_up()
      _warm_s = time.perf_counter() - t0
      log.info("delta kernels ready in %.2f s (numba cache: %s)", _warm_s,
               jit.CACHE_DIR or "none")
    return _warm_s
