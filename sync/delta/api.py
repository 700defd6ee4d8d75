"""Delta blobs between two versions of flat weights: `encode`, `decode`, `apply_inplace`.

What: the public interface of weight-sync compression (re-exported by the `sync.delta`
package, so callers write `from sync import delta`).

    from sync import delta
    blob = delta.encode(base, new)        # base/new: dict name -> np.ndarray
    rebuilt = delta.decode(base, blob)    # bit-identical to `new`, or raises delta.DeltaError
    new_flat, stats = delta.apply_inplace(held, blob)  # writes only the changes into `held`

`apply_inplace` is the sampler's cheap path: no second model is allocated or copied, the cost
is the changed elements (plus one hash pass unless the caller vouches for the held version,
see below), and it is all-or-nothing (everything checked before
the first write, exact roll-back if a rebuilt chunk's hash fails).
`encode_to` / `decode_stream` are the streaming forms (a writable sink / a readable source);
`encode` and `decode` are thin wrappers over them, so every path is measured through the same
code. Work is split into fixed-size chunks (`weights.CHUNK_ELEMS` elements) that threads encode
or decode in parallel (numpy, zstd, xxhash and the numba kernels release the GIL) with a bounded
number of chunks in flight (encode: a window of 2 per worker; decode: batches of at most 32 per
worker or 64 MB of payload), so memory stays at base + new + O(workers) chunks. `decode` takes
its output memory from earlier results the caller has dropped (`buffers`), so decoding version
after version does not page-fault a new model each time.

Blob layout (little-endian):
  header:  MAGIC, u32 length, JSON {format, chunk_elems, tensors: [[name, dtype, shape, raw]]}
  records: one per chunk, in header order: u32 tensor, u32 chunk, u8 kind, 3 pad,
           u64 payload length, u64 xxh3 of the payload, u64 xxh3 of the base chunk,
           u64 xxh3 of the rebuilt chunk, u64 changes hash (SPARSE, SPARSE_UNIT; 0 otherwise),
           u32 xxh32 of those 52 bytes; then the payload (see `chunk_format`).
  trailer: END_MAGIC, u64 record count, 32-char parent digest, 32-char new digest, u32 xxh32.

Why these checks: the record-header checksum and strict (tensor, chunk) order reject damaged,
reordered or spliced records; the payload hash rejects any damaged payload byte (even one that
zstd would decode to the right values: damage means the transport is broken); the hash of every
rebuilt chunk rejects a wrong base (a "foreign" delta) without hashing the base in the happy
path; the trailer rejects truncation and proves the result is version `digest`.

Checking an in-place apply at the cost of the changes (`apply_inplace(check="changes")`, the
default when the caller names the held version with `expect_parent`). Hashing every rebuilt
chunk costs a pass over the whole model for a delta that touches a few percent of it. When the
caller vouches that the held arrays are bit-exactly version P (they were proven P when they were
built: by this check or the full one, or a verified snapshot) and P is the blob's parent digest,
the result is proven to be the new version N by checking only the changes: every record, payload
hash, the trailer and version digest pass (so the payloads are byte-for-byte the encoder's); the
encoder, holding P, listed *every* position where P and N differ, so an unlisted element keeps
P's bits, which equal N's; for a listed element, the changes hash over (position, bits before,
bits after) that the kernel computed while writing must equal the encoder's hash over (position,
P's bits, N's bits), so the element held P's bits and now holds N's (up to a 2**-64 collision,
as for the xxh3-64 chunk hashes). Hence the result is N bit-exactly. DENSE, DENSE_UNIT and RAW
chunks (every element changes anyway) are still hashed whole, and so are sparse chunks with more
than `_CHANGES_HASH_LIMIT` of their elements changed (there one xxh3 pass over the just-written
chunk costs less than mixing every change).
What this mode does not see is held memory that differs from P at an *unchanged* position while
the caller claims it is P; callers that cannot vouch for their arrays use check="result"
(the default without `expect_parent`) or `verify_base=True`.
"""

from collections.abc import Mapping
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import struct
import time

import numpy as np
import xxhash

from sync import weights
from sync.delta import buffers
from sync.delta import codec
from sync.delta import parallel

