"""Per-version manifests and the store index: what a version is and where its bytes lie.

What: `Manifest` describes one published version: its parent, the digest of its weights and of
its parent's (see `weights.digest`), its tensors, the delta object that turns the parent into it
and/or the files of its full snapshot, each with size and xxh3 hash. `Index` is the small
document the publisher rewrites last on every publish: the newest version and, per retained
version, how many bytes its delta and snapshot take (what a subscriber needs to plan).

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
