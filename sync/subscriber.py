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
mixed weights.

Damaged links: an object whose bytes are wrong (a delta or snapshot that fails its size, hash,
parent or result checks, a malformed manifest) is remembered as damaged, and the update is
re-planned around it: from the newest snapshot past the damage, then the deltas after it
(`UpdateReport.fallback`, `skipped`; a WARNING log line; `Subscriber.fallbacks`). Every later
delta chains through a damaged one, so without such a snapshot the sampler cannot move; it then
holds its version, says so (WARNING, `waiting_for_snapshot`) and asks the publisher for a
snapshot (`publisher.request_snapshot`, when the source is a writable store), which the publisher
answers even while the learner is not publishing. A transient failure (a missing object, a
transport error) is only avoided for the one poll.

Starting from nothing (`restore`, what a restarted sampler, `publisher.restore` and a restarted
`publisher.Publisher` use) walks the same way: around damaged links through a newer snapshot,
or, without one, to the newest version before the damage, said loudly and with a snapshot asked
for, so a process restarted across damage starts and then catches up instead of failing.

Never silent: `run` catches, logs, counts and retries with back-off every exception of a poll
(a torn index included), so the sync thread does not die on one; if it ends anyway, or the
weights fall behind the published index by more than a bound for longer than a grace period,
`health_problem` says so in a sentence (the sampling server's `/health` lists it and answers 503).

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
import logging
import os
import threading
import time

from sync import delta
from sync import fetch_plan
from sync import manifest as manifest_lib
from sync import objects
from sync import transport

log = logging.getLogger(__name__)

_FAILURES = (delta.DeltaError, manifest_lib.ManifestError, fetch_plan.PlanError, KeyError,
             transport.HttpError, OSError, ValueError)
# The object's bytes are wrong: reading it again will not help, so the link is avoided for good.
_DAMAGE = (delta.DeltaError, manifest_lib.ManifestError)
_REASK_S = 5.0  # how often a subscriber waiting for a snapshot repeats its request


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
  fallback: bool = False  # went through a snapshot because a link on the way was damaged
  skipped: list = dataclasses.field(default_factory=list)  # those links: "delta 7", ...

  @property
  def recovered(self) -> bool:
    return bool(self.rejected)


class _LinkFailed(Exception):
  """Step (kind, version) of a plan could not be fetched or verified."""

  def __init__(self, kind: str, version: int, cause: Exception):
    super().__init__(f"{kind} {version}: {type(cause).__name__}: {cause}")
    self.kind, self.version, self.cause = kind, version, cause


def _without(index: manifest_lib.Index, bad) -> manifest_lib.Index:
  """`index` with the objects in `bad` ({(kind, version)}) unlisted, for planning around them."""
  return manifest_lib.Index(index.latest, {
      v: (None if ("delta", v) in bad else d, None if ("snapshot", v) in bad else s)
      for v, (d, s) in index.versions.items()})


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

  def __init__(self, source, apply_fn, *, workers=None, inplace: bool = False,
               name: str | None = None, request_snapshot=True):
    """Args:
      source: a `store.Store`, `transport.HttpSource` or anything with `.get(key) -> bytes`.
      apply_fn: `apply_fn(flat_weights: dict[str, np.ndarray], version: int) -> None`, called
        with complete, verified weights; it should swap them into the sampler.
      workers: decode threads.
      inplace: apply deltas into the held arrays (see the module docstring).
      name: this subscriber in logs and snapshot requests (default: host pid and id).
      request_snapshot: how to ask for a snapshot when a damaged link blocks the way:
        True (write a request to `source` if it is a writable store), False (only wait), or a
        callable `(past_version, reason) -> None`.

    The delta kernels are readied here (`delta.warm_up`: loaded from the on-disk kernel cache,
    or compiled once per process), at the sampler's start-up rather than inside its first
    update, so the first swap is as quick as later ones; `warm_up_s`: the seconds this process
    spent on it (the first subscriber pays, later ones find the kernels ready).
    """
    self.warm_up_s = delta.warm_up()
    self.source = source
    self.apply_fn = apply_fn
    self.workers = workers
    self.inplace = inplace
    self.name = name or f"{os.uname().nodename}-{os.getpid()}-{id(self):x}"
    if request_snapshot is True:
      request_snapshot = (None if not hasattr(source, "put") else
                          lambda past, reason: objects.request_snapshot(
                              source, self.name, past, reason))
    self._request = request_snapshot or None
    self.version = None
    self.digest = None
    self.weights = None
    self.reports = []
    self._served = None  # the version last handed to apply_fn
    self.published = None  # index.latest at the last successful index read
    self.damaged = {}  # (kind, version) -> why: objects whose bytes are wrong
    self.fallbacks = 0  # updates that went around a damaged link through a snapshot
    self.waiting_for_snapshot = None  # a snapshot must be at or past this version to move on
    self.errors = 0  # failed polls in `run`
    self.last_error = None
    self.thread_state = "not started"  # "running", "stopped" or "died: ..." (see `run`)
    self._asked = (None, 0.0)  # (past, monotonic time) of the last snapshot request
    self._seen_at = {}  # version -> monotonic time this subscriber first saw it published
    self._index_ok_at = time.monotonic()  # last successful index read (start: construction)
    self._index_error = None  # why the index reads fail since then, if they do

  def adopt(self, flat: dict, version: int, digest: str) -> None:
    """Declares that the sampler already serves `flat` = published `version` (e.g. it was
    started from `publisher.restore`), so polling only moves forward from there."""
    self.weights, self.version, self.digest = flat, version, digest
    self._served = version

  def _follow(self, src, steps):
    """Follows `steps` from the held version; raises `_LinkFailed` naming the step that failed."""
    flat, version, digest = self.weights, self.version, self.digest
    decode_s = 0.0
    held = True  # flat's arrays are the held ones (until a snapshot replaces them)
    for kind, v in steps:
      try:
        m = objects.read_manifest(src, v)
        if kind == "snapshot":
          flat = objects.load_snapshot(src, m)
          held = False
        else:
          if m.parent != version or m.parent_digest != digest or flat is None:
            raise delta.DeltaError(f"delta {v} applies to {m.parent}, not to the held {version} "
                                   "(foreign or reordered delta)")
          blob = objects.fetch_verified(src, m.delta)
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
      except _FAILURES as e:
        raise _LinkFailed(kind, v, e) from e
      if kind == "delta" and self.inplace and held:
        # The held arrays now are version v: record it, so a later failure in this chain
        # leaves a consistent (older than latest, verified) state.
        self.weights, self.version, self.digest = flat, v, m.digest
      version, digest = v, m.digest
    return flat, version, digest, decode_s

  def _read_index(self) -> manifest_lib.Index:
    """The index, recording the read (or why it failed) for `health_problem`."""
    try:
      index = objects.read_index(self.source)
    except Exception as e:
      self._index_error = f"{type(e).__name__}: {e}"
      raise
    self._saw(index)
    # Damage to objects the publisher has since dropped no longer matters.
    self.damaged = {k: r for k, r in self.damaged.items() if k[1] in index.versions}
    return index

  def _reach(self, index, target: int, bad: dict, rejected: list):
    """Plans and follows the cheapest path from the held version to `target` that avoids the
    objects in `bad` ({(kind, version): why}), re-planning after each link that fails (added
    to `bad` and `rejected`; a damaged one also to `self.damaged`, with a WARNING). The one
    chain walker: `poll`, `restore` and (through them) `publisher.restore` and a restarted
    `publisher.Publisher` all build weights here.

    Returns:
      (flat, version, digest, plan, counted source, fetch_s, decode_s) of the path followed.
    Raises:
      fetch_plan.PlanError: no retained path avoids `bad` (see `bad`, `rejected` for why).
    """
    while True:
      src = _Counting(self.source)
      t0 = time.perf_counter()
      p = fetch_plan.plan(_without(index, bad), self.version, target)
      try:
        flat, version, digest, decode_s = self._follow(src, p.steps)
      except _LinkFailed as e:
        rejected.append(str(e))
        bad[(e.kind, e.version)] = str(e)
        if isinstance(e.cause, _DAMAGE) and (e.kind, e.version) not in self.damaged:
          self.damaged[(e.kind, e.version)] = str(e)
          log.warning("weight sync %s: %s %d is damaged (%s: %s); planning around it",
                      self.name, e.kind, e.version, type(e.cause).__name__, e.cause)
        continue
      return flat, version, digest, p, src, time.perf_counter() - t0 - decode_s, decode_s

  def _skipped(self, start: int | None, version: int) -> list:
    """The damaged links between `start` (exclusive; None: nothing) and `version`."""
    return [f"{k} {v}" for k, v in sorted(self.damaged, key=lambda x: (x[1], x[0]))
            if v <= version and (start is None or v > start)]

  def poll(self, target: int | None = None) -> UpdateReport | None:
    """Moves to the newest version if there is one (or to `target`, a published version not
    older than the one held: a shard's stream may run ahead of its sharded version, see
    `sharded`); returns its report, or None when already there.

    Raises:
      SyncError: every path failed (or, with a damaged link and no snapshot past it, none
        exists yet); the previous weights are still held (and served).
      ValueError: `target` is older than the version held, or not published.
      manifest.ManifestError: the index stayed malformed through `read_index`'s retries.
    """
    index = self._read_index()
    if target is not None:
      if target not in index.versions or (self.version is not None and target < self.version):
        raise ValueError(f"cannot move from version {self.version} to {target} (published: "
                         f"{sorted(index.versions)})")
      index = manifest_lib.Index(target, {v: s for v, s in index.versions.items() if v <= target})
    if index.latest is None or index.latest == self.version == self._served:
      return None
    start = self.version
    bad = dict(self.damaged)  # + objects that failed transiently, avoided in this poll only
    rejected = []
    from_version = self._served
    try:
      flat, version, digest, p, src, fetch_s, decode_s = self._reach(index, index.latest, bad,
                                                                     rejected)
    except fetch_plan.PlanError as e:
      if any(k in self.damaged for k in bad):
        self._wait_for_snapshot(index)
      raise SyncError(f"update to {index.latest} failed: {rejected}") from e
    skipped = self._skipped(start, version)
    t = time.perf_counter()
    self.apply_fn(flat, version)
    pause = time.perf_counter() - t
    report = UpdateReport(version, from_version, p.steps, src.bytes, fetch_s, decode_s, pause,
                          rejected, fallback=bool(skipped), skipped=skipped)
    self.weights, self.version, self.digest = flat, version, digest
    self._served = version
    self._seen_at = {v: t for v, t in self._seen_at.items() if v > version}
    self.waiting_for_snapshot = None
    self.reports.append(report)
    if skipped:
      self.fallbacks += 1
      log.warning("weight sync %s: fell back to snapshot %d to reach version %d from %s, "
                  "skipping damaged %s", self.name, p.steps[0][1], version, from_version,
                  ", ".join(skipped))
    return report

  def restore(self, version: int | None = None) -> UpdateReport:
    """Loads a published version from nothing and holds it as served (as `adopt` does), without
    calling `apply_fn`: `version`, or by default the newest one it can reach. For a process
    that starts on published weights (a restarted sampler or learner) and may then follow.

    Damaged objects are planned around as in `poll`: through a newer snapshot past them if
    there is one. Without one, the default is the newest version whose path avoids them: it
    says so (WARNING), asks for a snapshot past the damage as `poll` does, and later polls move
    on once one is published. The report's `fallback`/`skipped` name the damaged links avoided
    (all of them, also those past the version reached); `version` < `published` says it fell
    short. An explicit `version` is that version or an error.

    Raises:
      fetch_plan.PlanError: nothing is published, or `version` is not retained.
      SyncError: no retained version (or not `version`) can be reached, for damage or
        transient failures; nothing is held.
      manifest.ManifestError: the index stayed malformed through `read_index`'s retries.
      ValueError: this subscriber already holds a version (it moves on with `poll`).
    """
    if self.version is not None:
      raise ValueError(f"weight sync {self.name}: restore starts from nothing, but version "
                       f"{self.version} is held (poll moves on from it)")
    index = self._read_index()
    if index.latest is None:
      raise fetch_plan.PlanError("nothing published yet")
    targets = [version] if version is not None else sorted(index.versions, reverse=True)
    bad = dict(self.damaged)  # + objects that failed transiently, avoided in this call only
    rejected = []
    for target in targets:
      try:
        got = self._reach(index, target, bad, rejected)
        break
      except fetch_plan.PlanError as e:
        blocked_by_damage = any(k in self.damaged for k in bad)
        if version is not None and not rejected and not blocked_by_damage:
          raise  # not retained
        if version is None and blocked_by_damage:
          continue  # an older version may lie before the damage
        if blocked_by_damage:
          self._wait_for_snapshot(index)
        what = "the newest version" if version is None else f"version {version}"
        raise SyncError(f"restoring {what} failed: {rejected}") from e
    else:
      self._wait_for_snapshot(index)
      raise SyncError(f"no published version can be restored around damaged "
                      f"{sorted(self.damaged)}: {rejected}")
    flat, got_version, digest, p, src, fetch_s, decode_s = got
    self.weights, self.version, self.digest = flat, got_version, digest
    self._served = got_version
    self._seen_at = {v: t for v, t in self._seen_at.items() if v > got_version}
    skipped = self._skipped(None, index.latest if version is None else got_version)
    report = UpdateReport(got_version, None, p.steps, src.bytes, fetch_s, decode_s, 0.0,
                          rejected, fallback=bool(skipped), skipped=skipped)
    if skipped:
      self.fallbacks += 1
    if version is None and got_version < index.latest:
      log.warning("weight sync %s: cannot restore the newest version %d (damaged %s); restored "
                  "version %d, the newest reachable, and following from there", self.name,
                  index.latest, ", ".join(skipped), got_version)
      self._wait_for_snapshot(index)
    elif skipped:
      log.warning("weight sync %s: restored version %d through snapshot %d, skipping damaged "
                  "%s", self.name, got_version, p.steps[0][1], ", ".join(skipped))
    return report

  def _saw(self, index: manifest_lib.Index) -> None:
    """Records a successful index read and when each newly published version was first seen."""
    now = time.monotonic()
    self._index_ok_at, self._index_error = now, None
    if index.latest is not None:
      first = max(self.published if self.published is not None else -1,
                  self._served if self._served is not None else -1) + 1
      for v in range(first, index.latest + 1):
        self._seen_at.setdefault(v, now)
      self.published = index.latest

  def _wait_for_snapshot(self, index: manifest_lib.Index) -> None:
    """No path avoids the damaged links: say so once, ask for a snapshot past them (again every
    `_REASK_S`, in case a request was lost), and hold the current version."""
    past = max(v if kind == "delta" else v + 1 for kind, v in self.damaged)
    now = time.monotonic()
    asked_past, asked_at = self._asked
    if past != self.waiting_for_snapshot:
      log.warning("weight sync %s: cannot reach version %d: %s damaged and no snapshot at or "
                  "past version %d is published; holding version %s and %s", self.name,
                  index.latest, ", ".join(f"{k} {v}" for k, v in sorted(self.damaged)), past,
                  self.version, "asking the publisher for one" if self._request else
                  "waiting for one")
    self.waiting_for_snapshot = past
    if self._request is not None and (asked_past != past or now - asked_at >= _REASK_S):
      try:
        self._request(past, f"{self.name} holds {self.version}; damaged: "
                      f"{sorted(self.damaged)}")
        self._asked = (past, now)
      except Exception as e:  # pylint: disable=broad-except
        log.warning("weight sync %s: could not ask for a snapshot: %s", self.name, e)

  def stats(self) -> dict:
    """This subscriber's state for reports and logs."""
    return {"name": self.name, "version": self._served, "published": self.published,
            "updates": len(self.reports), "fallbacks": self.fallbacks,
            "damaged": sorted(f"{k} {v}" for k, v in self.damaged),
            "waiting_for_snapshot": self.waiting_for_snapshot, "errors": self.errors,
            "last_error": self.last_error, "thread": self.thread_state}

  def health_problem(self, max_behind_versions: int = 2,
                     max_stale_s: float = 60.0) -> str | None:
    """None if weight sync is fine, else a sentence saying what is wrong (for `/health`).

    Wrong: the sync thread (`run`) died; index reads have failed for over `max_stale_s`; or the
    served version has been more than `max_behind_versions` behind the published one for over
    `max_stale_s` (counted from when the first version past that bound was seen published).
    """
    if self.thread_state.startswith("died"):
      return f"weight sync {self.name}: the sync thread {self.thread_state}"
    if self.thread_state == "stopped":
      return None  # shut down on purpose
    now = time.monotonic()
    why = f" (last error: {self.last_error})" if self.last_error else ""
    if self._index_error is not None and now - self._index_ok_at > max_stale_s:
      return (f"weight sync {self.name}: no weight index read succeeded for "
              f"{now - self._index_ok_at:.0f} s ({self._index_error})")
    if self.published is None:
      return None
    served = -1 if self._served is None else self._served
    first = self._seen_at.get(served + max_behind_versions + 1)
    if self.published - served > max_behind_versions and first is not None and \
        now - first > max_stale_s:
      return (f"weight sync {self.name}: serving version {self._served}, "
              f"{self.published - served} behind the published {self.published} for "
              f"{now - first:.0f} s (bound: {max_behind_versions} versions, {max_stale_s:g} s)"
              f"{why}")
    return None

  def run(self, stop: threading.Event, interval_s: float = 1.0, on_error=None,
          max_backoff_s: float = 2.0) -> None:
    """Polls until `stop` is set.

    A failed poll (any exception) is counted (`errors`, `last_error`), logged at WARNING (once
    per distinct error, then again when polling recovers), passed to `on_error` and retried
    after a back-off that doubles from `interval_s` up to `max_backoff_s`. If the loop itself
    ends on an exception, `thread_state` says so and `health_problem` reports it.
    """
    self.thread_state = "running"
    failures, logged = 0, None
    try:
      while not stop.is_set():
        try:
          self.poll()
        except Exception as e:  # pylint: disable=broad-except -- the thread must not die on one
          failures += 1
          self.errors += 1
          self.last_error = f"{type(e).__name__}: {e}"
          if self.last_error != logged:
            log.warning("weight sync %s: poll failed (%s); holding version %s, retrying with "
                        "back-off", self.name, self.last_error, self._served,
                        exc_info=not isinstance(e, SyncError))
            logged = self.last_error
          if on_error is not None:
            try:
              on_error(e)
            except Exception:  # pylint: disable=broad-except
              log.exception("weight sync %s: on_error failed", self.name)
          stop.wait(min(interval_s * 2 ** min(failures, 20), max(max_backoff_s, interval_s)))
          continue
        if failures:
          log.warning("weight sync %s: polling works again after %d failed polls (at "
                      "version %s)", self.name, failures, self._served)
          failures, logged, self.last_error = 0, None, None
        stop.wait(interval_s)
      self.thread_state = "stopped"
    except BaseException as e:
      self.thread_state = f"died: {type(e).__name__}: {e}"
      log.critical("weight sync %s: the sync thread died: %s", self.name, e, exc_info=True)
      raise
