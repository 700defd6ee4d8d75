"""Sharded weight publishing: every learner process publishes the shards it owns, and samplers
follow the version shard by shard.

What: `ShardedPublisher(store, part=i, parts=n, barrier=...)`. `publish(shards)` takes the
blocks one learner process owns, `(name, box, global shape, block)` with `box` the block's
(start, stop) per dimension (`rl.learner.Learner.sampler_shards` yields them: one addressable
shard of one tensor at a time, each replicated block once), and publishes each block as the
next version of its own stream: `store.prefixed(store, manifest.shard_prefix(name, box))`,
followed by an ordinary `publisher.Publisher` (a delta on the block's previous version,
periodic snapshots, GC, answers to snapshot requests). The process then lists its shards for
the version (`manifest.shard_part_key`); once every process has (`barrier`), process 0 checks
that the listed shards cover every tensor exactly once (`manifest.cover_problem`) and writes the
version's `manifest.ShardedManifest` (every shard, with its stream's digest at the version),
then the sharded index: the publish point, as in `publisher`.

`ShardedSubscriber(source, apply_fn)` polls the sharded index and, for the newest version,
moves each shard's stream to it with its own `subscriber.Subscriber` (in place, one shard
after another: planning, verification and damaged-link handling are the subscriber's), checks
each shard's digest against the manifest's, and only then calls `apply_fn` with the weights:
whole tensors assembled from the blocks, or (`assemble=False`) the blocks themselves, for a
sampler host that serves only the shards it follows (`select`).

Why:
  * No process gathers a tensor. Each encodes the blocks it holds, a few at a time
    (`blocks_in_flight`), so its memory during a publish is its share of the model (the
    parents its deltas need, kept by the streams' publishers) plus those blocks, never the
    model: with n processes, 1/n of it.
  * A shard is an ordinary stream, so everything the single-stream path does (chain plans,
    snapshots for newcomers, damaged links planned around, snapshot requests, GC) holds per
    shard, tested once, and the sharded layer only adds the cover and the version's list.
  * The version's manifest is the one place that says which shard versions make version v. A
    stream may run ahead of it (a process published its shards of v+1 before process 0 wrote
    v's manifest); a subscriber moves each stream to v exactly (`Subscriber.poll(target=)`).

All or nothing: if a shard fails to move, `poll` raises `subscriber.SyncError` before
`apply_fn`; the shards already moved stay at the new version (their streams say so) and the next
poll carries on from there, so the sampler keeps serving its previous weights and is never
handed a mix.

Restarts: a publisher's streams resume from the store (`publisher.Publisher` does). A process
that dies between publishing its shards of v and v's manifest leaves streams one version ahead
of the sharded index; publishing v again with the same blocks reuses them (their digests match),
with other blocks raises RuntimeError (the learner's weights are not those of the published
shards).
"""

import concurrent.futures
import dataclasses
import json
import time

import numpy as np
import xxhash

from sync import delta
from sync import fetch_plan
from sync import manifest as manifest_lib
from sync import objects
from sync import publisher as publisher_lib
from sync import store as store_lib
from sync import subscriber as subscriber_lib
from sync import weights
from sync.delta import parallel



def read_index(source) -> manifest_lib.Index:
  """The sharded index (empty if no sharded version was published); byte sizes per version
  are the sums over its shards."""
  try:
    data = source.get(manifest_lib.SHARDED_INDEX_KEY)
  except KeyError:
    return manifest_lib.Index()
  return manifest_lib.Index.from_bytes(data)


def version_digest(tensors: dict, shards) -> str:
  """A sharded version's digest: xxh3-128 over its tensors and every shard's box and digest."""
  h = xxhash.xxh3_128()
  h.update(json.dumps(sorted(tensors.items()), separators=(",", ":")).encode())
  for r in sorted(shards, key=lambda r: (r.name, r.box)):
    h.update(json.dumps([r.name, [list(b) for b in r.box], r.digest]).encode())
  return h.hexdigest()


def read_manifest(source, version: int) -> manifest_lib.ShardedManifest:
  """A sharded version's manifest, its cover and digest checked (ManifestError otherwise)."""
  m = manifest_lib.ShardedManifest.from_bytes(
      source.get(manifest_lib.sharded_manifest_key(version)))
  if m.version != version or version_digest(m.tensors, m.shards) != m.digest:
    raise manifest_lib.ManifestError(f"sharded manifest {version} is damaged (its version or "
                                     "digest does not match its shards)")
  return m


def _box(box) -> tuple:
  return tuple((int(a), int(b)) for a, b in box)


def _slices(box) -> tuple:
  return tuple(slice(a, b) for a, b in box)


