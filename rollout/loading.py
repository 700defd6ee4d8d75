"""Loading served weights: Hugging Face checkpoints, project checkpoints, or fresh models.

What: `load_model(...)` returns the `MoEDecoder` to serve from exactly one source, and
`load_flat(path, cfg)` reads a checkpoint directory for a weight swap (format detected from its
files: `config.json` + `*.safetensors` is Hugging Face via `moe.hf`; anything else goes to the
project's orbax checkpoints via `moe.checkpoint`).
"""

from __future__ import annotations

import glob
import os
from typing import Optional

from moe import build
from moe import params as moe_params
from moe.config import ModelConfig


def is_hf_checkpoint(path: str) -> bool:
  return (os.path.isfile(os.path.join(path, "config.json"))
          and bool(glob.glob(os.path.join(path, "*.safetensors"))))


def _project(fn, path):
  """Calls a moe.checkpoint reader, turning its failures into ValueError with the path."""
  from moe import checkpoint
  try:
    return fn(checkpoint, path)
  except (OSError, ValueError, KeyError, FileNotFoundError) as e:
    raise ValueError(f"cannot read project checkpoint {path!r}: {e}") from e


def load_model(*, hf_checkpoint: Optional[str] = None, checkpoint: Optional[str] = None,
               config: Optional[ModelConfig] = None, seed: int = 0,
               max_seq_len: Optional[int] = None):
  """The model to serve, from exactly one of hf_checkpoint, checkpoint, or config (random init).

  Raises:
    ValueError: none or several sources, or a missing/unreadable checkpoint.
  """
  sources = [s for s in (hf_checkpoint, checkpoint, config) if s is not None]
  if len(sources) != 1:
    raise ValueError("give exactly one of --hf_checkpoint, --checkpoint or a model config")
  overrides = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
  if hf_checkpoint is not None:
    if not os.path.isdir(hf_checkpoint):
      raise ValueError(f"--hf_checkpoint {hf_checkpoint!r} is not a directory")
    from moe import hf
    return hf.load_pretrained(hf_checkpoint, config_overrides=overrides)
  if checkpoint is not None:
    if not os.path.exists(checkpoint):
      raise ValueError(f"--checkpoint {checkpoint!r} does not exist")
    model = _project(lambda m, p: m.load_model(p), checkpoint)
    if overrides:
      flat = moe_params.flatten(model)
      model = build.create(model.config.replace(**overrides))
      moe_params.load_flat(model, flat)
    return model
  return build.create(config.replace(**overrides), seed=seed)


def load_flat(path: str, cfg: ModelConfig) -> dict:
  """Flat weights from a checkpoint directory (for swaps); shapes are checked by the engine."""
  if not os.path.exists(path):
    raise ValueError(f"checkpoint {path!r} does not exist")
  if is_hf_checkpoint(path):
    from moe import hf
    return moe_params.flatten(hf.load_pretrained(path, dtype=cfg.param_dtype))
  _, flat = _project(lambda m, p: m.load_params_flat(p), path)
  return flat
