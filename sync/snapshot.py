"""Full snapshots of flat weights as orbax checkpoints, and their file lists.

What: `save(store, version, flat)` writes an orbax PyTree checkpoint of the flat weights under
the version's directory and returns the list of files it wrote (key, size, xxh3), which the
manifest records; `restore_dir(path, names)` reads one back as numpy arrays.

Why orbax: full snapshots double as ordinary checkpoints that orbax tooling can open, and orbax
stores through TensorStore, so `gs://`/`s3://` come for free. Orbax keys are sanitised tensor
indices (`t00000`, ...), not the '/'-joined names, which orbax would turn into nested
directories; the manifest keeps the name order. The file list lets relays and HTTP clients move
a snapshot as plain immutable objects, verified by hash, and restore it from a local copy.

In a multi-process JAX runtime (`jax.distributed`: a learner of several processes, each
publishing the shards it holds, sync/sharded.py) orbax cannot write a process's own snapshot:
it writes numpy arrays from process 0 only and refuses arrays held by one process ("host local
jax.Array in multi-host setting"), and its saves are collectives every process must join. There
`save` writes the raw form instead: one object per tensor (`raw/t00000.bin`, its bytes in C
order) and `raw/snapshot.json` (each tensor's dtype and shape), through the store like any
object; `restore_files` reads either form.
"""

import json
import os
import tempfile

import numpy as np
import orbax.checkpoint as ocp

from sync import manifest as manifest_lib
from sync import weights


def _key(i: int) -> str:
  return f"t{i:05d}"


RAW_DIR = "raw/"
RAW_INDEX = RAW_DIR + "snapshot.json"


def _multi_process() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count() > 1


def save(store, version: int, flat: dict, raw: bool | None = None) -> list:
  """Writes `flat` as a snapshot for `version`; returns its files as ObjectRefs.

  `raw`: write the raw form (module docstring); None: where orbax cannot, in a multi-process
  JAX runtime, else an orbax checkpoint.
  """
  names = sorted(flat)
  tree = {_key(i): np.asarray(flat[n]) for i, n in enumerate(names)}
  prefix = manifest_lib.snapshot_dir(version)
  if raw is None:
    raw = _multi_process()
  if raw:
    for key, a in tree.items():
      store.put(prefix + RAW_DIR + key + ".bin", np.ascontiguousarray(a).tobytes())
    store.put(prefix + RAW_INDEX, json.dumps(
        {k: [weights.dtype_name(a.dtype), list(a.shape)] for k, a in tree.items()}).encode())
  else:
    ocp.PyTreeCheckpointer().save(store.path_for(prefix + "ckpt"), tree, force=True)
  refs = []
  for key in store.list(prefix):
    data = store.get(key)
    refs.append(manifest_lib.ObjectRef(key, len(data), weights.xxh(data)))
  return refs


def restore_dir(path: str, names: list) -> dict:
  """Reads a snapshot written by `save` from a local or remote path; `names` sorted."""
  tree = ocp.PyTreeCheckpointer().restore(path)
  return {n: np.asarray(tree[_key(i)]) for i, n in enumerate(sorted(names))}


def restore_files(files: dict, version: int, names: list) -> dict:
  """Restores a snapshot from fetched files {store key: bytes}: the raw form directly, an
  orbax checkpoint via a local temp directory."""
  prefix = manifest_lib.snapshot_dir(version)
  if prefix + RAW_INDEX in files:
    return _restore_raw(files, prefix, names)
  with tempfile.TemporaryDirectory(prefix="sync-snap-") as tmp:
    for key, data in files.items():
      if not key.startswith(prefix) or ".." in key:
        raise ValueError(f"snapshot file {key!r} outside {prefix}")
      path = os.path.join(tmp, key[len(prefix):])
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(data)
    return restore_dir(os.path.join(tmp, "ckpt"), names)


def _restore_raw(files: dict, prefix: str, names: list) -> dict:
  layout = json.loads(files[prefix + RAW_INDEX])
  names = sorted(names)
  if len(layout) != len(names):
    raise ValueError(f"raw snapshot {prefix} holds {len(layout)} tensors, expected {len(names)}")
  out = {}
  for i, n in enumerate(names):
    dt, shape = layout[_key(i)]
    data = files.get(prefix + RAW_DIR + _key(i) + ".bin")
    if data is None:
      raise ValueError(f"raw snapshot {prefix} lacks tensor {n!r} ({_key(i)}.bin)")
    out[n] = np.frombuffer(data, weights.dtype_from_name(dt)).reshape(shape).copy()
  return out
