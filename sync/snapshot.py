"""Full snapshots of flat weights as orbax checkpoints, and their file lists.

What: `save(store, version, flat)` writes an orbax PyTree checkpoint of the flat weights under
the version's directory and returns the list of files it wrote (key, size, xxh3), which the
manifest records; `restore_dir(path, names)` reads one back as numpy arrays.

Why orbax: full snapshots double as ordinary checkpoints that orbax tooling can open, and orbax
stores through TensorStore, so `gs://`/`s3://` come for free. Orbax keys are sanitised tensor
indices (`t00000`, ...), not the '/'-joined names, which orbax would turn into nested
directories; the manifest keeps the name order. The file list lets relays and HTTP clients move
a snapshot as plain immutable objects, verified by hash, and restore it from a local copy.
"""

import os
import tempfile

import numpy as np
import orbax.checkpoint as ocp

from sync import manifest as manifest_lib
from sync import weights


def _key(i: int) -> str:
  return f"t{i:05d}"


def save(store, version: int, flat: dict) -> list:
  """Writes `flat` as an orbax checkpoint for `version`; returns its files as ObjectRefs."""
  names = sorted(flat)
  tree = {_key(i): np.asarray(flat[n]) for i, n in enumerate(names)}
  prefix = manifest_lib.snapshot_dir(version)
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
  """Restores a snapshot from fetched files {store key: bytes} via a local temp directory."""
  prefix = manifest_lib.snapshot_dir(version)
  with tempfile.TemporaryDirectory(prefix="sync-snap-") as tmp:
    for key, data in files.items():
      if not key.startswith(prefix) or ".." in key:
        raise ValueError(f"snapshot file {key!r} outside {prefix}")
      path = os.path.join(tmp, key[len(prefix):])
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(data)
    return restore_dir(os.path.join(tmp, "ckpt"), names)
