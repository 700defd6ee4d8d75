"""rl/distributed.py without a cluster: the batch digest tells batches apart by every field's
values, dtype and shape (and not by dict order), the mismatch check names the odd processes, and
bad process arguments fail before JAX is touched. The real multi-process runs:
rl/multihost_smoke_test.py and tools/rl_part_multihost_test.py."""

import sys

import numpy as np
import pytest

from rl import distributed


def _batch():
  return {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
          "loss_mask": np.ones((3, 4), np.int32)}


def test_batch_digest_sees_values_dtype_shape_and_names():
  base = distributed.batch_digest(_batch())
  assert base.dtype == np.uint32 and base.shape == (8,)
  reordered = dict(reversed(list(_batch().items())))
  np.testing.assert_array_equal(distributed.batch_digest(reordered), base)
  changed = _batch()
  changed["tokens"][2, 3] += 1
  as_int64 = dict(_batch(), tokens=_batch()["tokens"].astype(np.int64))
  reshaped = dict(_batch(), tokens=_batch()["tokens"].reshape(4, 3))
  renamed = {"tokens": _batch()["tokens"], "mask": _batch()["loss_mask"]}
  for other in (changed, as_int64, reshaped, renamed):
    assert not np.array_equal(distributed.batch_digest(other), base)


def test_mismatched_processes_are_named():
  a, b = distributed.batch_digest(_batch()), distributed.batch_digest({"x": np.zeros(2)})
  assert distributed.mismatched_processes([a, a, a]) == []
  assert distributed.mismatched_processes([a, b, a, b]) == [1, 3]


def test_bad_process_arguments_fail_clearly():
  with pytest.raises(ValueError, match="process_id 2 is not one of 2 processes"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  with pytest.raises(ValueError, match="2 processes need a coordinator address host:port"):
    distributed.initialize("", 2, 1)
  with pytest.raises(ValueError, match="process_id 0 is not one of 0 processes"):
    distributed.initialize("127.0.0.1:1234", 0, 0)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