MAGIC = b"SYNCDLT1"
END_MAGIC = b"SYNCEND1"
FORMAT = 3  # 2: records carry the changes hash; 3: adds SPARSE_UNIT and DENSE_UNIT chunks
# Chunk kinds each readable format may hold (format 2 blobs still decode).
_KINDS = {2: frozenset((codec.SAME, codec.SPARSE, codec.DENSE, codec.RAW)),
          3: frozenset(codec.KIND_NAMES)}
# With check="changes", a sparse chunk with more than this fraction of its elements changed is
# checked by xxh3 of the rebuilt chunk instead: the changes hash (vectorized, see
# `unit_kernels`) costs about ten times as much per change as xxh3 does per element, so the
# break-even lies near 10% changed, and xxh3 proves more.
_CHANGES_HASH_LIMIT = 1 / 8
# Payload bytes read ahead while decoding a stream (with at most 32 chunks per worker).
_BATCH_BYTES = 64 << 20
# Output memory for `decode` without `out=` (see `buffers`): the last two calls' buffers.
_RECYCLER = buffers.Recycler(keep=2)
_LEN = struct.Struct("<I")
_REC = struct.Struct("<IIB3xQQQQQ")
_CHECK = struct.Struct("<I")
_TRAILER = struct.Struct("<Q32s32s")
_MAX_HEADER = 1 << 28


class DeltaError(ValueError):
  """A blob is damaged, truncated, reordered, or does not apply to the given base."""


@dataclasses.dataclass
class Stats:
  """What one encode or decode did."""
  raw_bytes: int = 0  # bytes of the new weights
  blob_bytes: int = 0
  changed: int = 0  # changed elements (encode only)
  elements: int = 0
  chunks: dict = dataclasses.field(default_factory=dict)  # kind name -> count
  seconds: float = 0.0
  parent_digest: str = ""
  digest: str = ""

  @property
  def ratio(self) -> float:
    return self.raw_bytes / max(1, self.blob_bytes)


def _header_bytes(tensors, chunk_elems) -> bytes:
  head = json.dumps({"format": FORMAT, "chunk_elems": chunk_elems, "tensors": tensors},
                    separators=(",", ":")).encode()
  return MAGIC + _LEN.pack(len(head)) + head


def encode_to(sink, base: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], *,
              chunk_elems: int = weights.CHUNK_ELEMS, level: int = 1, workers=None,
              parent_digest: str | None = None) -> Stats:
  """Streams the delta from `base` to `new` into `sink` (anything with `.write(bytes)`).

  Args:
    sink: receives the blob in order, one record at a time.
    base: the parent version (name -> array). Tensors of `new` missing from `base` or with a
      different dtype/shape are stored whole (RAW); tensors only in `base` are dropped.
    new: the version to encode.
    chunk_elems: elements per chunk (<= codec.MAX_CHUNK_ELEMS).
    level: zstd level; 1 is the speed/ratio sweet spot here.
    workers: threads (default: cores, at most 8).
    parent_digest: `weights.digest(base)` when the caller already knows it (saves one hash
      pass over the base).

  Returns:
    Stats, including both digests.
  """
  if not 0 < chunk_elems <= codec.MAX_CHUNK_ELEMS:
    raise ValueError(f"chunk_elems must be in (0, {codec.MAX_CHUNK_ELEMS}]")
  t0 = time.perf_counter()
  stats = Stats()
  names = sorted(new)
  tensors, jobs = [], []
  for ti, name in enumerate(names):
    arr = np.asarray(new[name])
    b = base.get(name)
    raw = b is None or np.asarray(b).dtype != arr.dtype or np.asarray(b).shape != arr.shape
    tensors.append([name, weights.dtype_name(arr.dtype), list(arr.shape), raw])
    nw = weights.words(arr)
    bw = None if raw else weights.words(np.asarray(b))
    stats.raw_bytes += arr.nbytes
    stats.elements += arr.size
    for ci, (start, stop) in enumerate(weights.chunk_bounds(nw.size, chunk_elems)):
      jobs.append((ti, ci, None if bw is None else bw[start:stop], nw[start:stop]))
  local = parallel.Local(level)

  def work(job):
    ti, ci, b, n = job
    kind, payload, nnz, ch = codec.encode_chunk(b, n, local.cctx)
    bh = 0 if b is None else weights.chunk_hash(b)
    return ti, ci, kind, payload, nnz, bh, weights.chunk_hash(n), ch

  header = _header_bytes(tensors, chunk_elems)
  sink.write(header)
  written = len(header)
  dig = weights.Digester()
  last_ti = -1
  nrec = 0
  w = parallel.workers(workers)
  with concurrent.futures.ThreadPoolExecutor(w) as pool:
    pdig = pool.submit(weights.digest, base, chunk_elems) if parent_digest is None else None
    for ti, ci, kind, payload, nnz, bh, nh, ch in parallel.ordered(pool, work, jobs, 2 * w):
      if ti != last_ti:
        dig.tensor(*tensors[ti][:3])
        last_ti = ti
      dig.chunk(nh)
      rec = _REC.pack(ti, ci, kind, len(payload), weights.xxh(payload), bh, nh, ch)
      sink.write(rec + _CHECK.pack(xxhash.xxh32_intdigest(rec)))
      sink.write(payload)
      written += _REC.size + _CHECK.size + len(payload)
      nrec += 1
      stats.changed += nnz
      k = codec.KIND_NAMES[kind]
      stats.chunks[k] = stats.chunks.get(k, 0) + 1
    parent_digest = parent_digest if pdig is None else pdig.result()
  stats.parent_digest, stats.digest = parent_digest, dig.hexdigest()
  tail = _TRAILER.pack(nrec, stats.parent_digest.encode(), stats.digest.encode())
  sink.write(END_MAGIC + tail + _CHECK.pack(xxhash.xxh32_intdigest(tail)))
  stats.blob_bytes = written + len(END_MAGIC) + len(tail) + _CHECK.size
  stats.seconds = time.perf_counter() - t0
  return stats


