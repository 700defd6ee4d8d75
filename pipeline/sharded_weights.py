"""Weight sync for a learner of several processes: the sharded channel and a sampler following it.

What:
  * `ShardedWeightChannel` is the learner side when the learner runs as several `jax.distributed`
    processes (pipeline.processes.run_learner): every process publishes the blocks of the
    weights it holds (`rl.learner.Learner.sampler_shards`) through a
    `sync.sharded.ShardedPublisher`, meets the others at a barrier, and process 0 writes the
    version's manifest. It has `pipeline.local.WeightChannel`'s interface (`latest`, `publish`,
    `weights_of`, `model_info`), so `pipeline.learner_loop.LearnerLoop` drives either.
  * `ShardedFollower` is the sampler side: a `sync.sharded.ShardedSubscriber` that assembles
    every version's whole tensors for the engine, with `sync.subscriber.Subscriber`'s interface
    as `pipeline.processes.run_sampler` uses it (`weights`, `version`, `apply_fn`, `run`,
    `health_problem`), so a sampler serves a sharded store as it serves a plain one and its
    `/health` says when weight sync is failing or falling behind.
  * `published(source)` says which kind of store a work directory holds and its newest version.

Why: with several learner processes no process holds the whole model; gathering it in one
process to publish it would cost that process the model's memory and serialise every publish
behind one host's bandwidth. Sharded publishing keeps each process to its share
(sync/sharded.py's docstring); the samplers reassemble it. One learner process keeps the plain
channel: its blocks are the whole model anyway, and every existing sampler follows it.

A store holds one kind or the other: a learner that finds the other kind there (the work
directory of a learner with a different number of processes) refuses to start (`check_kind`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from sync import manifest as manifest_lib
from sync import publisher as publisher_lib
from sync import sharded as sharded_lib
from sync import store as store_lib
from sync import subscriber as subscriber_lib

log = logging.getLogger(__name__)


def published(source) -> tuple[Optional[int], bool]:
  """(newest published version or None, whether the store is sharded) of a weight store.

  `source`: a `sync.store.Store` or anything with `.get(key)` (a relay's HttpSource). A store
  with nothing published yet is (None, False).
  """
  plain = publisher_lib.read_index(source).latest
  if plain is not None:
    return plain, False
  sharded = sharded_lib.read_index(source).latest
  return sharded, sharded is not None


def manifest_info(source, version: int, sharded: bool) -> dict:
  """The `info` the learner published with `version` (model config, tokenizer, ...)."""
  if sharded:
    return dict(sharded_lib.read_manifest(source, version).info)
  return dict(publisher_lib.read_manifest(source, version).info)


def check_kind(store, sharded: bool) -> None:
  """Raises ValueError when `store` already holds versions of the other kind than a learner
  that publishes `sharded` ones would add."""
  version, is_sharded = published(store)
  if version is not None and is_sharded != sharded:
    have, want = ("sharded", "unsharded") if is_sharded else ("unsharded", "sharded")
    raise ValueError(
        f"the weight store {getattr(store, 'url', store)} holds {have} versions (up to "
        f"{version}) but this learner publishes {want} ones (a learner of "
        f"{'several processes' if sharded else 'one process'}); samplers follow one kind: "
        "restart with the process count that wrote it, or use a new work directory")


class ShardedWeightChannel:
  """Learner -> samplers for a learner of several processes (see module docstring).

  Args:
    url: the weight store's URL (every process names the same one).
    part, parts: this process's index and the number of learner processes.
    barrier: returns once every learner process reached it (a cross-process barrier such as
      jax.experimental.multihost_utils.sync_global_devices); `publish` calls it once per version.
    model_cfg: the model's config, published with every version (samplers build their engine
      from it).
    snapshot_every: each shard stream's snapshot period (sync.publisher.Publisher).
    answer_requests_s: how often a background thread answers samplers' snapshot requests on
      this process's shard streams (a sampler stuck behind a damaged delta asks; the learner may
      be idle, waiting for that sampler's data). None: never.
  """

  def __init__(self, url: str, *, part: int, parts: int, barrier: Callable[[], None],
               model_cfg=None, snapshot_every: int = 20,
               answer_requests_s: Optional[float] = 1.0):
    from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top
    self.store = store_lib.Store(url)
    check_kind(self.store, sharded=True)
    self.model_info = {} if model_cfg is None else {
        "model_config": moe_checkpoint.config_to_json(model_cfg)}
    self.publisher = sharded_lib.ShardedPublisher(self.store, part=part, parts=parts,
                                                  barrier=barrier, snapshot_every=snapshot_every)
    self.reports = []
    # publish and answer_requests share the publisher's stream table; one at a time.
    self._lock = threading.Lock()
    self._closed = threading.Event()
    if answer_requests_s is not None:
      threading.Thread(target=self._answer_loop, args=(answer_requests_s,), daemon=True,
                       name="sharded-publisher-requests").start()

  @staticmethod
  def weights_of(learner):
    """What `publish` takes: the blocks this process holds and the policy version."""
    return learner.sampler_shards()

  def latest(self) -> Optional[int]:
    return self.publisher.version

  def publish(self, blocks, version: int) -> sharded_lib.ShardedReport:
    """Publishes this process's `blocks` as `version`; every process must call it with the
    same version (the barrier inside waits for all of them).

    Raises:
      RuntimeError: `version` does not follow the published one.
    """
    expect = 0 if self.publisher.version is None else self.publisher.version + 1
    if version != expect:
      raise RuntimeError(f"learner version {version} does not follow the published "
                         f"{self.publisher.version}")
    with self._lock:
      report = self.publisher.publish(blocks, {"learner_version": int(version),
                                               **self.model_info})
    self.reports.append(report)
    return report

  def _answer_loop(self, interval_s: float) -> None:
    while not self._closed.wait(interval_s):
      try:
        with self._lock:
          made = self.publisher.answer_requests()
        for name, box, v in made:
          log.warning("weight sync: wrote a snapshot of shard %s %s at version %d on a "
                      "sampler's request", name, list(box), v)
      except Exception as e:  # pylint: disable=broad-except -- retried on the next round
        log.warning("weight sync: answering snapshot requests failed: %s", e)

  def close(self) -> None:
    self._closed.set()


class ShardedFollower:
  """Keeps a sampler at the newest sharded version, whole tensors assembled (see module
  docstring), with `sync.subscriber.Subscriber`'s health reporting.

  Args:
    source: the weight store (`sync.store.Store`) or a relay's `sync.transport.HttpSource`.
    apply_fn: apply_fn(flat weights, version), e.g. pipeline.local.swap_into(engine); None
      keeps the weights in `.weights` instead (a sampler's start, before its engine exists).
    name: this follower in logs and snapshot requests.
  """

  def __init__(self, source, apply_fn=None, *, name: Optional[str] = None):
    self.source = source
    self.apply_fn = apply_fn
    self.name = name or f"sharded-follower-{id(self):x}"
    self.sub = sharded_lib.ShardedSubscriber(source, self._apply, name=self.name)
    self.weights = None  # the newest version's weights while no apply_fn takes them
    self.published = None  # the newest version the sharded index named at the last read
    self.errors = 0
    self.last_error = None
    self.thread_state = "not started"  # "running", "stopped" or "died: ..." (see `run`)
    self._seen_at = {}  # version -> monotonic time it was first seen published
    self._index_ok_at = time.monotonic()
    self._index_error = None

  @property
  def version(self) -> Optional[int]:
    """The version whose weights were last handed over (None before the first)."""
    return self.sub.version

  @property
  def reports(self) -> list:
    return self.sub.reports

  def _apply(self, weights: dict, version: int) -> None:
    if self.apply_fn is None:
      self.weights = weights
    else:
      self.weights = None
      self.apply_fn(weights, version)

  def _read_index(self) -> manifest_lib.Index:
    try:
      index = sharded_lib.read_index(self.source)
    except Exception as e:
      self._index_error = f"{type(e).__name__}: {e}"
      raise
    now = time.monotonic()
    self._index_ok_at, self._index_error = now, None
    if index.latest is not None:
      served = -1 if self.version is None else self.version
      first = max(self.published if self.published is not None else -1, served) + 1
      for v in range(first, index.latest + 1):
        self._seen_at.setdefault(v, now)
      self.published = index.latest
    return index

  def poll(self) -> Optional[sharded_lib.ShardedUpdate]:
    """Moves to the newest sharded version (all shards, then `apply_fn`); None if there.

    Raises what `sync.sharded.ShardedSubscriber.poll` raises (SyncError: nothing handed over).
    """
    self._read_index()
    return self.sub.poll()

  def health_problem(self, max_behind_versions: int = 2,
                     max_stale_s: float = 60.0) -> Optional[str]:
    """None if weight sync is fine, else a sentence saying what is wrong (for `/health`): the
    sync thread died; index reads have failed for over `max_stale_s`; or the served version has
    been more than `max_behind_versions` behind the published one for over `max_stale_s`
    (counted from when the first version past that bound was seen published)."""
    if self.thread_state.startswith("died"):
      return f"weight sync {self.name}: the sync thread {self.thread_state}"
    if self.thread_state == "stopped":
      return None
    now = time.monotonic()
    if self._index_error is not None and now - self._index_ok_at > max_stale_s:
      return (f"weight sync {self.name}: no sharded index read succeeded for "
              f"{now - self._index_ok_at:.0f} s ({self._index_error})")
    if self.published is None:
      return None
    served = -1 if self.version is None else self.version
    first = self._seen_at.get(served + max_behind_versions + 1)
    if self.published - served > max_behind_versions and first is not None and \
        now - first > max_stale_s:
      why = f" (last error: {self.last_error})" if self.last_error else ""
      return (f"weight sync {self.name}: serving sharded version {self.version}, "
              f"{self.published - served} behind the published {self.published} for "
              f"{now - first:.0f} s (bound: {max_behind_versions} versions, {max_stale_s:g} s)"
              f"{why}")
    return None

  def run(self, stop: threading.Event, interval_s: float = 1.0,
          max_backoff_s: float = 2.0) -> None:
    """Polls until `stop` is set; a failed poll is counted, logged once per distinct error and
    retried after a back-off doubling from `interval_s` to `max_backoff_s`. If the loop itself
    ends on an exception, `thread_state` says so and `health_problem` reports it."""
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
                        "back-off", self.name, self.last_error, self.version,
                        exc_info=not isinstance(e, subscriber_lib.SyncError))
            logged = self.last_error
          stop.wait(min(interval_s * 2 ** min(failures, 20), max(max_backoff_s, interval_s)))
          continue
        if failures:
          log.warning("weight sync %s: polling works again after %d failed polls (at version "
                      "%s)", self.name, failures, self.version)
          failures, logged, self.last_error = 0, None, None
        stop.wait(interval_s)
      self.thread_state = "stopped"
    except BaseException as e:
      self.thread_state = f"died: {type(e).__name__}: {e}"
      log.critical("weight sync %s: the sync thread died: %s", self.name, e, exc_info=True)
      raise
