"""Reading and writing safetensors checkpoints one tensor at a time.

Reading (`Checkpoint`): opens config.json and every shard (one `model.safetensors`, or the files
named by `model.safetensors.index.json`) with `safetensors.safe_open`, and indexes all headers
(names, shapes, dtypes) up front, so a loader can validate the whole checkpoint before reading a
byte of tensor data. Tensors (or slices of them, e.g. one expert of a fused tensor) are then read
on demand. safe_open's numpy backend cannot represent bfloat16, so data is read through its JAX
backend pinned to the host CPU device and handed out as numpy arrays (ml_dtypes.bfloat16).

Writing (`ShardWriter`): the header of a shard is computed from the tensors' shapes and dtypes
before any data exists, then each tensor's bytes are appended as it is produced. Exporting a model
therefore never holds more than one parameter (plus one tensor) in host memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from typing import Any, Optional, Sequence

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from moe.hf.errors import CheckpointError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype tag <-> numpy dtype, for the floating dtypes a model's weights may have.
ST_TO_NP = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
            "F16": np.dtype(np.float16)}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}


def np_dtype(name: str) -> np.dtype:
  """numpy dtype of "float32" / "bfloat16" / "float16"."""
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def read_json(path: str) -> Any:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: missing")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: unreadable JSON ({e})") from e


def _on_host():
  """A context placing new JAX arrays on the host CPU device (when JAX has that backend)."""
  try:
    return jax.default_device(jax.devices("cpu")[0])
  except RuntimeError:  # e.g. JAX_PLATFORMS=cuda: arrays go to the default device instead
    return contextlib.nullcontext()


class TensorInfo:
  """Where a tensor lives and what its header says."""
  __slots__ = ("file", "dtype", "shape")

  def __init__(self, file: str, dtype: str, shape: tuple):
    self.file, self.dtype, self.shape = file, dtype, shape


class Checkpoint(contextlib.AbstractContextManager):
  """A Hugging Face checkpoint directory opened for streaming reads.

  Attributes:
    path: the directory.
    config: the parsed config.json.
    tensors: {tensor name: TensorInfo} over all shards, from the headers alone.
  """

  def __init__(self, path: str):
    self.path = os.fspath(path)
    if not os.path.isdir(self.path):
      raise CheckpointError(f"{self.path}: not a checkpoint directory")
    self.config = read_json(os.path.join(self.path, CONFIG))
    if not isinstance(self.config, dict):
      raise CheckpointError(f"{os.path.join(self.path, CONFIG)}: not a JSON object")
    self._stack = contextlib.ExitStack()
    self._handles = {}
    self.tensors: dict[str, TensorInfo] = {}
    try:
      self._open()
    except BaseException:
      self._stack.close()
      raise

  def _files(self) -> tuple[list[str], Optional[dict]]:
    index_path = os.path.join(self.path, INDEX)
    if os.path.exists(index_path):
      index = read_json(index_path)
      wm = index.get("weight_map") if isinstance(index, dict) else None
      if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index_path}: no weight_map")
      files = sorted(set(wm.values()))
      for f in files:
        if not isinstance(f, str) or os.path.basename(f) != f:
          raise CheckpointError(f"{index_path}: bad shard file name {f!r}")
        if not os.path.isfile(os.path.join(self.path, f)):
          raise CheckpointError(f"{os.path.join(self.path, f)}: missing (listed in {INDEX})")
      return files, wm
    if os.path.isfile(os.path.join(self.path, SINGLE)):
      return [SINGLE], None
    raise CheckpointError(f"{self.path}: neither {SINGLE} nor {INDEX}")

  def _open(self):
    files, weight_map = self._files()
    for f in files:
      full = os.path.join(self.path, f)
      try:
        h = self._stack.enter_context(safe_open(full, framework="flax"))
        for name in h.keys():
          sl = h.get_slice(name)
          info = TensorInfo(full, sl.get_dtype(), tuple(int(s) for s in sl.get_shape()))
          if name in self.tensors:
            raise CheckpointError(f"{full}: tensor {name} also in {self.tensors[name].file}")
          self.tensors[name] = info
      except CheckpointError:
        raise
      except Exception as e:  # safetensors raises SafetensorError, OSError, ...
        raise CheckpointError(f"{full}: unreadable safetensors file ({type(e).__name__}: "
                              f"{e})") from e
      self._handles[full] = h
    if weight_map is not None:
      for name, f in weight_map.items():
        full = os.path.join(self.path, f)
        if name not in self.tensors or self.tensors[name].file != full:
          raise CheckpointError(f"{os.path.join(self.path, INDEX)}: tensor {name} is listed in "
                                f"{f} but {full} does not hold it")

  def read(self, name: str, index: Optional[tuple] = None) -> np.ndarray:
    """Tensor `name` (or `tensor[index]`, read without loading the rest) as a numpy array."""
    info = self.tensors[name]
    h = self._handles[info.file]
    try:
      with _on_host():
        x = h.get_tensor(name) if index is None else h.get_slice(name)[index]
      return np.asarray(x)
    except Exception as e:
      raise CheckpointError(f"{info.file}: cannot read tensor {name} ({e})") from e

  def __exit__(self, *exc):
    self._stack.close()
    return None


class ShardWriter(contextlib.AbstractContextManager):
  """Writes one safetensors file whose tensors are announced up front and streamed in order.

  Usage:
    with ShardWriter(path, [(name, np_dtype, shape), ...]) as w:
      for name, array in produced_in_that_order:
        w.write(name, array)

  The header is written on entry; `write` checks each tensor against it. Leaving the block
  before every tensor was written (or on an exception) deletes the partial file.
  """

  def __init__(self, path: str, specs: Sequence[tuple[str, np.dtype, tuple]],
               metadata: Optional[dict] = None):
    if sys.byteorder != "little":
      raise NotImplementedError("safetensors data is little-endian; big-endian hosts unsupported")
    self.path = path
    self._specs = [(n, np.dtype(d), tuple(int(s) for s in shape)) for n, d, shape in specs]
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for name, dt, shape in self._specs:
      if dt not in NP_TO_ST:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dt}")
      n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
      header[name] = {"dtype": NP_TO_ST[dt], "shape": list(shape), "data_offsets": [off, off + n]}
      off += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    self._f = open(path, "wb")
    self._f.write(struct.pack("<Q", len(raw)))
    self._f.write(raw)
    self._next = 0
    self.nbytes = off

  def write(self, name: str, array: np.ndarray) -> None:
    if self._next >= len(self._specs):
      raise CheckpointError(f"{self.path}: unexpected extra tensor {name}")
    want_name, dt, shape = self._specs[self._next]
    if name != want_name or array.dtype != dt or tuple(array.shape) != shape:
      raise CheckpointError(f"{self.path}: got tensor {name} {array.dtype}{list(array.shape)}, "
                            f"expected {want_name} {dt}{list(shape)}")
    self._f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    self._next += 1

  def __exit__(self, exc_type, *rest):
    self._f.close()
    if exc_type is None and self._next != len(self._specs):
      os.remove(self.path)
      raise CheckpointError(f"{self.path}: only {self._next} of {len(self._specs)} tensors "
                            "were written")
    if exc_type is not None:
      os.remove(self.path)
    return None