def encode(base: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], **kw) -> bytes:
  """The delta blob that turns `base` into `new` (see `encode_to` for keyword arguments)."""
  buf = io.BytesIO()
  encode_to(buf, base, new, **kw)
  return buf.getvalue()


class _Reader:
  """Exact reads from a file-like source or a bytes-like blob; short reads raise DeltaError."""

  def __init__(self, source):
    if isinstance(source, (bytes, bytearray, memoryview)):
      self._mv, self._pos, self._f = memoryview(source).cast("B"), 0, None
    else:
      self._mv, self._f = None, source

  def read(self, n: int):
    if self._mv is not None:
      out = self._mv[self._pos:self._pos + n]
      self._pos += len(out)
    else:
      out = self._f.read(n)
    if len(out) != n:
      raise DeltaError("blob is truncated")
    return out

  def at_end(self) -> bool:
    if self._mv is not None:
      return self._pos == len(self._mv)
    return not self._f.read(1)


def _read_header(reader) -> dict:
  if bytes(reader.read(len(MAGIC))) != MAGIC:
    raise DeltaError("not a delta blob (bad magic)")
  (n,) = _LEN.unpack(reader.read(_LEN.size))
  if n > _MAX_HEADER:
    raise DeltaError("header too large")
  try:
    head = json.loads(bytes(reader.read(n)))
    if head["format"] not in _KINDS:
      raise DeltaError(f"unsupported format {head['format']}")
    if not 0 < head["chunk_elems"] <= codec.MAX_CHUNK_ELEMS:
      raise DeltaError("bad chunk_elems")
    for name, dt, shape, raw in head["tensors"]:
      weights.dtype_from_name(dt)
      if not (isinstance(name, str) and isinstance(raw, bool) and all(
          isinstance(d, int) and d >= 0 for d in shape)):
        raise DeltaError("bad tensor entry")
  except (ValueError, KeyError, TypeError) as e:
    raise DeltaError(f"bad header: {e}") from e
  return head


def read_header(blob) -> dict:
  """The blob's JSON header (format, chunk_elems, tensors)."""
  return _read_header(_Reader(blob))


def read_trailer(blob) -> tuple[str, str]:
  """(parent digest, new digest) from a complete in-memory blob, without decoding it."""
  mv = memoryview(blob).cast("B")
  n = len(END_MAGIC) + _TRAILER.size + _CHECK.size
  if len(mv) < n or bytes(mv[-n:-n + len(END_MAGIC)]) != END_MAGIC:
    raise DeltaError("blob is truncated (no trailer)")
  tail = bytes(mv[-n + len(END_MAGIC):-_CHECK.size])
  if _CHECK.unpack(mv[-_CHECK.size:])[0] != xxhash.xxh32_intdigest(tail):
    raise DeltaError("trailer checksum mismatch")
  _, parent, digest = _TRAILER.unpack(tail)
  return parent.decode(), digest.decode()


