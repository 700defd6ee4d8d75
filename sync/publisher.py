"""The learner side: publish each new version as a delta on the last, with periodic snapshots.

What: `Publisher(store, snapshot_every=K, keep_snapshots=R)`. `publish(flat)` stores version N
as a delta on N-1 (and, every K versions and for the first one, a full orbax snapshot), writes
N's manifest *after* its objects and the index *after* the manifest, then garbage-collects
versions older than the R-th newest snapshot. `restore(store, version)` rebuilds any retained
version from the newest snapshot at or before it plus the deltas after it.

Why: deltas keep every step cheap to ship; snapshots bound how long a chain a newcomer or a
sampler that fell far behind must replay, and let GC drop old deltas. Writing the index last
makes publishing atomic for readers: they only ever see versions whose bytes are complete.
The publisher keeps one copy of the last published weights (the delta needs its parent) and
updates it in place, so the learner host holds at most: live weights + that copy.
"""

import dataclasses
import io
import time

import numpy as np

from sync import delta
from sync import fetch_plan
from sync import manifest as manifest_lib
from sync import snapshot
from sync import weights


@dataclasses.dataclass
class PublishReport:
  version: int
  snapshot: bool
  delta_bytes: int | None
  snapshot_bytes: int | None
  raw_bytes: int
  encode_s: float
  total_s: float


def read_index(source) -> manifest_lib.Index:
  try:
    return manifest_lib.Index.from_bytes(source.get(manifest_lib.INDEX_KEY))
  except KeyError:
    return manifest_lib.Index()


def read_manifest(source, version: int) -> manifest_lib.Manifest:
  return manifest_lib.Manifest.from_bytes(source.get(manifest_lib.manifest_key(version)))


def fetch_verified(source, ref: manifest_lib.ObjectRef) -> bytes:
  data = source.get(ref.key)
  if len(data) != ref.size or weights.xxh(data) != ref.xxh3:
    raise delta.DeltaError(f"object {ref.key} has the wrong size or hash")
  return data


def load_snapshot(source, m: manifest_lib.Manifest) -> dict:
  """Fetches, verifies and restores a snapshot; checks the weights' digest."""
  files = {r.key: fetch_verified(source, r) for r in m.snapshot}
  flat = snapshot.restore_files(files, m.version, list(m.tensors))
  if weights.digest(flat, m.chunk_elems) != m.digest:
    raise delta.DeltaError(f"snapshot {m.version} does not match its digest")
  return flat


def restore(source, version: int | None = None, workers=None) -> tuple[dict, int]:
  """(weights, version) of `version` (default latest) from a Store or any `.get(key)` source."""
  index = read_index(source)
  p = fetch_plan.plan(index, None, version)
  flat, digest = None, None
  for kind, v in p.steps:
    m = read_manifest(source, v)
    if kind == "snapshot":
      flat, digest = load_snapshot(source, m), m.digest
    else:
      flat = delta.decode(flat, fetch_verified(source, m.delta), workers=workers,
                          expect_parent=digest)
      digest = m.digest
  return flat, p.steps[-1][1]


class Publisher:
  """Publishes versions of flat weights to a Store (see module docstring)."""

  def __init__(self, store, *, snapshot_every: int = 20, keep_snapshots: int = 2,
               chunk_elems: int = weights.CHUNK_ELEMS, level: int = 1, workers=None):
    if snapshot_every < 1 or keep_snapshots < 1:
      raise ValueError("snapshot_every and keep_snapshots must be >= 1")
    self.store = store
    self.snapshot_every = snapshot_every
    self.keep_snapshots = keep_snapshots
    self.chunk_elems = chunk_elems
    self.level = level
    self.workers = workers
    self.index = read_index(store)
    self._prev, self._prev_digest = None, None
    if self.index.latest is not None:  # resume after a restart
      self._prev, _ = restore(store, self.index.latest, workers)
      self._prev_digest = read_manifest(store, self.index.latest).digest

  @property
  def version(self) -> int | None:
    return self.index.latest

  def publish(self, flat: dict, info: dict | None = None) -> PublishReport:
    """Publishes `flat` (name -> array, the sampler's dtype) as the next version."""
    t0 = time.perf_counter()
    version = 0 if self.index.latest is None else self.index.latest + 1
    tensors = {n: [weights.dtype_name(np.asarray(a).dtype), list(np.asarray(a).shape)]
               for n, a in sorted(flat.items())}
    m = manifest_lib.Manifest(version=version, digest="", chunk_elems=self.chunk_elems,
                              tensors=tensors, created=time.time(), info=dict(info or {}))
    encode_s = 0.0
    if self._prev is not None:
      buf = io.BytesIO()
      stats = delta.encode_to(buf, self._prev, flat, chunk_elems=self.chunk_elems,
                              level=self.level, workers=self.workers,
                              parent_digest=self._prev_digest)
      encode_s = stats.seconds
      blob = buf.getvalue()
      key = manifest_lib.delta_key(version)
      self.store.put(key, blob)
      m.parent, m.parent_digest, m.digest = version - 1, self._prev_digest, stats.digest
      m.delta = manifest_lib.ObjectRef(key, len(blob), weights.xxh(blob))
      m.info.update(ratio=stats.ratio, changed=stats.changed, encode_s=stats.seconds)
    else:
      m.digest = weights.digest(flat, self.chunk_elems)
    if self._prev is None or version % self.snapshot_every == 0:
      m.snapshot = snapshot.save(self.store, version, flat)
    self.store.put(manifest_lib.manifest_key(version), m.to_bytes())
    self.index.add(m)
    self.store.put(manifest_lib.INDEX_KEY, self.index.to_bytes())  # the publish point
    self._keep(flat)
    self._prev_digest = m.digest
    self.gc()
    return PublishReport(version, m.snapshot is not None, m.delta_bytes, m.snapshot_bytes,
                         weights.nbytes(flat), encode_s, time.perf_counter() - t0)

  def _keep(self, flat: dict) -> None:
    """Keeps a private copy of the published weights, reusing buffers in place."""
    prev = self._prev or {}
    kept = {}
    for name, a in flat.items():
      a = np.asarray(a)
      old = prev.get(name)
      if old is not None and old.shape == a.shape and old.dtype == a.dtype:
        np.copyto(old, a)
        kept[name] = old
      else:
        kept[name] = a.copy()
    self._prev = kept

  def gc(self) -> list:
    """Drops versions older than the `keep_snapshots`-th newest snapshot; returns them."""
    snaps = sorted(v for v, (_, s) in self.index.versions.items() if s is not None)
    if len(snaps) <= self.keep_snapshots:
      return []
    oldest_kept = snaps[-self.keep_snapshots]
    dropped = sorted(v for v in self.index.versions if v < oldest_kept)
    for v in dropped:
      del self.index.versions[v]
    self.store.put(manifest_lib.INDEX_KEY, self.index.to_bytes())  # unlist first, then delete
    for v in dropped:
      self.store.delete(manifest_lib.manifest_key(v))
      self.store.delete_prefix(manifest_lib.version_dir(v))
    return dropped
