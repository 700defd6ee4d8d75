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

Damaged links: a delta damaged in the store (a bad disk, a partial copy, a hand) cannot be
applied, and every later delta chains through it, so a sampler that holds an older version can
only move on through a snapshot newer than the damage. Waiting for the next periodic snapshot
can deadlock a run whose learner waits for data from those very samplers, so a subscriber asks
for one (`request_snapshot`, an object under `manifest.SNAPSHOT_REQUESTS`) and the publisher
answers: `publish` makes the version it writes a snapshot while a request is pending, and
`answer_requests` (called by a background thread with `answer_requests_s`, for a learner that is
not publishing) adds a snapshot to the newest version from the copy it holds.

Restarts across damage: `restore` and a restarted `Publisher` rebuild through the subscriber's
walker, which verifies every object and plans around damaged ones (see `subscriber`). A restarted
publisher that cannot rebuild the newest version holds nothing, so its next version is a full
snapshot rather than a delta on weights it does not have (until then it cannot answer requests,
unless the learner hands it those weights with `hold`).

The store writes each object atomically (see `store`), so the index is never seen torn there;
`read_index` still retries a parse failure with back-off, for readers behind other writers or
copies (relays, rsync'd mirrors).
"""

import dataclasses
import io
import json
import logging
import threading
import time
import weakref

import numpy as np

from sync import delta
from sync import manifest as manifest_lib
from sync import objects
from sync import snapshot
from sync import subscriber
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
  digest: str = ""  # the version's (weights.digest)


log = logging.getLogger(__name__)


# Reading the store lives in `objects` (the subscriber needs it too); the names stay here.
read_index = objects.read_index
request_snapshot = objects.request_snapshot
read_manifest = objects.read_manifest
fetch_verified = objects.fetch_verified
load_snapshot = objects.load_snapshot


def restore(source, version: int | None = None, workers=None) -> tuple[dict, int]:
  """(weights, version) of `version` from a Store or any `.get(key)` source; by default the
  newest version it can reach.

  Every object is verified and a damaged one is planned around (`subscriber.Subscriber.restore`,
  the one chain walker): through a newer snapshot past it, or, by default, to the newest version
  before it, with a WARNING; compare the version returned with `read_index(source).latest`.
  It asks for no snapshot (a sampler that follows uses a `Subscriber`, which does).

  Raises:
    fetch_plan.PlanError: nothing is published, or `version` is not retained.
    subscriber.SyncError: `version` (or any version) cannot be reached.
  """
  sub = subscriber.Subscriber(source, None, workers=workers, name="restore",
                              request_snapshot=False)
  got = sub.restore(version).version
  return sub.weights, got


class Publisher:
  """Publishes versions of flat weights to a Store (see module docstring)."""

  def __init__(self, store, *, snapshot_every: int = 20, keep_snapshots: int = 2,
               chunk_elems: int = weights.CHUNK_ELEMS, level: int = 1, workers=None,
               answer_requests_s: float | None = None):
    """Args:
      store: a `store.Store`.
      snapshot_every: every this many versions (and the first) is also a full snapshot.
      keep_snapshots: GC keeps this many newest snapshots and the versions after the oldest.
      chunk_elems, level, workers: delta encoding settings.
      answer_requests_s: if set, a background thread answers subscribers' snapshot requests
        this often (see module docstring); it ends with `close()` or when the publisher is
        garbage-collected.
    """
    if snapshot_every < 1 or keep_snapshots < 1:
      raise ValueError("snapshot_every and keep_snapshots must be >= 1")
    self._lock = threading.RLock()  # publish, answer_requests and gc write the same index
    self.requested_snapshots = 0  # snapshots written because a subscriber asked
    self._closed = threading.Event()
    self.store = store
    self.snapshot_every = snapshot_every
    self.keep_snapshots = keep_snapshots
    self.chunk_elems = chunk_elems
    self.level = level
    self.workers = workers
    self.index = read_index(store)
    self._prev, self._prev_digest = None, None
    self._tensors = None  # the newest published version's {name: [dtype, shape]}
    self._told_unanswerable = False
    if self.index.latest is not None:  # resume after a restart
      self._resume()
    if answer_requests_s is not None:
      threading.Thread(target=_answer_loop, args=(weakref.ref(self), self._closed,
                                                  answer_requests_s),
                       daemon=True, name="publisher-requests").start()

  def _resume(self) -> None:
    """Rebuilds the newest published version (the next delta's parent) after a restart.

    If it cannot be rebuilt (a damaged or missing object on every path to it), the publisher
    holds nothing: its next version is a full snapshot, not a delta on weights it does not
    have, and snapshot requests wait for that publish (or for `hold`).
    """
    latest = self.index.latest
    sub = subscriber.Subscriber(self.store, None, workers=self.workers, name="publisher",
                                request_snapshot=False)
    try:
      sub.restore(latest)
    except subscriber.SyncError as e:
      log.warning("weight sync: the restarted publisher cannot rebuild the newest published "
                  "version %d (%s); its next version will be a full snapshot", latest, e)
      return
    self._prev, self._prev_digest = sub.weights, sub.digest

  def hold(self, flat: dict) -> bool:
    """Declares that `flat` is the newest published version's weights (e.g. a restarted learner
    whose own checkpoint reached it) for a publisher that could not rebuild it (see `_resume`);
    returns whether it took them.

    Checked against the manifest's digest, so wrong weights are refused (False) and the next
    version stays a full snapshot. Taken, the next version is a delta again and snapshot
    requests can be answered from them.
    """
    with self._lock:
      latest = self.index.latest
      if latest is None:
        return False
      m = read_manifest(self.store, latest)
      if m.chunk_elems != self.chunk_elems or weights.digest(flat, self.chunk_elems) != m.digest:
        log.warning("weight sync: the weights offered as version %d do not match its digest; "
                    "not holding them", latest)
        return False
      self._keep(flat)
      self._prev_digest = m.digest
      self._told_unanswerable = False
      return True

  @property
  def version(self) -> int | None:
    return self.index.latest

  @property
  def holds_latest(self) -> bool:
    """Whether the publisher holds the newest published version's weights (False after a
    restart that could not rebuild them, until `hold` or the next publish)."""
    return self.index.latest is None or self._prev is not None

  def close(self) -> None:
    """Stops the request-answering thread (if any)."""
    self._closed.set()

  def _requests(self) -> dict:
    """Pending snapshot requests: store key -> the version the snapshot must be at or past."""
    out = {}
    for key in self.store.list(manifest_lib.SNAPSHOT_REQUESTS):
      try:
        out[key] = int(json.loads(self.store.get(key))["past"])
      except KeyError:  # withdrawn or answered since the listing
        continue
      except (ValueError, TypeError) as e:
        log.warning("dropping malformed snapshot request %s: %s", key, e)
        self.store.delete(key)
    return out

  def answer_requests(self) -> int | None:
    """Answers pending snapshot requests; returns the version it snapshotted, or None.

    A request is answered by a retained snapshot at or past its version if one exists, else by
    a snapshot of the newest version (from the copy of it the publisher holds); a request past
    the newest version waits for the next publish (which then is a snapshot).
    """
    with self._lock:
      pending = self._requests()
      latest = self.index.latest
      if not pending or latest is None:
        return None
      made = None
      newest = self._newest_snapshot()
      unmet = [past for past in pending.values()
               if past <= latest and (newest is None or newest < past)]
      if unmet and self._prev is None:  # a restart could not rebuild `latest` (see _resume)
        if not self._told_unanswerable:
          log.warning("weight sync: cannot answer snapshot requests (%s) until the next publish: "
                      "this publisher does not hold version %d", ", ".join(sorted(pending)),
                      latest)
          self._told_unanswerable = True
        return None
      if unmet:
        m = read_manifest(self.store, latest)
        if m.snapshot is None:
          m.snapshot = snapshot.save(self.store, latest, self._prev)
          self.store.put(manifest_lib.manifest_key(latest), m.to_bytes())
          self.index.add(m)
          self.store.put(manifest_lib.INDEX_KEY, self.index.to_bytes())
          self.requested_snapshots += 1
          made = latest
          log.warning("weight sync: wrote a snapshot of version %d on request (%s)", latest,
                      ", ".join(sorted(pending)))
      for key, past in pending.items():
        if past <= latest:
          self.store.delete(key)
      if made is not None:
        self.gc()
      return made

  def _newest_snapshot(self) -> int | None:
    return max((v for v, (_, s) in self.index.versions.items() if s is not None), default=None)

  def publish(self, flat: dict, info: dict | None = None) -> PublishReport:
    """Publishes `flat` (name -> array, the sampler's dtype) as the next version.

    Raises:
      ValueError: `flat`'s tensors (names, dtypes, shapes) are not the newest published
        version's (see `_check_layout`).
    """
    with self._lock:
      return self._publish(flat, info)

  def _publish(self, flat, info) -> PublishReport:
    t0 = time.perf_counter()
    version = 0 if self.index.latest is None else self.index.latest + 1
    tensors = {n: [weights.dtype_name(np.asarray(a).dtype), list(np.asarray(a).shape)]
               for n, a in sorted(flat.items())}
    self._check_layout(version, tensors)
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
    answered = [k for k, past in self._requests().items() if past <= version]
    if self._prev is None or version % self.snapshot_every == 0 or answered:
      m.snapshot = snapshot.save(self.store, version, flat)
      if answered and self._prev is not None and version % self.snapshot_every:
        self.requested_snapshots += 1
        log.warning("weight sync: version %d is a snapshot on request (%s)", version,
                    ", ".join(sorted(answered)))
    self.store.put(manifest_lib.manifest_key(version), m.to_bytes())
    self.index.add(m)
    self.store.put(manifest_lib.INDEX_KEY, self.index.to_bytes())  # the publish point
    self._tensors = tensors
    for key in answered:  # this version is a snapshot at or past each of them
      self.store.delete(key)
    self._keep(flat)
    self._prev_digest = m.digest
    self.gc()
    return PublishReport(version, m.snapshot is not None, m.delta_bytes, m.snapshot_bytes,
                         weights.nbytes(flat), encode_s, time.perf_counter() - t0, m.digest)

  def _check_layout(self, version: int, tensors: dict) -> None:
    """Raises ValueError unless `tensors` ({name: [dtype, shape]}) are the newest published
    version's: the samplers hold weights of that layout, in the sampler's dtype, and a delta
    to another one would ship the changed tensors whole and hand the samplers another dtype
    (a learner restarted with another `sampler_dtype`, say)."""
    if version == 0:
      return
    if self._tensors is None:
      try:
        self._tensors = read_manifest(self.store, version - 1).tensors
      except (KeyError, manifest_lib.ManifestError):  # damaged: nothing to compare with
        return
    if tensors == self._tensors:
      return
    old, new = self._tensors, tensors
    diff = sorted(set(old) ^ set(new)) or [n for n in sorted(new) if new[n] != old[n]]
    name = diff[0]
    was = "absent" if name not in old else f"{old[name][0]} {tuple(old[name][1])}"
    now = "absent" if name not in new else f"{new[name][0]} {tuple(new[name][1])}"
    raise ValueError(
        f"version {version} does not have the published version {version - 1}'s tensors "
        f"({len(diff)} differ; {name!r}: {was} there, {now} here): publish every version in "
        "the samplers' dtype and layout (rl.learner.LearnerConfig.sampler_dtype), or start a "
        "new store")

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
    with self._lock:
      return self._gc()

  def _gc(self) -> list:
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


def _answer_loop(ref, closed: threading.Event, interval_s: float) -> None:
  """Answers snapshot requests every `interval_s` until closed or the publisher is collected;
  a failure is logged and retried (it must not end the thread: the run would deadlock)."""
  while not closed.wait(interval_s):
    pub = ref()
    if pub is None:
      return
    try:
      pub.answer_requests()
    except Exception:  # pylint: disable=broad-except
      log.exception("weight sync: answering snapshot requests failed; retrying")
    del pub