def _records(reader, expected, chunk_elems, itemsizes, fmt):
  """Yields verified (ti, ci, kind, payload, base hash, new hash, changes hash) records."""
  kinds = _KINDS[fmt]
  for ti, ci in expected:
    rec = reader.read(_REC.size)
    (check,) = _CHECK.unpack(reader.read(_CHECK.size))
    if check != xxhash.xxh32_intdigest(rec):
      raise DeltaError(f"record header checksum mismatch at tensor {ti} chunk {ci}")
    rti, rci, kind, plen, ph, bh, nh, ch = _REC.unpack(rec)
    if (rti, rci) != (ti, ci):
      raise DeltaError(f"records out of order: got ({rti},{rci}), want ({ti},{ci})")
    if kind not in kinds:
      raise DeltaError(f"chunk kind {kind} is not valid in format {fmt} (tensor {ti} "
                       f"chunk {ci})")
    if plen > 2 * chunk_elems * itemsizes[ti] + 1024:
      raise DeltaError("payload length is implausible")
    payload = bytes(reader.read(plen))
    if weights.xxh(payload) != ph:
      raise DeltaError(f"payload checksum mismatch at tensor {ti} chunk {ci}")
    yield ti, ci, kind, payload, bh, nh, ch


def _finish(reader, stats, nrec_expected, digest, expect_parent):
  """Reads and checks the trailer against the records seen (their version digest)."""
  if bytes(reader.read(len(END_MAGIC))) != END_MAGIC:
    raise DeltaError("blob is truncated or has extra records (no trailer)")
  tail = bytes(reader.read(_TRAILER.size))
  if _CHECK.unpack(reader.read(_CHECK.size))[0] != xxhash.xxh32_intdigest(tail):
    raise DeltaError("trailer checksum mismatch")
  nrec, parent, dig = _TRAILER.unpack(tail)
  stats.parent_digest, stats.digest = parent.decode(), dig.decode()
  if nrec != nrec_expected:
    raise DeltaError("record count mismatch")
  if stats.digest != digest:
    raise DeltaError("version digest mismatch")
  if expect_parent is not None and stats.parent_digest != expect_parent:
    raise DeltaError("delta's parent is not the expected version")
  if not reader.at_end():
    raise DeltaError("trailing bytes after the trailer")


def _fit_base(base, name, dt, shape):
  dtype = weights.dtype_from_name(dt)
  b = base.get(name)
  if b is None or np.asarray(b).dtype != dtype or tuple(np.asarray(b).shape) != tuple(shape):
    raise DeltaError(f"base does not fit the delta at tensor {name!r} "
                     f"(want {dt}{tuple(shape)})")
  return b


