"""The sampler side: fetch, verify and decode new versions, then hand them over all at once.

What: `Subscriber(source, apply_fn)` follows a store (directly, or through relays with
`transport.HttpSource`). `poll()` reads the index; if a newer version exists it plans the cheapest
path (delta chain, or newest snapshot plus deltas, see `fetch_plan`), fetches each object, checks
its size and hash against the manifest, checks each delta's parent digest against the version
held, decodes it (into fresh arrays, or with `inplace=True` straight into the held arrays, see
below), verifies the result's digest, and only then calls `apply_fn(flat_weights, version)` (the
sampling server's swap). It returns an `UpdateReport` with the bytes moved, the fetch/decode
time and the pause (time inside `apply_fn`).

Why all-or-nothing: the sampler keeps serving its current weights while the next version is
assembled off to the side; a bad or interrupted update (damaged, truncated, foreign or
reordered delta, a relay dying mid-transfer) raises before `apply_fn`, so a sampler is never on
mixed weights. A rejected delta path is retried once through a full snapshot.

`inplace=True` is the cheap path for a sampler that keeps one host copy of the weights:
`delta.apply_inplace` writes only the changed elements into the held arrays (no second model
allocated or copied; cost ~ changed elements + one hash pass) and is itself all-or-nothing
(checks before the first write, exact roll-back if a result hash fails). `apply_fn` then gets
the same array objects every time, mutated between calls, so it must copy what it keeps (e.g.
to the accelerator) and must not read them while `poll` runs. If a catch-up chain fails after
some of its deltas were applied in place, the subscriber holds (and reports) the last verified
version reached; `apply_fn` is only called for a complete update.
"""

import dataclasses
import threading
import time

from sync import delta
from sync import fetch_plan
from sync import manifest as manifest_lib
from sync import transport
from sync import publisher

_FAILURES = (delta.DeltaError, manifest_lib.ManifestError, fetch_plan.PlanError, KeyError,
             transport.HttpError, OSError, ValueError)


class SyncError(RuntimeError):
  """No update could be applied; the subscriber still holds its previous version."""


@dataclasses.dataclass
class UpdateReport:
  version: int
  from_version: int | None
  steps: list
  bytes_moved: int
  fetch_s: float
  decode_s: float
  pause_s: float
  rejected: list  # errors from paths that were tried and rejected before this one

  @property
  def recovered(self) -> bool:
    return bool(self.rejected)


class _Counting:
  """Counts bytes and time of `.get` on a source."""

  def __init__(self, source):
    self._source = source
    self.bytes = 0
    self.seconds = 0.0

  def get(self, key):
    t = time.perf_counter()
    data = self._source.get(key)
    self.seconds += time.perf_counter() - t
    self.bytes += len(data)
    return data


class Subscriber:
  """Keeps a sampler's weights at the newest published version (see module docstring)."""

  def __init__(self, source, apply_fn, *, workers=None, inplace: bool = False):
    """Args:
      source: a `store.Store`, `transport.HttpSource` or anything with `.get(key) -> bytes`.
      apply_fn: `apply_fn(flat_weights: dict[str, np.ndarray], version: int) -> None`, called
        with complete, verified weights; it should swap them into the sampler.
      workers: decode threads.
      inplace: apply deltas into the held arrays (see the module docstring).
    """
    self.source = source
    self.apply_fn = apply_fn
    self.workers = workers
    self.inplace = inplace
    self.version = None
    self.digest = None
    self.weights = None
    self.reports = []
    self._served = None  # the version last handed to apply_fn

  def adopt(self, flat: dict, version: int, digest: str) -> None:
    """Declares that the sampler already serves `flat` = published `version` (e.g. it was
    started from `publisher.restore`), so polling only moves forward from there."""
    self.weights, self.version, self.digest = flat, version, digest
    self._served = version

  def _follow(self, src, steps):
    flat, version, digest = self.weights, self.version, self.digest
    decode_s = 0.0
    held = True  # flat's arrays are the held ones (until a snapshot replaces them)
    for kind, v in steps:
      m = publisher.read_manifest(src, v)
      if kind == "snapshot":
        flat = publisher.load_snapshot(src, m)
        held = False
      else:
        if m.parent != version or m.parent_digest != digest or flat is None:
          raise delta.DeltaError(f"delta {v} applies to {m.parent}, not to the held {version} "
                                 "(foreign or reordered delta)")
        blob = publisher.fetch_verified(src, m.delta)
        if delta.read_trailer(blob)[1] != m.digest:  # before anything is written
          raise delta.DeltaError(f"delta {v} does not rebuild the manifest's version")
        t = time.perf_counter()
        if self.inplace:
          flat, stats = delta.apply_inplace(flat, blob, workers=self.workers,
                                            expect_parent=digest)
        else:
          flat, stats = delta.decode_stream(flat, blob, workers=self.workers,
                                            expect_parent=digest)
        decode_s += time.perf_counter() - t
        if stats.digest != m.digest:
          raise delta.DeltaError(f"delta {v} does not rebuild the manifest's version")
        if self.inplace and held:
          # The held arrays now are version v: record it, so a later failure in this chain
          # leaves a consistent (older than latest, verified) state.
          self.weights, self.version, self.digest = flat, v, m.digest
      version, digest = v, m.digest
    return flat, version, digest, decode_s

  def poll(self) -> UpdateReport | None:
    """Moves to the newest version if there is one; returns its report, or None.

    Raises:
      SyncError: every path failed; the previous weights are still held (and served).
    """
    index = publisher.read_index(self.source)
    if index.latest is None or index.latest == self.version == self._served:
      return None
    rejected = []
    avoid = None
    from_version = self._served
    while True:
      src = _Counting(self.source)
      t0 = time.perf_counter()
      try:
        p = fetch_plan.plan(index, self.version if avoid is None else None, index.latest)
        flat, version, digest, decode_s = self._follow(src, p.steps)
        break
      except _FAILURES as e:
        rejected.append(f"{type(e).__name__}: {e}")
        if avoid is not None:
          raise SyncError(f"update to {index.latest} failed: {rejected}") from e
        avoid = self.version  # recover through a full snapshot
    fetch_s = time.perf_counter() - t0 - decode_s
    t = time.perf_counter()
    self.apply_fn(flat, version)
    pause = time.perf_counter() - t
    report = UpdateReport(version, from_version, p.steps, src.bytes, fetch_s, decode_s, pause,
                          rejected)
    self.weights, self.version, self.digest = flat, version, digest
    self._served = version
    self.reports.append(report)
    return report

  def run(self, stop: threading.Event, interval_s: float = 1.0, on_error=None) -> None:
    """Polls until `stop` is set; errors go to `on_error` (default: ignored, retried)."""
    while not stop.is_set():
      try:
        self.poll()
      except SyncError as e:
        if on_error is not None:
          on_error(e)
      stop.wait(interval_s)
