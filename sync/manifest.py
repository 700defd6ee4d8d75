"""Per-version manifests and the store index: what a version is and where its bytes lie.

What: `Manifest` describes one published version: its parent, the digest of its weights and of
its parent's (see `weights.digest`), its tensors, the delta object that turns the parent into it
and/or the files of its full snapshot, each with size and xxh3 hash. `Index` is the small
document the publisher rewrites last on every publish: the newest version and, per retained
version, how many bytes its delta and snapshot take (what a subscriber needs to plan).

Sharded versions (`sync.sharded`, one stream of versions per shard of a tensor, published by
the learner process that owns the shard) have a `ShardedManifest` listing every shard
(`ShardRef`: tensor, box, the stream's digest at that version) under their own index.

Why: manifests are written after the objects they name, so a reader that sees a manifest sees
complete data; the index is rewritten last, so "publish" is atomic (the index names a version
only after its manifest exists). A manifest changes only in one way: on a subscriber's request
(`snapshot_request_key`) the publisher may add a full snapshot to an already published version,
writing the snapshot's files first, then the manifest, then the index; nothing it already named
changes, so a reader holding the old manifest is still right.
"""

import dataclasses
import json

INDEX_KEY = "INDEX.json"


def version_dir(version: int) -> str:
  return f"v/{version:012d}/"


def manifest_key(version: int) -> str:
  return version_dir(version) + "manifest.json"


def delta_key(version: int) -> str:
  return version_dir(version) + "delta.bin"


def snapshot_dir(version: int) -> str:
  return version_dir(version) + "snapshot/"


SNAPSHOT_REQUESTS = "requests/snapshot/"


def snapshot_request_key(requester: str) -> str:
  """Where `requester` (a sampler's name) asks the publisher for a snapshot: it cannot reach the
  newest version because a link of the delta chain is damaged (see `publisher.request_snapshot`)."""
  if not requester or "/" in requester or requester.startswith("."):
    raise ValueError(f"bad requester name {requester!r}")
  return SNAPSHOT_REQUESTS + requester + ".json"


class ManifestError(ValueError):
  """A manifest or index is malformed."""


@dataclasses.dataclass(frozen=True)
class ObjectRef:
  """An immutable object in the store: key, byte size and xxh3-64 of its content."""
  key: str
  size: int
  xxh3: int

  def to_json(self):
    return [self.key, self.size, self.xxh3]

  @classmethod
  def from_json(cls, j):
    key, size, h = j
    if not (isinstance(key, str) and isinstance(size, int) and isinstance(h, int)) or size < 0:
      raise ManifestError(f"bad object ref {j!r}")
    return cls(key, size, h)


@dataclasses.dataclass
class Manifest:
  """One published version (see module docstring)."""
  version: int
  digest: str
  chunk_elems: int
  tensors: dict  # name -> [dtype name, shape list]
  parent: int | None = None
  parent_digest: str | None = None
  delta: ObjectRef | None = None
  snapshot: list | None = None  # list[ObjectRef], paths relative to the store root
  created: float = 0.0
  info: dict = dataclasses.field(default_factory=dict)  # stats: ratio, seconds, ...

  @property
  def delta_bytes(self) -> int | None:
    return None if self.delta is None else self.delta.size

  @property
  def snapshot_bytes(self) -> int | None:
    return None if self.snapshot is None else sum(r.size for r in self.snapshot)

  def to_bytes(self) -> bytes:
    d = dataclasses.asdict(self)
    d["delta"] = None if self.delta is None else self.delta.to_json()
    d["snapshot"] = None if self.snapshot is None else [r.to_json() for r in self.snapshot]
    return json.dumps(d, sort_keys=True).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> "Manifest":
    try:
      d = json.loads(data)
      d["delta"] = None if d["delta"] is None else ObjectRef.from_json(d["delta"])
      if d["snapshot"] is not None:
        d["snapshot"] = [ObjectRef.from_json(r) for r in d["snapshot"]]
      m = cls(**d)
    except (ValueError, KeyError, TypeError) as e:
      raise ManifestError(f"bad manifest: {e}") from e
    if m.delta is not None and (m.parent is None or m.parent_digest is None):
      raise ManifestError("a delta needs a parent version and digest")
    if m.delta is None and m.snapshot is None:
      raise ManifestError("a version needs a delta or a snapshot")
    return m


@dataclasses.dataclass
class Index:
  """The newest version and the byte sizes of every retained version's delta and snapshot."""
  latest: int | None = None
  versions: dict = dataclasses.field(default_factory=dict)  # v -> (delta_bytes, snapshot_bytes)

  def add(self, m: Manifest) -> None:
    self.versions[m.version] = (m.delta_bytes, m.snapshot_bytes)
    self.latest = m.version if self.latest is None else max(self.latest, m.version)

  def to_bytes(self) -> bytes:
    return json.dumps({"latest": self.latest,
                       "versions": [[v, d, s] for v, (d, s) in sorted(self.versions.items())]
                      }).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> "Index":
    try:
      d = json.loads(data)
      index = cls(d["latest"], {int(v): (dl, sn) for v, dl, sn in d["versions"]})
    except (ValueError, KeyError, TypeError) as e:
      raise ManifestError(f"bad index: {e}") from e
    if index.latest is not None and index.latest not in index.versions:
      raise ManifestError(f"bad index: latest version {index.latest!r} is not listed")
    return index


