"""Runs that start from a Hugging Face checkpoint and end with one (ExperimentConfig.hf_checkpoint).

What: `with_checkpoint_model(cfg)` is `cfg` with `model` the model the run trains, read from the
checkpoint's config.json without loading weights (what tools/ validates a run against);
`load(cfg)` imports the checkpoint (moe.hf) with its own tokenizer (moe.tokenizer.for_model: its
tokenizer.json, tokenizer_config.json and chat template; never bytes in place of its vocabulary)
and what an export needs to know of it (`Source`); `export(...)` writes a trained model back as a
complete checkpoint (weights, config.json, tokenizer files, chat template and
generation_config.json with the checkpoint's EOS ids) that transformers and //tools:serve load.

Why the model differs from the checkpoint's config in two values: the weights are trained in
float32 (`TRAIN_DTYPE`, the learner's master precision; the samplers get float32 too), and
`max_seq_len` is the run's (`ExperimentConfig.model.max_seq_len`), not the checkpoint's
`max_position_embeddings` (40960 for Qwen3), since it sizes every sampler slot's KV cache. Neither
changes a weight's shape, and the export restores both: the checkpoint's dtype and context.
"""

from __future__ import annotations

import dataclasses
import os

from flax import nnx

from experiment.config import ExperimentConfig
from moe import build
from moe import hf
from moe import tokenizer as tokenizer_lib
from moe.config import ModelConfig

TRAIN_DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class Source:
  """The checkpoint a run started from, as its export needs it.

  Attributes:
    directory: the checkpoint's directory.
    architecture: "Qwen3MoeForCausalLM" or "MixtralForCausalLM".
    config: its ModelConfig as it declares it (its dtype, its max_position_embeddings).
    eos_token_ids: every id that ends generation (generation_config.json's list, else
      config.json's, else the tokenizer's EOS): the samplers stop at them, the export keeps them.
  """
  directory: str
  architecture: str
  config: ModelConfig
  eos_token_ids: tuple


def _overrides(cfg: ExperimentConfig) -> dict:
  return {"max_seq_len": cfg.model.max_seq_len}


def with_checkpoint_model(cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` with `model` the one `load(cfg)` trains (see the module docstring), read from
  config.json and the shards' headers only.

  Raises:
    moe.hf.CheckpointError (a ValueError): no readable Mixtral / Qwen3-MoE checkpoint there.
    ValueError: the run does not fit the model (ExperimentConfig's own checks).
  """
  model = hf.load_config(cfg.hf_checkpoint, dtype=TRAIN_DTYPE, config_overrides=_overrides(cfg))
  return dataclasses.replace(cfg, model=model)


def load(cfg: ExperimentConfig):
  """(model, tokenizer, Source) of cfg.hf_checkpoint, the model as `with_checkpoint_model`.

  Raises:
    moe.hf.CheckpointError: a checkpoint moe.hf cannot import.
    moe.tokenizer.TokenizerError: no usable tokenizer.json beside it.
  """
  directory = cfg.hf_checkpoint
  model = hf.load_pretrained(directory, dtype=TRAIN_DTYPE, config_overrides=_overrides(cfg))
  tok = tokenizer_lib.for_model(directory, model.config.vocab_size)
  eos = tuple(model.hf_eos_token_ids) or ((tok.eos_id,) if tok.eos_id is not None else ())
  source = Source(directory=directory, architecture=model.hf_architecture,
                  config=hf.load_config(directory), eos_token_ids=eos)
  return model, tok, source


def export(model, tokenizer, source: Source, directory: str) -> list[str]:
  """Writes `model` (trained from `source`) to `directory` as a Hugging Face checkpoint in the
  source's architecture, dtype and context, with `tokenizer`'s files, its chat template and a
  generation_config.json naming the source's EOS ids; returns the paths written."""
  cfg = model.config.replace(max_seq_len=source.config.max_seq_len)
  # max_seq_len shapes no weight: the same state under the source's config.
  out = nnx.merge(nnx.graphdef(build.abstract(cfg)), nnx.state(model))
  os.makedirs(directory, exist_ok=True)
  return hf.save_pretrained(out, directory, architecture=source.architecture,
                            dtype=source.config.param_dtype, tokenizer=tokenizer,
                            eos_token_ids=source.eos_token_ids)
