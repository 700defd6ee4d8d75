"""Importing a Hugging Face Mixtral / Qwen3-MoE checkpoint into the Flax model.

Order of work, so that bad input fails before anything is half-loaded and the model is never held
twice:
  1. config.json -> ModelConfig and architecture; every shard's header -> names, shapes, dtypes.
  2. Validate the whole checkpoint against the expected layout (every tensor present, nothing
     unexpected, shapes and dtypes right). Any problem raises `CheckpointError` naming the file
     and tensor; no tensor data has been read yet.
  3. Build the abstract model (`jax.eval_shape`: no allocation), then fill its parameters one at a
     time: a host buffer of the parameter's final shape is preallocated, each HF tensor (one per
     expert for stacked expert weights) is read and written into its slot, and the buffer goes to
     its device (sharded, with a mesh) before the next parameter is read.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from moe import build
from moe import sharding
from moe.hf import names
from moe.hf.config_map import architecture_of, config_from_hf, dtype_of
from moe.hf import special_tokens
from moe.hf.errors import CheckpointError
from moe.hf.safetensors_io import ST_TO_NP, Checkpoint, np_dtype
from moe.model import MoEDecoder

# Attributes a loaded model carries, read by save_pretrained: its architecture, and every id that
# ends generation (generation_config.json's list, else config.json's), so a re-export keeps both.
ARCH_ATTR = "hf_architecture"
EOS_ATTR = "hf_eos_token_ids"


def _flat_name(path) -> str:
  return "/".join(str(getattr(p, "key", p)) for p in path)


def validate(ckpt: Checkpoint, layout: names.Layout) -> None:
  """Checks every header against `layout`; raises CheckpointError for the first problem."""
  where = ckpt.path
  missing = sorted(n for n in layout.hf_shapes if n not in ckpt.tensors)
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise CheckpointError(f"{where}: tensor {missing[0]}{more} is missing from the checkpoint "
                          f"(expected for {os.path.join(where, 'config.json')})")
  for name in sorted(ckpt.tensors):
    info = ckpt.tensors[name]
    if name not in layout.hf_shapes:
      if layout.is_ignorable(name):
        continue
      raise CheckpointError(f"{info.file}: unexpected tensor {name} (not part of the model that "
                            "config.json describes)")
    if info.dtype not in ST_TO_NP:
      raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}; weights must "
                            f"be one of {sorted(ST_TO_NP)}")
    want = layout.hf_shapes[name]
    if info.shape != want:
      raise CheckpointError(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected "
                            f"{list(want)} from config.json")


def _config(ckpt: Checkpoint, dtype: Optional[str],
            config_overrides: Optional[Mapping[str, Any]]) -> tuple[str, ModelConfig]:
  """(architecture, ModelConfig) of an open checkpoint; see `load_config`."""
  where = os.path.join(ckpt.path, "config.json")
  arch = architecture_of(ckpt.config, where)
  cfg = config_from_hf(ckpt.config, where)
  if dtype is None:
    dtype = dtype_of(ckpt.config)
    emb = ckpt.tensors.get("model.embed_tokens.weight")
    if dtype is None and emb is not None and emb.dtype in ST_TO_NP:
      dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[emb.dtype]
  try:
    dt = dtype or "float32"
    return arch, cfg.replace(**{"param_dtype": dt, "dtype": dt, **dict(config_overrides or {})})
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: bad dtype or config override ({e})") from e


def load_config(path: str | os.PathLike, *, dtype: Optional[str] = None,
                config_overrides: Optional[Mapping[str, Any]] = None) -> ModelConfig:
  """The ModelConfig `load_pretrained(path, dtype=, config_overrides=)` gives its model, read
  from config.json and the shards' headers only (no tensor data): for checking a run's settings
  against a checkpoint before loading it.

  Raises:
    CheckpointError: as `load_pretrained`'s config step (unknown architecture or config,
      missing or unreadable files, a bad dtype or override).
  """
  with Checkpoint(path) as ckpt:
    return _config(ckpt, dtype, config_overrides)[1]


def load_pretrained(path: str | os.PathLike, *, dtype: Optional[str] = None,
                    mesh: Optional[Mesh] = None,
                    config_overrides: Optional[Mapping[str, Any]] = None) -> MoEDecoder:
  """Loads a Mixtral or Qwen3-MoE safetensors checkpoint as a `MoEDecoder`.

  Args:
    path: directory with config.json and model.safetensors or model.safetensors.index.json plus
      its shards.
    dtype: parameter and compute dtype ("float32", "bfloat16", "float16"). Default: the dtype
      config.json declares, else the embedding tensor's. Tensors stored in another float dtype are
      cast (exact when widening).
    mesh: if given, every parameter is placed sharded on it (logical-axis rules).
    config_overrides: ModelConfig fields to change that do not affect shapes (e.g. expert_impl,
      capacity_factor, max_seq_len, fp32_lm_head).

  Returns:
    The model; `model.hf_architecture` records the architecture and `model.hf_eos_token_ids`
    the checkpoint's EOS ids (`eos_token_ids`), both for `save_pretrained`.

  Raises:
    CheckpointError: unknown architecture or config, missing/unreadable/corrupt files, missing,
      unexpected or misshapen tensors, non-float dtypes, a malformed eos_token_id. Raised before
      any tensor data is read.
  """
  with Checkpoint(path) as ckpt:
    arch, cfg = _config(ckpt, dtype, config_overrides)
    eos = special_tokens.eos_token_ids(ckpt.path)
    layout = names.layout(cfg, arch, fused=names.is_fused(ckpt.tensors))
    validate(ckpt, layout)

    graphdef, state = nnx.split(build.abstract(cfg))
    shardings = sharding.state_shardings(state, mesh) if mesh is not None else None
    sh_flat = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    flat = list(nnx.to_flat_state(state))
    ours = {_flat_name(p) for p, _ in flat}
    if ours != set(layout.pieces):  # a bug in the name table, not in the checkpoint
      raise AssertionError(f"layout/model mismatch: {sorted(ours ^ set(layout.pieces))}")
    for path_, var in flat:
      name = _flat_name(path_)
      spec = var.get_value()
      buf = np.empty(spec.shape, np_dtype(str(np.dtype(spec.dtype))))
      for piece in layout.pieces[name]:
        x = ckpt.read(piece.hf_name, piece.src)
        if piece.linear:
          x = x.T
        dst = buf if piece.dst is None else buf[piece.dst]
        dst[...] = x.reshape(dst.shape)  # casts in place: no full-size temporary
        del x, dst  # not alive while the next piece or parameter is read
      target = sh_flat.get(path_)
      target = target.get_value() if isinstance(target, nnx.Variable) else target
      arr = jax.device_put(buf, target) if target is not None else jax.device_put(buf)
      # Wait for the transfer: an asynchronous copy keeps `buf` alive, and on a busy host several
      # would pile up, so host memory would no longer be bounded by one parameter at a time.
      var.set_value(arr.block_until_ready())
      del buf, arr
    model = nnx.merge(graphdef, state)
  setattr(model, ARCH_ATTR, arch)
  setattr(model, EOS_ATTR, eos)
  return model