# -- Sharded versions (sync.sharded) --------------------------------------------------------------
# A sharded version is published by every learner process for the shards it owns: each shard
# (a block of a tensor, `box` = ((start, stop) per dimension)) is its own stream of versions
# under `shard_prefix(name, box)` (index, manifests, deltas, snapshots laid out as above), and the
# version's `ShardedManifest` lists every shard with its stream's digest at that version.
SHARDED_INDEX_KEY = "sharded/INDEX.json"


def sharded_manifest_key(version: int) -> str:
  return f"sharded/v/{version:012d}.json"


def shard_part_key(version: int, part: int) -> str:
  """Where learner process `part` lists the shards it published for `version` (read by part 0,
  which writes the version's manifest once every part has)."""
  return f"sharded/parts/{version:012d}/{part:05d}.json"


def shard_prefix(name: str, box) -> str:
  """The store prefix of the stream of shard `box` of tensor `name`."""
  token = "_".join(f"{a}-{b}" for a, b in box) or "scalar"
  return f"shards/{name}/{token}/"


def is_mutable(key: str) -> bool:
  """Whether a store key names an object that is rewritten in place (an index), as opposed to
  the immutable, versioned objects (relays cache those for good)."""
  return key in (INDEX_KEY, SHARDED_INDEX_KEY) or key.endswith("/" + INDEX_KEY)


def _box(j) -> tuple:
  try:
    box = tuple((int(a), int(b)) for a, b in j)
  except (TypeError, ValueError) as e:
    raise ManifestError(f"bad shard box {j!r}") from e
  return box


def box_shape(box) -> tuple:
  return tuple(b - a for a, b in box)


def cover_problem(tensors: dict, boxes: dict) -> str | None:
  """What is wrong with a set of shards as a cover of `tensors`, or None.

  Args:
    tensors: name -> [dtype, global shape].
    boxes: name -> list of boxes ((start, stop) per dimension).

  A cover is right when every tensor's boxes lie inside its shape, do not overlap and together
  hold every element (their volumes sum to the tensor's), and every boxed name is a tensor.
  """
  extra = sorted(set(boxes) - set(tensors))
  if extra:
    return f"shards of {extra[0]!r}, which is not a tensor of the version"
  for name, (_, shape) in sorted(tensors.items()):
    bs = boxes.get(name, [])
    if not bs:
      return f"tensor {name!r} has no shard"
    for box in bs:
      if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape)):
        return f"shard {list(box)} of {name!r} lies outside its shape {list(shape)}"
    for i, x in enumerate(bs):
      for y in bs[i + 1:]:
        if all(max(a0, a1) < min(b0, b1) for (a0, b0), (a1, b1) in zip(x, y)):
          return f"shards {list(x)} and {list(y)} of {name!r} overlap"
    held = sum(_volume(b) for b in bs)
    want = _volume(tuple((0, d) for d in shape))
    if held != want:
      return f"the shards of {name!r} hold {held} of its {want} elements"
  return None


def _volume(box) -> int:
  v = 1
  for a, b in box:
    v *= b - a
  return v


@dataclasses.dataclass(frozen=True)
class ShardRef:
  """One shard of a sharded version: tensor `name`'s block `box`, whose stream (under `prefix`)
  holds the version with `digest` (`weights.digest` of {name: block}); the bytes of its delta
  (None: none) and snapshot (None: none) at that version."""
  name: str
  box: tuple
  digest: str
  delta_bytes: int | None = None
  snapshot_bytes: int | None = None

  @property
  def prefix(self) -> str:
    return shard_prefix(self.name, self.box)

  @property
  def shape(self) -> tuple:
    return box_shape(self.box)

  def to_json(self):
    return [self.name, [list(b) for b in self.box], self.digest, self.delta_bytes,
            self.snapshot_bytes]

  @classmethod
  def from_json(cls, j):
    try:
      name, box, digest, d, s = j
    except (TypeError, ValueError) as e:
      raise ManifestError(f"bad shard ref {j!r}") from e
    if not (isinstance(name, str) and isinstance(digest, str)) or not all(
        x is None or (isinstance(x, int) and x >= 0) for x in (d, s)):
      raise ManifestError(f"bad shard ref {j!r}")
    return cls(name, _box(box), digest, d, s)


@dataclasses.dataclass
class ShardedManifest:
  """A sharded version: its tensors (global dtype and shape) and every shard of them."""
  version: int
  digest: str
  chunk_elems: int
  tensors: dict  # name -> [dtype name, global shape list]
  shards: list  # ShardRef, sorted by (name, box)
  created: float = 0.0
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def delta_bytes(self) -> int | None:
    """Bytes of the version's deltas (None if any shard has none: then it is whole)."""
    sizes = [r.delta_bytes for r in self.shards]
    return None if any(s is None for s in sizes) else sum(sizes)

  @property
  def snapshot_bytes(self) -> int | None:
    """Bytes of the version's snapshots (None unless every shard has one)."""
    sizes = [r.snapshot_bytes for r in self.shards]
    return None if any(s is None for s in sizes) else sum(sizes)

  def to_bytes(self) -> bytes:
    d = dataclasses.asdict(self)
    d["shards"] = [r.to_json() for r in self.shards]
    return json.dumps(d, sort_keys=True).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> "ShardedManifest":
    try:
      d = json.loads(data)
      d["shards"] = [ShardRef.from_json(r) for r in d["shards"]]
      m = cls(**d)
    except (ValueError, KeyError, TypeError) as e:
      raise ManifestError(f"bad sharded manifest: {e}") from e
    boxes = {}
    for r in m.shards:
      boxes.setdefault(r.name, []).append(r.box)
    problem = cover_problem(m.tensors, boxes)
    if problem:
      raise ManifestError(f"sharded manifest {m.version}: {problem}")
    return m
