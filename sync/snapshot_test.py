"""Snapshots in both forms (sync/snapshot.py): the orbax checkpoint, and the raw form a process of
a multi-process JAX runtime writes (orbax cannot write one process's own snapshot there; the real
multi-process publish is tools/rl_part_multihost_test.py). Each restores bit for bit (bfloat16
included) from the files the manifest lists, and a damaged raw snapshot fails clearly."""

import sys

import numpy as np
import pytest

from sync import manifest as manifest_lib
from sync import snapshot
from sync import store as store_lib
from sync import testing


def _files(st, refs):
  return {r.key: st.get(r.key) for r in refs}


@pytest.mark.parametrize("raw", [False, True], ids=["orbax", "raw"])
def test_a_snapshot_restores_bit_for_bit(tmp_path, raw):
  st = store_lib.Store("file://" + str(tmp_path))
  flat = testing.history(1)[0]
  flat["router/bias"] = np.linspace(-1, 1, 7, dtype=np.float32)
  refs = snapshot.save(st, 3, flat, raw=raw)
  keys = [r.key for r in refs]
  prefix = manifest_lib.snapshot_dir(3)
  assert all(k.startswith(prefix) for k in keys)
  assert (prefix + snapshot.RAW_INDEX in keys) == raw
  assert any(k.startswith(prefix + "ckpt") for k in keys) != raw
  back = snapshot.restore_files(_files(st, refs), 3, list(flat))
  assert testing.same_bits(back, flat)
  assert back["layers/0/w"].dtype == flat["layers/0/w"].dtype  # bfloat16 stays bfloat16


def test_the_default_form_is_orbax_in_one_process(tmp_path):
  st = store_lib.Store("file://" + str(tmp_path))
  refs = snapshot.save(st, 0, testing.history(1)[0])
  assert not any(r.key.endswith(snapshot.RAW_INDEX) for r in refs)


def test_a_raw_snapshot_missing_a_tensor_fails_clearly(tmp_path):
  st = store_lib.Store("file://" + str(tmp_path))
  flat = testing.history(1)[0]
  files = _files(st, snapshot.save(st, 1, flat, raw=True))
  del files[manifest_lib.snapshot_dir(1) + snapshot.RAW_DIR + "t00001.bin"]
  with pytest.raises(ValueError, match=r"lacks tensor 'layers/0/norm' \(t00001.bin\)"):
    snapshot.restore_files(files, 1, list(flat))
  with pytest.raises(ValueError, match="holds 4 tensors, expected 5"):
    snapshot.restore_files(_files(st, snapshot.save(st, 2, flat, raw=True)), 2,
                           list(flat) + ["extra"])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
