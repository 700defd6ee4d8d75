"""Exporting the Flax model as a Hugging Face checkpoint (config.json + safetensors + index).

The classic per-expert layout is written (see names.py), which transformers 5.24, older
transformers and other serving engines all read. Tensors are streamed: shard headers are computed
from parameter shapes up front, then each parameter is fetched to the host, split into its HF
tensors (one per expert for stacked expert weights) and appended to the current shard. At most one
parameter is on the host at a time.

Shards are named like transformers names them: one `model.safetensors` when everything fits in
`max_shard_size`, else `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
Stale files of those names from an earlier save into the same directory are removed first.

Given the model's tokenizer (`tokenizer=`), the export is a complete checkpoint: the tokenizer
files and generation_config.json are written too (see special_tokens.py), and config.json names
the BOS / EOS / pad ids.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from moe.hf import names
from moe.hf.config_map import config_to_hf
from moe.hf.errors import CheckpointError
from moe.hf import special_tokens
from moe.hf.load import ARCH_ATTR, EOS_ATTR, _flat_name
from moe.hf.safetensors_io import CONFIG, INDEX, SINGLE, ShardWriter, np_dtype

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
  """Bytes from an int or a string like "5GB" / "100KB" / "2GiB" (transformers' convention)."""
  if isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
  if not m or m.group(2) not in _UNITS:
    raise ValueError(f"bad size {size!r}; use bytes or e.g. '5GB', '500MB', '2GiB'")
  return int(float(m.group(1)) * _UNITS[m.group(2)])


def _hf_tensor(layout, piece, value: np.ndarray) -> np.ndarray:
  """Our parameter (or one expert of it) -> the HF tensor (inverse of load's transform)."""
  part = value if piece.dst is None else value[piece.dst]
  shape = layout.hf_shapes[piece.hf_name]
  if piece.linear:
    return np.ascontiguousarray(part.reshape(shape[::-1]).T)
  return np.ascontiguousarray(part.reshape(shape))


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *,
                    architecture: Optional[str] = None, max_shard_size="5GB",
                    dtype: Optional[str] = None, tokenizer=None,
                    eos_token_ids: Optional[Sequence[int]] = None) -> list[str]:
  """Writes `model` as a Hugging Face checkpoint directory.

  Args:
    model: a MoEDecoder (loaded by `load_pretrained`, or made by `build.create`).
    path: output directory (created if needed).
    architecture: "MixtralForCausalLM" or "Qwen3MoeForCausalLM"; defaults to the architecture
      the model was loaded from.
    max_shard_size: largest shard, bytes or a string like "5GB".
    dtype: cast weights to this dtype on the way out (default: each parameter's own dtype).
    tokenizer: the model's tokenizer (`moe.tokenizer.for_model(dir, vocab_size)`, a
      JsonTokenizer / BPETokenizer): written as tokenizer.json, tokenizer_config.json and
      chat_template.jinja, with generation_config.json. None: weights and config.json (and
      generation_config.json when EOS ids are known, see eos_token_ids).
    eos_token_ids: every id that ends generation (a chat model has several, e.g. `<|im_end|>`
      and `<|endoftext|>`); default the ones the model was loaded with (`load_pretrained`
      records its checkpoint's `eos_token_ids`, so a re-export keeps generation_config.json's
      list) unless `tokenizer`'s EOS is not among them (another vocabulary), else the
      tokenizer's EOS. Written to generation_config.json (a list when several) and config.json.

  Returns:
    The paths written (shards, index if any, config.json, then the tokenizer files and
    generation_config.json when a tokenizer or EOS ids are given).

  Raises:
    CheckpointError: no architecture known, the model's config cannot be expressed in it, an
      EOS id outside the vocabulary, or a tokenizer that cannot be exported (a ByteTokenizer:
      transformers has no tokenizer for the project's byte vocabulary; one with more ids than
      the model).
  """
  arch = architecture or getattr(model, ARCH_ATTR, None)
  if arch is None:
    raise CheckpointError("save_pretrained: the model was not loaded from a Hugging Face "
                          "checkpoint; pass architecture='MixtralForCausalLM' or "
                          "'Qwen3MoeForCausalLM'")
  cfg = model.config
  loaded_eos = tuple(getattr(model, EOS_ATTR, None) or ())
  if not eos_token_ids and loaded_eos and (tokenizer is None or tokenizer.eos_id in loaded_eos):
    eos_token_ids = loaded_eos
  if dtype is not None:
    cfg = cfg.replace(param_dtype=dtype)
  hf_config = config_to_hf(cfg, arch)
  if tokenizer is not None:  # fail before any file is written
    special_tokens.check_tokenizer(tokenizer, cfg.vocab_size)
  ids = None
  if tokenizer is not None or eos_token_ids:
    ids = special_tokens.token_ids(tokenizer, eos_token_ids)
    for name, value in ids.items():
      for t in value if isinstance(value, list) else [value]:
        if t is not None and not 0 <= t < cfg.vocab_size:
          raise CheckpointError(f"save_pretrained: {name} {t} is outside the model's "
                                f"vocabulary ({cfg.vocab_size} ids)")
    hf_config.update(ids)
  layout = names.layout(cfg, arch, fused=False)
  limit = parse_size(max_shard_size)
  out_dt = np_dtype(dtype) if dtype is not None else None

  variables = [(_flat_name(p), v) for p, v in nnx.to_flat_state(nnx.state(model))]
  if {n for n, _ in variables} != set(layout.pieces):
    raise CheckpointError(f"save_pretrained: model parameters do not match {arch}'s layout: "
                          f"{sorted({n for n, _ in variables} ^ set(layout.pieces))[:5]}")
  # The global tensor order and each tensor's dtype, from shapes alone.
  order = []
  for name, var in variables:
    dt = out_dt or np.dtype(var.get_value().dtype)
    for piece in layout.pieces[name]:
      shape = layout.hf_shapes[piece.hf_name]
      order.append((piece.hf_name, dt, shape, int(np.prod(shape)) * dt.itemsize))
  shards, cur, cur_size = [], [], 0
  for t in order:
    if cur and cur_size + t[3] > limit:
      shards.append(cur)
      cur, cur_size = [], 0
    cur.append(t)
    cur_size += t[3]
  shards.append(cur)
  n = len(shards)
  files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  for stale in ([os.path.join(path, SINGLE), os.path.join(path, INDEX)]
                + glob.glob(os.path.join(path, "model-*-of-*.safetensors"))):
    if os.path.exists(stale):
      os.remove(stale)

  def produced():
    for name, var in variables:
      value = np.asarray(jax.device_get(var.get_value()))
      if out_dt is not None:
        value = value.astype(out_dt)
      for piece in layout.pieces[name]:
        yield piece.hf_name, _hf_tensor(layout, piece, value)
      del value

  stream = produced()
  written = []
  for fname, shard in zip(files, shards):
    full = os.path.join(path, fname)
    with ShardWriter(full, [(t[0], t[1], t[2]) for t in shard]) as w:
      for _ in shard:
        w.write(*next(stream))
    written.append(full)
  if n > 1:
    index = {"metadata": {"total_size": sum(t[3] for t in order)},
             "weight_map": {t[0]: fname for fname, shard in zip(files, shards) for t in shard}}
    with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    written.append(os.path.join(path, INDEX))
  with open(os.path.join(path, CONFIG), "w", encoding="utf-8") as f:
    json.dump(hf_config, f, indent=2)
  written.append(os.path.join(path, CONFIG))
  if tokenizer is not None:
    written += special_tokens.write_tokenizer(tokenizer, path, vocab_size=cfg.vocab_size,
                                              model_max_length=cfg.max_seq_len)
  if ids is not None:
    written.append(special_tokens.write_generation_config(path, ids))
  return written