@dataclasses.dataclass
class ShardedReport:
  """What one process's `ShardedPublisher.publish` did."""
  version: int
  shards: int  # blocks this process published
  raw_bytes: int  # their bytes, in the published dtype
  delta_bytes: int | None  # their deltas' bytes (None if one of them has none: stored whole)
  largest_block: int  # bytes of the largest single block encoded
  snapshot: bool  # every block of this process got a snapshot
  total_s: float
  manifest: manifest_lib.ShardedManifest | None = None  # the version's (process 0 only)

  @property
  def ratio(self) -> float | None:
    return None if not self.delta_bytes else self.raw_bytes / self.delta_bytes


class ShardedPublisher:
  """Publishes one learner process's shards of every version (see module docstring)."""

  def __init__(self, store, *, part: int = 0, parts: int = 1, barrier=None,
               snapshot_every: int = 20, keep_snapshots: int = 2, keep_versions: int = 4,
               chunk_elems: int = weights.CHUNK_ELEMS, level: int = 1, workers=None,
               blocks_in_flight: int = 4):
    """Args:
      store: a `store.Store` every process writes to.
      part, parts: this process's index (jax.process_index()) and the number of processes.
      barrier: returns once every process reached it (multihost_utils.sync_global_devices
        with a name, say); needed with parts > 1.
      snapshot_every, keep_snapshots, chunk_elems, level, workers: each shard stream's
        `publisher.Publisher` settings.
      keep_versions: sharded manifests kept (a sampler reads the newest; older versions stay
        reachable through the streams as long as they retain them).
      blocks_in_flight: blocks published at once (each taken from `shards` only when a slot
        frees: this many blocks, and their encoders' buffers, are in memory at most).
    """
    if not 0 <= part < parts:
      raise ValueError(f"part {part} is not one of {parts} parts")
    if parts > 1 and barrier is None:
      raise ValueError("publishing from several processes needs a barrier")
    if keep_versions < 1 or blocks_in_flight < 1:
      raise ValueError("keep_versions and blocks_in_flight must be >= 1")
    self.blocks_in_flight = blocks_in_flight
    self.store, self.part, self.parts, self.barrier = store, part, parts, barrier
    self._settings = dict(snapshot_every=snapshot_every, keep_snapshots=keep_snapshots,
                          chunk_elems=chunk_elems, level=level, workers=workers)
    self.chunk_elems = chunk_elems
    self.keep_versions = keep_versions
    self.index = read_index(store)
    self.version = self.index.latest
    self._streams = {}  # (name, box) -> publisher.Publisher

  def _stream(self, name: str, box: tuple) -> publisher_lib.Publisher:
    pub = self._streams.get((name, box))
    if pub is None:
      pub = publisher_lib.Publisher(
          store_lib.prefixed(self.store, manifest_lib.shard_prefix(name, box)), **self._settings)
      self._streams[(name, box)] = pub
    return pub

  def answer_requests(self) -> list:
    """Answers the snapshot requests samplers left on this process's shard streams; returns
    the (name, box, version) of every snapshot written."""
    out = []
    for (name, box), pub in sorted(self._streams.items()):
      made = pub.answer_requests()
      if made is not None:
        out.append((name, box, made))
    return out

  def publish(self, shards, info: dict | None = None) -> ShardedReport:
    """Publishes this process's `shards` ((name, box, global shape, block) items, consumed one
    at a time) as its part of the next version; process 0 then writes the version's manifest.

    Raises:
      ValueError: a block does not fit its box, two blocks of a tensor disagree on its dtype
        or shape, a stream's layout changed (`publisher.Publisher.publish`), or (process 0)
        the processes' shards do not cover every tensor exactly once.
      RuntimeError: a stream is not at the previous version (see the module docstring on
        restarts), or a process did not list its shards.
    """
    t0 = time.perf_counter()
    version = 0 if self.version is None else self.version + 1
    refs, tensors = [], {}
    raw = largest = 0
    deltas = []
    snapshots = True

    def checked():
      for name, box, shape, block in shards:
        block = np.asarray(block)
        box, shape = _box(box), [int(d) for d in shape]
        if manifest_lib.box_shape(box) != block.shape:
          raise ValueError(f"block of {name!r} at {list(box)} has shape {block.shape}, not "
                           f"its box's {manifest_lib.box_shape(box)}")
        layout = [weights.dtype_name(block.dtype), shape]
        if tensors.setdefault(name, layout) != layout:
          raise ValueError(f"blocks of {name!r} disagree: {tensors[name]} and {layout}")
        yield name, box, block

    def one(item):
      name, box, block = item
      return self._publish_block(version, name, box, block), block.nbytes

    # A few blocks in flight (bounded memory): a block's publish is mostly waiting on the
    # store's durable writes (delta, manifest, index), which overlap.
    with concurrent.futures.ThreadPoolExecutor(self.blocks_in_flight) as pool:
      for ref, nbytes in parallel.ordered(pool, one, checked(), self.blocks_in_flight):
        refs.append(ref)
        raw += nbytes
        largest = max(largest, nbytes)
        deltas.append(ref.delta_bytes)
        snapshots = snapshots and ref.snapshot_bytes is not None
    self.store.put(manifest_lib.shard_part_key(version, self.part), json.dumps(
        {"tensors": tensors, "shards": [r.to_json() for r in refs]}).encode())
    if self.barrier is not None:
      self.barrier()
    m = self._write_manifest(version, info) if self.part == 0 else None
    self.version = version
    return ShardedReport(version, len(refs), raw,
                         None if any(d is None for d in deltas) else sum(deltas), largest,
                         bool(refs) and snapshots, time.perf_counter() - t0, m)

  def _publish_block(self, version, name, box, block) -> manifest_lib.ShardRef:
    pub = self._stream(name, box)
    want = None if version == 0 else version - 1
    if pub.version == version:  # published before a crash, the manifest not written
      m = objects.read_manifest(pub.store, version)
      if weights.digest({name: block}, self.chunk_elems) != m.digest:
        raise RuntimeError(f"shard stream {manifest_lib.shard_prefix(name, box)} already holds "
                           f"a different version {version}")
      return manifest_lib.ShardRef(name, box, m.digest, m.delta_bytes, m.snapshot_bytes)
    if pub.version != want:
      raise RuntimeError(f"shard stream {manifest_lib.shard_prefix(name, box)} is at version "
                         f"{pub.version}, not {want}: it does not belong to this sharded store "
                         f"at version {self.version}")
    r = pub.publish({name: block}, {"sharded_version": version})
    return manifest_lib.ShardRef(name, box, r.digest, r.delta_bytes,
                                 r.snapshot_bytes if r.snapshot else None)

  def _write_manifest(self, version: int, info) -> manifest_lib.ShardedManifest:
    tensors, refs = {}, []
    for p in range(self.parts):
      try:
        rec = json.loads(self.store.get(manifest_lib.shard_part_key(version, p)))
      except KeyError as e:
        raise RuntimeError(f"process {p} did not list its shards of version {version}") from e
      for name, layout in rec["tensors"].items():
        if tensors.setdefault(name, layout) != layout:
          raise ValueError(f"processes disagree on tensor {name!r}: {tensors[name]} and "
                           f"{layout}")
      refs.extend(manifest_lib.ShardRef.from_json(r) for r in rec["shards"])
    refs.sort(key=lambda r: (r.name, r.box))
    boxes = {}
    for r in refs:
      boxes.setdefault(r.name, []).append(r.box)
    problem = manifest_lib.cover_problem(tensors, boxes)
    if problem:
      raise ValueError(f"the shards published as version {version} do not make a model: "
                       f"{problem}")
    m = manifest_lib.ShardedManifest(version, version_digest(tensors, refs), self.chunk_elems,
                                     tensors, refs, time.time(), dict(info or {}))
    self.store.put(manifest_lib.sharded_manifest_key(version), m.to_bytes())
    self.index.add(m)
    dropped = sorted(self.index.versions)[:-self.keep_versions]
    for v in dropped:
      del self.index.versions[v]
    self.store.put(manifest_lib.SHARDED_INDEX_KEY, self.index.to_bytes())  # the publish point
    for v in dropped:
      self.store.delete(manifest_lib.sharded_manifest_key(v))
    self.store.delete_prefix(manifest_lib.shard_part_key(version, 0).rsplit("/", 1)[0] + "/")
    return m


