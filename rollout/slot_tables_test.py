"""rollout.slot_tables: staging refuses values its tables cannot hold instead of wrapping or
rounding them, maps settings to what the device reads, and lays out a prefill call's arrays."""

import sys

import numpy as np
import pytest

from rollout import slot_tables
from rollout.engine_types import RequestHandle
from rollout.sampling import SamplingParams


def _req(prompt=(5, 6, 7), stop_ids=(), **params):
  return RequestHandle(list(prompt), SamplingParams(**{"seed": 0, **params}), stop_ids, None)


def _stage(h, length=16):
  return slot_tables.stage(h, vocab_size=100, max_stop_ids=3, length=length)


def test_fit_refuses_what_the_dtype_cannot_hold():
  assert slot_tables.fit(2**31 - 1, np.int32, "x") == 2**31 - 1
  for value, dtype in ((2**31, np.int32), (-1, np.uint32), (2**32, np.uint32), (True, np.int32),
                       (1.0, np.int32), (1e39, np.float32), (1e-46, np.float32),
                       (float("nan"), np.float32)):
    with pytest.raises(ValueError, match="does not fit"):
      slot_tables.fit(value, dtype, "x")
  assert slot_tables.fit(0.0, np.float32, "x") == 0


def test_stage_converts_a_request_and_refuses_one_built_around_the_checks():
  v = _stage(_req(stop_ids=(2, 9), top_k=500, seed=2**40 + 3, max_tokens=4, n=2))
  assert v["top_k"] == 0  # top_k >= the vocabulary keeps every token: no filter
  assert v["seed"] == 3 and v["seed"].dtype == np.uint32  # the seed mod 2**32
  assert v["remaining"] == 3 and v["samples"] == [0, 1]
  np.testing.assert_array_equal(v["stop"], [2, 9, -1])
  assert v["prompt"].dtype == np.int32 and v["prompt"].tolist() == [5, 6, 7]
  h = _req()
  object.__setattr__(h.params, "top_k", 2**31)  # past SamplingParams' own check
  with pytest.raises(ValueError, match="top_k"):
    _stage(h)
  with pytest.raises(ValueError, match="vocabulary"):
    _stage(_req(prompt=(5, 100)))
  with pytest.raises(ValueError, match="stop ids"):
    _stage(_req(stop_ids=(1, 2, 3, 4)))
  with pytest.raises(ValueError, match="prefill length"):
    _stage(_req(prompt=range(1, 20)))


def test_prefill_arrays_lay_out_rows_and_slots():
  a, b = _req(prompt=(1, 2), n=2, temperature=0.5, seed=7), _req(prompt=(3,), top_p=0.5)
  staged = [(a, [4, 1], _stage(a)), (b, [0], _stage(b))]
  out = slot_tables.prefill_arrays(staged, rows=4, length=16, slots=6)
  assert out["tokens"].shape == (4, 16) and out["tokens"][:2, :2].tolist() == [[1, 2], [3, 0]]
  assert out["lengths"].tolist() == [2, 1, 1, 1]
  assert out["dst"].tolist() == [4, 1, 0, 6, 6, 6]  # 6 = dropped padding
  assert out["src"][:3].tolist() == [0, 0, 1] and out["sample"][:3].tolist() == [0, 1, 0]
  assert out["temp"][:3].tolist() == [0.5, 0.5, 1.0] and out["top_p"][2] == 0.5
  assert out["seed"][:2].tolist() == [7, 7]
  tables = slot_tables.new_tables(6, 3)
  assert {k: v.dtype for k, v in tables.items()} == {k: np.dtype(d) for k, d in
                                                     slot_tables.DTYPES.items()}
  assert tables["stop"].shape == (6, 3) and (tables["stop"] == -1).all()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
