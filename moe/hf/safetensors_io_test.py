"""The streaming shard writer and the header-first checkpoint reader."""

import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from moe.hf import CheckpointError
from moe.hf.safetensors_io import Checkpoint, ShardWriter
from moe.hf.save import parse_size


def _arrays():
  rng = np.random.RandomState(0)
  return {
      "b.weight": rng.randn(3, 5).astype(np.float32),
      "a.weight": rng.randn(7).astype(ml_dtypes.bfloat16),
      "c.weight": rng.randn(2, 2, 3).astype(np.float16),
  }


def test_writer_output_is_read_back_exactly(tmp_path):
  arrays = _arrays()
  path = str(tmp_path / "x.safetensors")
  with ShardWriter(path, [(n, a.dtype, a.shape) for n, a in arrays.items()]) as w:
    for n, a in arrays.items():
      w.write(n, a)
  with safe_open(path, "flax") as f:
    assert f.metadata() == {"format": "pt"}
    assert sorted(f.keys()) == sorted(arrays)
    for n, a in arrays.items():
      got = np.asarray(f.get_tensor(n))
      assert got.dtype == a.dtype and np.array_equal(got.view(np.uint8), a.view(np.uint8)), n
  with open(path, "rb") as f:  # tensor data starts 8-byte aligned
    assert int.from_bytes(f.read(8), "little") % 8 == 0


def test_writer_checks_order_shape_and_completeness(tmp_path):
  arrays = _arrays()
  specs = [(n, a.dtype, a.shape) for n, a in arrays.items()]
  path = str(tmp_path / "x.safetensors")
  with pytest.raises(CheckpointError, match="expected b.weight"):
    with ShardWriter(path, specs) as w:
      w.write("a.weight", arrays["a.weight"])
  assert not os.path.exists(path)
  with pytest.raises(CheckpointError, match="expected b.weight float32"):
    with ShardWriter(path, specs) as w:
      w.write("b.weight", arrays["b.weight"].T)
  with pytest.raises(CheckpointError, match="only 1 of 3"):
    with ShardWriter(path, specs) as w:
      w.write("b.weight", arrays["b.weight"])
  assert not os.path.exists(path)
  with pytest.raises(CheckpointError, match="unsupported dtype"):
    ShardWriter(path, [("i", np.int32, (2,))])


def test_reader_indexes_headers_and_reads_slices(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  save_file({"x": a}, str(tmp_path / "s1.safetensors"))
  save_file({"y": a[0]}, str(tmp_path / "s2.safetensors"))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}))
  with Checkpoint(tmp_path) as ck:
    assert ck.tensors["x"].shape == (2, 3, 4) and ck.tensors["x"].dtype == "F32"
    assert ck.tensors["y"].file.endswith("s2.safetensors")
    np.testing.assert_array_equal(ck.read("x", (1, slice(0, 2))), a[1, :2])
    np.testing.assert_array_equal(ck.read("y"), a[0])


def test_reader_refuses_inconsistent_index(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
  save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "s2.safetensors"))
  index = tmp_path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}))
  with pytest.raises(CheckpointError, match="tensor x also in"):
    Checkpoint(tmp_path)
  os.remove(tmp_path / "s2.safetensors")
  with pytest.raises(CheckpointError, match=r"s2.safetensors: missing \(listed in"):
    Checkpoint(tmp_path)
  index.write_text(json.dumps({"weight_map": {"x": "s1.safetensors", "z": "s1.safetensors"}}))
  with pytest.raises(CheckpointError, match="tensor z is listed in s1.safetensors"):
    Checkpoint(tmp_path)
  index.write_text(json.dumps({"weight_map": {"x": "../s1.safetensors"}}))
  with pytest.raises(CheckpointError, match="bad shard file name"):
    Checkpoint(tmp_path)
  index.write_text("{not json")
  with pytest.raises(CheckpointError, match="unreadable JSON"):
    Checkpoint(tmp_path)


def test_parse_size():
  assert parse_size(123) == 123
  assert parse_size("5GB") == 5 * 10**9
  assert parse_size("100KB") == 100_000
  assert parse_size("2GiB") == 2 * 2**30
  with pytest.raises(ValueError, match="bad size"):
    parse_size("lots")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