@dataclasses.dataclass
class ShardedUpdate:
  """What one `ShardedSubscriber.poll` did."""
  version: int
  from_version: int | None
  shards: int  # shards followed (each moved to `version`, or already there)
  bytes_moved: int
  largest_block: int  # bytes of the largest block held
  fetch_s: float
  decode_s: float
  pause_s: float  # time inside apply_fn


class ShardedSubscriber:
  """Keeps a sampler's weights at the newest sharded version, shard by shard (see module
  docstring)."""

  def __init__(self, source, apply_fn, *, select=None, assemble: bool = True, workers=None,
               name: str | None = None, request_snapshot=True):
    """Args:
      source: a `store.Store`, `transport.HttpSource` or anything with `.get(key) -> bytes`.
      apply_fn: `apply_fn(weights, version)`, called with complete, verified weights: with
        `assemble`, name -> whole tensor (new arrays each version); without, (name, box) ->
        block, the very arrays the shards' subscribers hold and update in place on later polls
        (copy what you keep, and do not read them during a poll).
      select: `select(name, box) -> bool`, the shards to follow (default: all). With
        `assemble`, the selected shards must hold whole tensors.
      workers, name, request_snapshot: as `subscriber.Subscriber`'s, for every shard's.
    """
    self.source, self.apply_fn = source, apply_fn
    self.select, self.assemble, self.workers = select, assemble, workers
    self.name = name or f"sharded-{id(self):x}"
    self._request = request_snapshot
    self.warm_up_s = delta.warm_up()  # as a Subscriber does, before the first update
    self._subs = {}  # (name, box) -> subscriber.Subscriber
    self.version = self.digest = None
    self.reports = []

  def _sub(self, ref: manifest_lib.ShardRef) -> subscriber_lib.Subscriber:
    key = (ref.name, ref.box)
    sub = self._subs.get(key)
    if sub is None:
      tag = xxhash.xxh3_64_hexdigest(ref.prefix.encode())[:12]
      sub = subscriber_lib.Subscriber(store_lib.prefixed(self.source, ref.prefix),
                                      lambda flat, v: None, workers=self.workers, inplace=True,
                                      name=f"{self.name}-{tag}", request_snapshot=self._request)
      self._subs[key] = sub
    return sub

  def blocks(self) -> dict:
    """(name, box) -> the block held for every shard followed (at `version` after a poll)."""
    return {(n, b): s.weights[n] for (n, b), s in sorted(self._subs.items())
            if s.weights is not None}

  def poll(self) -> ShardedUpdate | None:
    """Moves every followed shard to the newest sharded version, then calls apply_fn; returns
    the update's report, or None if already there.

    Raises:
      subscriber.SyncError: a shard could not be moved, or it does not hold the version the
        manifest names; nothing was handed over (see the module docstring).
      ValueError: `select` leaves a tensor partly covered while assembling, or no shard.
      manifest.ManifestError: the index or the manifest is malformed or damaged.
    """
    index = read_index(self.source)
    if index.latest is None or index.latest == self.version:
      return None
    m = read_manifest(self.source, index.latest)
    refs = [r for r in m.shards if self.select is None or self.select(r.name, r.box)]
    if not refs:
      raise ValueError(f"select leaves no shard of version {m.version}")
    if self.assemble:
      held = {}
      for r in refs:
        held[r.name] = held.get(r.name, 0) + int(np.prod(r.shape, dtype=np.int64))
      partial = [n for n, k in held.items() if k != int(np.prod(m.tensors[n][1], dtype=np.int64))]
      if partial:
        raise ValueError(f"the selected shards hold only part of {partial[0]!r}: use "
                         "assemble=False to follow part of a tensor")
    moved = fetch_s = decode_s = 0.0
    for r in refs:  # shard by shard: one shard's delta (or snapshot) in memory at a time
      sub = self._sub(r)
      try:
        rep = (sub.restore(m.version) if sub.version is None else
               sub.poll(target=m.version))
      except (subscriber_lib.SyncError, fetch_plan.PlanError, ValueError, KeyError) as e:
        raise subscriber_lib.SyncError(f"shard {r.prefix} of version {m.version}: "
                                       f"{type(e).__name__}: {e}") from e
      if sub.version != m.version or sub.digest != r.digest:
        raise subscriber_lib.SyncError(f"shard {r.prefix} holds version {sub.version} "
                                       f"({sub.digest}), not the manifest's {m.version} "
                                       f"({r.digest})")
      if rep is not None:
        moved += rep.bytes_moved
        fetch_s += rep.fetch_s
        decode_s += rep.decode_s
    blocks = {(r.name, r.box): self._subs[(r.name, r.box)].weights[r.name] for r in refs}
    out = self._assembled(m, blocks) if self.assemble else blocks
    t = time.perf_counter()
    self.apply_fn(out, m.version)
    report = ShardedUpdate(m.version, self.version, len(refs), int(moved),
                           max(b.nbytes for b in blocks.values()), fetch_s, decode_s,
                           time.perf_counter() - t)
    self.version, self.digest = m.version, m.digest
    self.reports.append(report)
    return report

  @staticmethod
  def _assembled(m: manifest_lib.ShardedManifest, blocks: dict) -> dict:
    out = {}
    for (name, box), block in blocks.items():
      if name not in out:
        dt, shape = m.tensors[name]
        out[name] = np.empty(shape, weights.dtype_from_name(dt))
      out[name][_slices(box)] = block
    return out
