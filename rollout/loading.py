"""Loading served weights: Hugging Face checkpoints, project checkpoints, or fresh models.

What: `load_model(...)` returns the `MoEDecoder` to serve from exactly one source,
`load_engine(...)` the started engine that serves it (what //tools:serve runs) with the model's own
tokenizer (`load_tokenizer`), and `load_flat(path, cfg)` reads a checkpoint directory for a weight swap (format detected from its
files: `config.json` + `*.safetensors` is Hugging Face via `moe.hf`; anything else goes to the
project's orbax checkpoints via `moe.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Optional

from moe import build
from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from moe.config import ModelConfig

_log = logging.getLogger(__name__)


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


def _eos_from_hf(path: str) -> tuple:
  """Every end-of-sequence id of the Hugging Face checkpoint in `path`: generation_config.json's
  eos_token_id (a list for chat models: Qwen3 stops at `<|im_end|>` and `<|endoftext|>` while
  config.json names one), else config.json's (`moe.hf.eos_token_ids`).

  Raises:
    ValueError (moe.hf.CheckpointError): an unreadable file or a malformed eos_token_id.
  """
  from moe import hf  # pylint: disable=g-import-not-at-top
  return hf.eos_token_ids(path)


def load_tokenizer(directory: Optional[str], vocab_size: int):
  """The tokenizer of the served model: `moe.tokenizer.for_model` for a checkpoint directory
  (its tokenizer.json, or bytes for a byte vocabulary, else TokenizerError); for a model without
  a directory (a random-init preset), bytes when its vocabulary is bytes, else None: the server
  then takes token-id prompts only, and the start-up log says so.

  Raises:
    moe.tokenizer.TokenizerError (a ValueError): a checkpoint without a usable tokenizer.
  """
  if directory is None and not tokenizer_lib.is_byte_vocabulary(vocab_size):
    _log.warning("the model has no directory and a vocabulary of %d ids that is not bytes: no "
                 "tokenizer, so text prompts are refused (send token ids)", vocab_size)
    return None
  return tokenizer_lib.for_model(directory, vocab_size)


def load_engine(engine_config, *, hf_checkpoint: Optional[str] = None,
                checkpoint: Optional[str] = None, config: Optional[ModelConfig] = None,
                seed: int = 0, max_seq_len: Optional[int] = None, replicas: int = 1,
                expert: int = 1, tensor: int = 1, devices=None):
  """The started `rollout.engine.Engine` serving `load_model(...)`'s model, with the tokenizer
  of its checkpoint (`load_tokenizer`).

  Args:
    engine_config: the engine's settings (rollout.engine.EngineConfig). Without eos_token_ids,
      every EOS id of the checkpoint (generation_config.json's list, else a Hugging Face
      checkpoint's config.json `eos_token_id`), else the tokenizer's end of sequence, ends a completion
      (ids outside the vocabulary dropped).
    hf_checkpoint / checkpoint / config / seed / max_seq_len: as `load_model`.
    replicas, expert, tensor, devices: the layout (`rollout.replicas.build`): `replicas`
      data-parallel engines (a `rollout.replicas.ReplicaSet`, which `rollout.server` serves like
      one engine), each sharded over an (expert, tensor) mesh of its own devices. All 1 (the
      default): one engine on the default device.

  Raises:
    ValueError: as `load_model`, or a checkpoint without a usable tokenizer
      (moe.tokenizer.TokenizerError).
  """
  from rollout.engine import Engine  # pylint: disable=g-import-not-at-top
  model = load_model(hf_checkpoint=hf_checkpoint, checkpoint=checkpoint, config=config,
                     seed=seed, max_seq_len=max_seq_len)
  tok = load_tokenizer(hf_checkpoint or checkpoint, model.config.vocab_size)
  # A project checkpoint saved by a run from a Hugging Face checkpoint keeps that checkpoint's
  # EOS list in a generation_config.json beside its weights (experiment.run): read it too.
  directory = hf_checkpoint or checkpoint
  eos = _eos_from_hf(directory) if directory else ()
  if not eos and tok is not None and tok.eos_id is not None:
    eos = (tok.eos_id,)
  if eos and not engine_config.eos_token_ids:
    engine_config = dataclasses.replace(
        engine_config, eos_token_ids=tuple(t for t in eos if t < model.config.vocab_size))
  if replicas == expert == tensor == 1 and devices is None:
    return Engine(model, config=engine_config, tokenizer=tok)
  from rollout import replicas as replicas_lib  # pylint: disable=g-import-not-at-top
  return replicas_lib.build(moe_params.flatten(model), model.config, replicas=replicas,
                            expert=expert, tensor=tensor, devices=devices, config=engine_config,
                            tokenizer=tok)


def load_flat(path: str, cfg: ModelConfig) -> dict:
  """Flat weights from a checkpoint directory (for swaps); shapes are checked by the engine."""
  if not os.path.exists(path):
    raise ValueError(f"checkpoint {path!r} does not exist")
  if is_hf_checkpoint(path):
    from moe import hf
    return moe_params.flatten(hf.load_pretrained(path, dtype=cfg.param_dtype))
  _, flat = _project(lambda m, p: m.load_params_flat(p), path)
  return flat
