"""Where completions come from: a model, a running engine, a checkpoint, or a generate callable.

Every source becomes the sampler callable the environments harness takes
(`envs.harness.inprocess_policy`):

    generate(prompt_token_ids, *, n, max_tokens, temperature, stop_token_ids, seed) -> completions

  * a `rollout.engine.Engine`: its `generate` (the caller owns the engine);
  * a `moe.model.MoEDecoder` (in memory, e.g. the main job's learner model): a new Engine over its
    weights, stopped when the evaluation ends. Deterministic mode by default, so a seeded
    evaluation gives the same completions whatever else is batched with them;
  * a checkpoint path: a project checkpoint (`moe.checkpoint`) or a Hugging Face directory
    (`moe.hf`), loaded through `rollout.loading`, then as above;
  * any other callable with the signature above (a remote sampler, a scripted test double).
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


def _is_model(obj: Any) -> bool:
  from moe.config import ModelConfig  # pylint: disable=g-import-not-at-top
  return isinstance(getattr(obj, "config", None), ModelConfig) and callable(obj) and \
      not hasattr(obj, "submit")


def _engine_for(model, *, context: int, engine_config):
  from rollout.engine import Engine, EngineConfig  # pylint: disable=g-import-not-at-top
  cfg = model.config
  if context > cfg.max_seq_len:
    raise ValueError(f"prompt + max_tokens needs {context} positions but the model's "
                     f"max_seq_len is {cfg.max_seq_len}")
  if engine_config is None:
    bucket = 64
    engine_config = EngineConfig(max_slots=32, max_len=min(cfg.max_seq_len,
                                                           -(-context // bucket) * bucket),
                                 deterministic=True, decode_steps=8, length_bucket=bucket)
  elif (engine_config.max_len or cfg.max_seq_len) < context:
    raise ValueError(f"EngineConfig.max_len {engine_config.max_len} is below the {context} "
                     "positions prompt + max_tokens need")
  return Engine(model, config=engine_config)


@dataclasses.dataclass
class Sampler:
  generate: Callable[..., list]
  engine: Any = None  # the Engine behind `generate`, if any
  max_slots: Optional[int] = None  # most completions in flight (None: no limit known)
  max_queue: Optional[int] = None


@contextlib.contextmanager
def open_sampler(source: Any, *, context: int, engine_config=None) -> Iterator[Sampler]:
  """Yields a Sampler for `source` (see module docstring); stops engines it created.

  Args:
    source: Engine, MoEDecoder, checkpoint path (str), or generate callable.
    context: positions one request needs (prompt tokens + max_tokens), to size a new engine.
    engine_config: a rollout.engine.EngineConfig for a new engine (default: deterministic,
      32 slots, max_len = context rounded up to 64).
  """
  if isinstance(source, str):
    source = load_checkpoint(source)
  if hasattr(source, "submit") and hasattr(source, "generate"):  # an Engine
    yield Sampler(source.generate, source, source.config.max_slots, source.config.max_queue)
    return
  if _is_model(source):
    engine = _engine_for(source, context=context, engine_config=engine_config)
    try:
      yield Sampler(engine.generate, engine, engine.config.max_slots, engine.config.max_queue)
    finally:
      engine.stop()
    return
  if callable(source):
    yield Sampler(source)
    return
  raise TypeError(f"cannot sample from {type(source).__name__}: pass an Engine, a MoEDecoder, a "
                  "checkpoint path or a generate callable")