def decode_stream(base: Mapping[str, np.ndarray], source, *, workers=None,
                  expect_parent: str | None = None, out: Mapping[str, np.ndarray] | None = None,
                  recycle: bool = True):
  """Rebuilds the new version from `base` and a blob read from `source`.

  Args:
    base: the parent version; never modified.
    source: bytes-like blob, or a file-like object with `.read(n)`, consumed in order.
    workers: threads (default: cores, at most 8).
    expect_parent: if given, the blob's parent digest must equal it.
    out: optional buffers to write into (name -> array of the right dtype and shape, not
      sharing memory with `base`), e.g. the buffers of the version before `base`; a sampler
      that ping-pongs two sets avoids allocating (and page-faulting) a model per update.
      Tensors without a fitting buffer are allocated. On error the buffers hold garbage.
    recycle: allocate through the module's `buffers.Recycler`: memory of earlier results
      that the caller has dropped entirely is reused (no page faults), and the buffers of the
      last two calls are kept for that (`release_buffers()` frees them). False: plain
      `np.empty`.

  Returns:
    (flat dict of new arrays, Stats).

  Raises:
    DeltaError: on any damage, truncation, reordering, or a base that is not the parent.
  """
  t0 = time.perf_counter()
  reader = _Reader(source)
  head = _read_header(reader)
  chunk_elems = head["chunk_elems"]
  tensors = head["tensors"]
  stats = Stats()
  outs, bases, expected, missing = [], [], [], []
  for name, dt, shape, raw in tensors:
    dtype = weights.dtype_from_name(dt)
    o = None if out is None else out.get(name)
    if o is None or o.dtype != dtype or tuple(o.shape) != tuple(shape) or not (
        o.flags.c_contiguous and o.flags.writeable):
      o = None
      missing.append((len(outs), (dtype, shape)))
    elif name in base and np.shares_memory(o, base[name]):
      raise ValueError(f"out[{name!r}] shares memory with base")
    outs.append(o)
    if raw:
      bases.append(None)
    else:
      bases.append(weights.words(np.asarray(_fit_base(base, name, dt, shape))))
    size = int(np.prod(shape, dtype=np.int64))
    for ci, _ in enumerate(weights.chunk_bounds(size, chunk_elems)):
      expected.append((len(outs) - 1, ci))
    stats.raw_bytes += size * dtype.itemsize
    stats.elements += size
  specs = [spec for _, spec in missing]
  new = _RECYCLER.arrays(specs) if recycle else [np.empty(sh, dt) for dt, sh in specs]
  for (i, _), o in zip(missing, new):
    outs[i] = o
  del new
  local = parallel.Local(1)
  outw = [weights.words(o) for o in outs]

  def work(item):
    ti, ci, kind, payload, bh, nh, _ = item
    start = ci * chunk_elems
    stop = min(outw[ti].size, start + chunk_elems)
    o = outw[ti][start:stop]
    b = None if bases[ti] is None else bases[ti][start:stop]
    if b is None and kind != codec.RAW:
      raise DeltaError(f"tensor {tensors[ti][0]!r} has no base but chunk kind {kind}")
    try:
      codec.decode_chunk(kind, payload, b, o, local.dctx)
    except codec.CodecError as e:
      raise DeltaError(f"tensor {tensors[ti][0]!r} chunk {ci}: {e}") from e
    if weights.chunk_hash(o) != nh:
      if b is not None and weights.chunk_hash(b) != bh:
        raise DeltaError(f"base does not match the delta's parent at tensor "
                         f"{tensors[ti][0]!r} chunk {ci} (foreign or out-of-order delta)")
      raise DeltaError(f"rebuilt chunk hash mismatch at tensor {tensors[ti][0]!r} chunk {ci}")
    return ti, kind, nh

  dig = weights.Digester()
  last_ti = -1
  w = parallel.workers(workers)
  recs = _records(reader, expected, chunk_elems, [o.itemsize for o in outw], head["format"])
  # Batches of records (bounded payload bytes), each run by `map_all` with this thread among
  # the workers: one hand-off per worker per batch. A pool fed chunk by chunk from here barely
  # gained from a second thread on a loaded 2-core machine (every finished chunk waited for
  # this thread to be scheduled to hand out the next).
  with (concurrent.futures.ThreadPoolExecutor(w - 1) if w > 1 else
        contextlib.nullcontext()) as pool:
    for batch in parallel.batches(recs, 32 * w, _BATCH_BYTES, lambda r: len(r[3])):
      for ti, kind, nh in parallel.map_all(pool, work, batch, w):
        if ti != last_ti:
          dig.tensor(*tensors[ti][:3])
          last_ti = ti
        dig.chunk(nh)
        k = codec.KIND_NAMES.get(kind, str(kind))
        stats.chunks[k] = stats.chunks.get(k, 0) + 1
  _finish(reader, stats, len(expected), dig.hexdigest(), expect_parent)
  stats.seconds = time.perf_counter() - t0
  return {t[0]: o for t, o in zip(tensors, outs)}, stats


def decode(base: Mapping[str, np.ndarray], blob, **kw) -> dict[str, np.ndarray]:
  """The new version rebuilt bit-exactly from `base` and `blob`; raises DeltaError.

  New arrays (see `decode_stream` for `out=`, `recycle=` and the other options); their memory
  may be that of an earlier result the caller has dropped entirely (`buffers`).
  """
  return decode_stream(base, blob, **kw)[0]


def warm_up() -> float:
  """Readies the numba kernels every decode and apply runs (`codec.warm_up`: loaded from the
  on-disk kernel cache, or compiled); returns the seconds it took (0-ish after the first call).
  A sampler calls it at start-up (`subscriber.Subscriber` does) so its first delta applies as
  fast as later ones."""
  return codec.warm_up()


