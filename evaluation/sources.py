"""Where completions come from: a model, a running engine, a checkpoint, or a generate callable.

Every source becomes the sampler callable the environments harness takes
(`envs.harness.inprocess_policy`):

    generate(prompt_token_ids, *, n, max_tokens, temperature, stop_token_ids, seed[, stop])
        -> completions

  * a `rollout.engine.Engine`: its `generate` (the caller owns the engine, and its tokenizer);
  * a `moe.model.MoEDecoder` (in memory, e.g. the main job's learner model): a new Engine over its
    weights with the evaluation's tokenizer, stopped when the evaluation ends. Deterministic mode
    by default, so a seeded evaluation gives the same completions whatever else is batched with
    them;
  * a checkpoint path: a project checkpoint (`moe.checkpoint`) or a Hugging Face directory
    (`moe.hf`), loaded through `rollout.loading`, then as above;
  * any other callable with the signature above (a remote sampler, a scripted test double).

The tokenizer an evaluation encodes prompts with is the source's own (`tokenizer_for`): a
checkpoint's tokenizer.json, an engine's tokenizer, or bytes for a model whose vocabulary is the
byte tokenizer's; a model with another vocabulary and no tokenizer is an error, never bytes.

An engine with a tokenizer also takes the harness's stop strings (`stop=`, `Sampler.stop_strings`)
and ends each completion at them, so a multi-turn agent's turn is not decoded to `max_tokens`
past its `</tool_call>`; an engine without one (it cannot match text) and a plain callable get
stop token ids only, and the harness cuts their completions at the stop strings afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional


def load_checkpoint(path: str):
  """The MoEDecoder stored at `path` (Hugging Face if it has config.json + safetensors)."""
  from rollout import loading  # pylint: disable=g-import-not-at-top
  if loading.is_hf_checkpoint(path):
    return loading.load_model(hf_checkpoint=path)
  return loading.load_model(checkpoint=path)


def checkpoint_eos_ids(path: str) -> tuple:
  """Every id that ends generation for the checkpoint at `path`: a Hugging Face checkpoint's
  generation_config.json EOS list, else its config.json's (`moe.hf.eos_token_ids`: a chat
  model's end-of-turn token is often only in the former); () for a project checkpoint, whose
  tokenizer's EOS is the one.

  Raises:
    ValueError (moe.hf.CheckpointError): an unreadable file or a malformed eos_token_id.
  """
  from rollout import loading  # pylint: disable=g-import-not-at-top
  if not loading.is_hf_checkpoint(path):
    return ()
  from moe import hf  # pylint: disable=g-import-not-at-top
  return tuple(hf.eos_token_ids(path))


def with_tokenizer(source: Any, tokenizer=None) -> tuple:
  """(source, tokenizer) to evaluate with: a checkpoint path becomes its MoEDecoder, and the
  tokenizer is `tokenizer` when given, else the source's own:

    * a checkpoint path: the checkpoint's (`moe.tokenizer.for_model` on its directory);
    * an Engine: its tokenizer, or for one without, as a model of its vocabulary;
    * a MoEDecoder: bytes when its vocabulary is the byte tokenizer's (`for_model(None, ...)`);
    * a generate callable (its vocabulary unknown): the byte tokenizer of the tiny models.

  Raises:
    moe.tokenizer.TokenizerError (a ValueError): a vocabulary that is not bytes and no tokenizer.
  """
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  if isinstance(source, str):
    path, source = source, load_checkpoint(source)
    if tokenizer is None:
      tokenizer = tokenizer_lib.for_model(path, source.config.vocab_size)
  if tokenizer is not None:
    return source, tokenizer
  if hasattr(source, "submit") and hasattr(source, "generate"):  # an Engine
    if source.tokenizer is not None:
      return source, source.tokenizer
    return source, tokenizer_lib.for_model(None, source.model_config.vocab_size)
  if _is_model(source):
    return source, tokenizer_lib.for_model(None, source.config.vocab_size)
  return source, tokenizer_lib.ByteTokenizer()


def _is_model(obj: Any) -> bool:
  from moe.config import ModelConfig  # pylint: disable=g-import-not-at-top
  return isinstance(getattr(obj, "config", None), ModelConfig) and callable(obj) and \
      not hasattr(obj, "submit")


def _engine_for(model, *, context: int, engine_config, tokenizer=None, eos_token_ids=()):
  from rollout.engine import Engine, EngineConfig  # pylint: disable=g-import-not-at-top
  cfg = model.config
  eos = tuple(int(t) for t in eos_token_ids if int(t) < cfg.vocab_size)
  if context > cfg.max_seq_len:
    raise ValueError(f"prompt + max_tokens needs {context} positions but the model's "
                     f"max_seq_len is {cfg.max_seq_len}")
  if engine_config is None:
    bucket = 64
    engine_config = EngineConfig(max_slots=32, max_len=min(cfg.max_seq_len,
                                                           -(-context // bucket) * bucket),
                                 deterministic=True, decode_steps=8, length_bucket=bucket,
                                 eos_token_ids=eos)
  elif (engine_config.max_len or cfg.max_seq_len) < context:
    raise ValueError(f"EngineConfig.max_len {engine_config.max_len} is below the {context} "
                     "positions prompt + max_tokens need")
  elif eos and not engine_config.eos_token_ids:
    engine_config = dataclasses.replace(engine_config, eos_token_ids=eos)
  return Engine(model, config=engine_config, tokenizer=tokenizer)


@dataclasses.dataclass
class Sampler:
  generate: Callable[..., list]
  engine: Any = None  # the Engine behind `generate`, if any
  max_slots: Optional[int] = None  # most completions in flight (None: no limit known)
  max_queue: Optional[int] = None
  stop_strings: bool = False  # `generate` takes `stop=` and ends completions at stop strings


@contextlib.contextmanager
def open_sampler(source: Any, *, context: int, engine_config=None, tokenizer=None,
                 eos_token_ids=()) -> Iterator[Sampler]:
  """Yields a Sampler for `source` (see module docstring); stops engines it created.

  Args:
    source: Engine, MoEDecoder, checkpoint path (str), or generate callable.
    context: positions one request needs (prompt tokens + max_tokens), to size a new engine.
    engine_config: a rollout.engine.EngineConfig for a new engine (default: deterministic,
      32 slots, max_len = context rounded up to 64).
    tokenizer: the tokenizer of a new engine (the evaluation's), so it can match stop strings;
      an Engine passed in keeps its own.
    eos_token_ids: ids that end every completion of a new engine (`EngineConfig.eos_token_ids`,
      unless `engine_config` sets its own; ids outside the vocabulary dropped): a checkpoint's
      EOS list, as `rollout.loading` gives a served model. An Engine passed in keeps its own.
  """
  if isinstance(source, str):
    source = load_checkpoint(source)
  if hasattr(source, "submit") and hasattr(source, "generate"):  # an Engine
    yield Sampler(source.generate, source, source.config.max_slots, source.config.max_queue,
                  stop_strings=getattr(source, "tokenizer", None) is not None)
    return
  if _is_model(source):
    engine = _engine_for(source, context=context, engine_config=engine_config,
                         tokenizer=tokenizer, eos_token_ids=eos_token_ids)
    try:
      yield Sampler(engine.generate, engine, engine.config.max_slots, engine.config.max_queue,
                    stop_strings=engine.tokenizer is not None)
    finally:
      engine.stop()
    return
  if callable(source):
    yield Sampler(source)
    return
  raise TypeError(f"cannot sample from {type(source).__name__}: pass an Engine, a MoEDecoder, a "
                  "checkpoint path or a generate callable")
