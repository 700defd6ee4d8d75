"""A byte store over TensorStore kvstores: local files by default, `gs://` or `s3://` by URL.

What: `Store(url)` puts, gets (whole or a byte range), lists and deletes immutable objects
under a root such as `file:///data/sync/`, `gs://bucket/run1/` or `s3://bucket/run1/`
(TensorStore kvstore URLs; `memory://` for tests). `Store.path_for(key)` gives the matching
path for tools that take paths (orbax writes full snapshots there).

Why TensorStore: it is what orbax already writes through, it speaks file/GCS/S3 with the same
calls, and its file driver writes each value atomically and durably (checked with strace:
write `<key>.__lock`, fsync it, rename it over `<key>`, fsync the directory), so a reader never
sees a torn `INDEX.json` or manifest through a `Store`; the publisher relies on that for
"manifest last" publishing (readers behind other copies still retry a torn index, see
`publisher.read_index`).
"""

import tensorstore as ts


class Store:
  """Objects (bytes) under a kvstore root URL."""

  def __init__(self, url: str):
    if "://" not in url:
      url = "file://" + url
    self.url = url if url.endswith("/") else url + "/"
    self._kv = ts.KvStore.open(self.url).result()

  def put(self, key: str, data: bytes) -> None:
    self._kv.write(key, data).result()

  def get(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
    """The object's bytes [start, stop); KeyError if missing."""
    rng = None if (start == 0 and stop is None) else slice(start, stop)
    r = self._kv.read(key, byte_range=rng).result()
    if r.state != "value":
      raise KeyError(key)
    return r.value

  def exists(self, key: str) -> bool:
    return self._kv.read(key, byte_range=slice(0, 0)).result().state == "value"

  def list(self, prefix: str = "") -> list[str]:
    rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else None
    keys = self._kv.list(rng).result() if rng else self._kv.list().result()
    return sorted(k.decode() for k in keys)

  def delete(self, key: str) -> None:
    self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()

  def delete_prefix(self, prefix: str) -> None:
    self._kv.delete_range(
        ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))).result()

  def path_for(self, key: str) -> str:
    """A path (local, or gs:// / s3:// URL) naming `key`, for path-based writers like orbax."""
    if self.url.startswith("file://"):
      return self.url[len("file://"):] + key
    if self.url.startswith(("gs://", "s3://")):
      return self.url + key
    raise ValueError(f"no path form for {self.url}")



def prefixed(store, prefix: str):
  """The objects of `store` under `prefix`, keys relative to it: one shard's stream of a sharded
  version (`sync.sharded`) is an ordinary store to the `Publisher` and `Subscriber` that follow
  it. A `PrefixedStore` over a store that writes, a read-only `PrefixedSource` over a source
  that only reads (`transport.HttpSource`): a subscriber tells them apart by `put`, as it does
  the store and source themselves."""
  return (PrefixedStore if hasattr(store, "put") else PrefixedSource)(store, prefix)


class PrefixedSource:
  """`.get` of a source's objects under a prefix (see `prefixed`)."""

  def __init__(self, source, prefix: str):
    if not prefix.endswith("/") or prefix.startswith("/") or ".." in prefix.split("/"):
      raise ValueError(f"bad store prefix {prefix!r} (relative, ending in '/')")
    self._store, self.prefix = source, prefix

  def get(self, key: str, *args, **kw) -> bytes:
    return self._store.get(self.prefix + key, *args, **kw)


class PrefixedStore(PrefixedSource):
  """A store's objects under a prefix, with every `Store` method (see `prefixed`)."""

  def put(self, key: str, data: bytes) -> None:
    self._store.put(self.prefix + key, data)

  def exists(self, key: str) -> bool:
    return self._store.exists(self.prefix + key)

  def list(self, prefix: str = "") -> list[str]:
    n = len(self.prefix)
    return [k[n:] for k in self._store.list(self.prefix + prefix)]

  def delete(self, key: str) -> None:
    self._store.delete(self.prefix + key)

  def delete_prefix(self, prefix: str) -> None:
    self._store.delete_prefix(self.prefix + prefix)

  def path_for(self, key: str) -> str:
    return self._store.path_for(self.prefix + key)
