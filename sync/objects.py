"""Reading a published store: its index, manifests, verified objects and snapshots, and the
snapshot requests subscribers leave for the publisher.

What: `read_index` (with retry of a torn read), `read_manifest`, `fetch_verified` (size and
xxh3 checked against the manifest's reference), `load_snapshot` (digest checked) and
`request_snapshot`. `publisher` re-exports them under the names callers have always used.

Why its own module: both sides need them, and the publisher rebuilds weights through the
subscriber's chain walker (`subscriber.Subscriber.restore`) rather than a second one, so they
cannot live in `publisher` (the subscriber would import the publisher that imports it).
"""

import json
import time

from sync import delta
from sync import manifest as manifest_lib
from sync import snapshot
from sync import weights


def read_index(source, *, attempts: int = 5, backoff_s: float = 0.02) -> manifest_lib.Index:
  """The store's index (empty if nothing was published yet).

  A parse failure (an index torn by a non-atomic writer or copy) is read again up to `attempts`
  times, waiting `backoff_s`, then twice that, ...; a tear that outlasts them raises.

  Raises:
    manifest.ManifestError: the index stayed malformed for every attempt.
  """
  for attempt in range(attempts):
    try:
      data = source.get(manifest_lib.INDEX_KEY)
    except KeyError:
      return manifest_lib.Index()
    try:
      return manifest_lib.Index.from_bytes(data)
    except manifest_lib.ManifestError:
      if attempt + 1 >= attempts:
        raise
      time.sleep(backoff_s * 2 ** attempt)
  raise AssertionError("unreachable")


def request_snapshot(store, requester: str, past: int, reason: str) -> None:
  """Asks the publisher of `store` for a snapshot at a version >= `past` (see `publisher`);
  one request per requester, replaced by its next one."""
  store.put(manifest_lib.snapshot_request_key(requester), json.dumps(
      {"past": int(past), "reason": reason, "time": time.time()}).encode())


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