def release_buffers() -> None:
  """Lets go of the buffers `decode` keeps for reuse (freed once their users drop them)."""
  _RECYCLER.release()


CHECKS = ("auto", "result", "changes")


def apply_inplace(base: Mapping[str, np.ndarray], source, *, workers=None,
                  expect_parent: str | None = None, verify_base: bool = False,
                  check: str = "auto", reverse: bool = False):
  """Turns `base` into the new version by writing only the changed elements into its arrays.

  The cheap path for a sampler that holds one copy of the weights: no second model is allocated
  or copied, so the work is decompressing the payloads, scattering the changed elements (one
  fused pass, `sparse_kernels` / `unit_kernels`) and proving the result is version `digest`: by
  hashing every rebuilt chunk, or, when the caller vouches for the held version, by checking
  only the changes (see the module docstring).

  All or nothing: the whole blob is read and every record, payload checksum, the trailer, the
  version digest over the records' chunk hashes and `expect_parent` are checked before the
  first byte of `base` changes. Chunks are then applied in parallel and each rebuilt chunk's
  hash is checked; if any chunk fails (a base that is not the parent, a payload that passes its
  checksum but does not decode), every applied chunk is rolled back exactly (unsigned
  subtraction of the same changes) and DeltaError is raised, so `base` holds its previous
  bits again. Readers of `base` must not run concurrently with this call.

  Args:
    base: the parent version; arrays of tensors present in the delta must be writable,
      C-contiguous numpy arrays, each its own memory (ValueError otherwise). The mapping itself
      is not modified.
    source: the blob (bytes-like or file-like; it is read whole before anything is applied).
    workers: threads (default: cores, at most 8).
    expect_parent: if given, the blob's parent digest must equal it, and the caller states
      that the arrays of `base` hold exactly that version (see `check`).
    verify_base: also hash every base chunk against the delta's parent chunk hashes before
      mutating (one more pass over the weights; without it a wrong base is caught by the result
      hashes or the changes hashes and rolled back).
    check: how the result is proven to be the new version. "result": xxh3 of every rebuilt
      chunk (catches any wrong base). "changes": the changes hash of every sparse chunk (cost
      proportional to the changed elements; DENSE/RAW chunks, and sparse ones with more than
      `_CHANGES_HASH_LIMIT` of their elements changed, are hashed whole); needs
      `expect_parent` and relies on `base` holding that version (a base that differs from it
      at changed elements is still caught and rolled back). "auto" (default): "changes" when
      `expect_parent` is given, else "result".
    reverse: undo an applied delta instead: `base` holds the blob's new version and is turned
      back into its parent, every chunk checked by the parent's chunk hash (all or nothing as
      above; `check` and `verify_base` do not apply). Tensors stored whole are left out. For a
      caller whose step after applying failed, e.g. a sampler that could not swap the result in.

  Returns:
    (flat dict of the new version, Stats). Tensors with a base are the very arrays of `base`;
    tensors stored whole (new names, changed dtype or shape) are new arrays; tensors only in
    `base` are left out.

  Raises:
    DeltaError: damage, truncation, reordering, or a base that is not the parent; `base` is
      unchanged.
  """
  if check not in CHECKS:
    raise ValueError(f"check must be one of {CHECKS}, not {check!r}")
  if check == "changes" and expect_parent is None:
    raise ValueError('check="changes" needs expect_parent (the held version\'s digest)')
  if reverse and (check == "changes" or verify_base):
    raise ValueError("reverse=True checks every restored chunk by its parent's hash; "
                     "check='changes' and verify_base do not apply")
  by_changes = not reverse and (
      check == "changes" or (check == "auto" and expect_parent is not None))
  t0 = time.perf_counter()
  reader = _Reader(source)
  head = _read_header(reader)
  chunk_elems = head["chunk_elems"]
  tensors = head["tensors"]
  stats = Stats()
  outs, expected, spans = [], [], []
  for name, dt, shape, raw in tensors:
    if raw:
      o = np.empty(shape, weights.dtype_from_name(dt))
    else:
      o = _fit_base(base, name, dt, shape)
      if not (isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable):
        raise ValueError(f"base[{name!r}] must be a writable C-contiguous numpy array")
      if o.nbytes:
        spans.append((o.__array_interface__["data"][0], o.nbytes, name))
    outs.append(o)
    for ci, _ in enumerate(weights.chunk_bounds(o.size, chunk_elems)):
      expected.append((len(outs) - 1, ci))
    stats.raw_bytes += o.nbytes
    stats.elements += o.size
  spans.sort()
  for (a, n, name), (b, _, other) in zip(spans, spans[1:]):
    if b < a + n:
      raise ValueError(f"base[{name!r}] and base[{other!r}] share memory")
  outw = [weights.words(o) for o in outs]
  # Phase 1: read and check everything; nothing is modified yet.
  recs = list(_records(reader, expected, chunk_elems, [o.itemsize for o in outw],
                       head["format"]))
  dig = weights.Digester()
  last_ti = -1
  for ti, _, _, _, _, nh, _ in recs:
    if ti != last_ti:
      dig.tensor(*tensors[ti][:3])
      last_ti = ti
    dig.chunk(nh)
  _finish(reader, stats, len(expected), dig.hexdigest(), expect_parent)
  raw_t = [t[3] for t in tensors]

  def view(rec):
    ti, ci = rec[0], rec[1]
    start = ci * chunk_elems
    return outw[ti][start:min(outw[ti].size, start + chunk_elems)]

  local = parallel.Local(1)
  w = min(parallel.workers(workers), len(recs))
  with (concurrent.futures.ThreadPoolExecutor(w) if w > 1 else contextlib.nullcontext()) as pool:
    if verify_base:
      def base_ok(rec):
        return raw_t[rec[0]] or weights.chunk_hash(view(rec)) == rec[4]
      bad = [r for r, ok in zip(recs, parallel.map_all(pool, base_ok, recs, w)) if not ok]
      if bad:
        raise DeltaError(f"base does not match the delta's parent at tensor "
                         f"{tensors[bad[0][0]][0]!r} chunk {bad[0][1]}")

    # Phase 2: apply chunk by chunk; returns (applied, error message or None).
    def work(rec):
      ti, ci, kind, payload, bh, nh, ch = rec
      if raw_t[ti] != (kind == codec.RAW):
        return False, f"tensor {tensors[ti][0]!r} chunk {ci}: kind {kind} does not fit"
      if reverse and raw_t[ti]:
        return False, None  # a tensor stored whole has no parent to go back to
      o = view(rec)
      try:
        h = codec.apply_chunk(kind, payload, o, local.dctx, undo=reverse,
                              hash_limit=_CHANGES_HASH_LIMIT if by_changes else 0.0)
      except codec.CodecError as e:
        return False, f"tensor {tensors[ti][0]!r} chunk {ci}: {e}"
      if h is not None:  # only with by_changes: a sparse chunk with few changes
        if h != ch:
          return True, f"changes hash mismatch at tensor {tensors[ti][0]!r} chunk {ci}"
      elif by_changes and kind == codec.SAME:
        pass  # nothing changed: the held bits are the parent's, which are the new ones
      elif weights.chunk_hash(o) != (bh if reverse else nh):
        return True, f"rebuilt chunk hash mismatch at tensor {tensors[ti][0]!r} chunk {ci}"
      return True, None

    results = parallel.map_all(pool, work, recs, w)
    errors = [e for _, e in results if e]
    if errors:
      def undo(rec):
        ti, _, kind, payload, bh, _, _ = rec
        if raw_t[ti]:
          return True
        o = view(rec)
        codec.apply_chunk(kind, payload, o, local.dctx, undo=not reverse, hash_limit=0.0)
        return weights.chunk_hash(o) == (nh if reverse else bh)
      restored = parallel.map_all(pool, undo, [r for r, (done, _) in zip(recs, results) if done], w)
      base_matches = all(restored)
      if not base_matches:
        held = "the delta's new version" if reverse else "the delta's parent"
        raise DeltaError(f"base does not match {held} (foreign or out-of-order "
                         f"delta); rolled back. First failure: {errors[0]}")
      raise DeltaError(f"{errors[0]}; rolled back")
  for _, _, kind, *_ in recs:
    k = codec.KIND_NAMES.get(kind, str(kind))
    stats.chunks[k] = stats.chunks.get(k, 0) + 1
  stats.seconds = time.perf_counter() - t0
  return {t[0]: o for t, o in zip(tensors, outs) if not (reverse and t[3])}, stats
