"""Checks a request before it is queued: the prompt, the sampling settings, the stop ids.

What: `check_request(...)` returns the prompt as a list of ints and the request's stop token ids
(its own plus the engine's EOS ids unless it ignores EOS), or raises ValueError / TypeError with a
message a client can act on. Nothing is queued for a request that fails, so the server answers 400
and keeps serving. Split from `rollout.engine` so the serving loop reads on its own.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from moe.config import ModelConfig
from rollout.engine_types import EngineConfig
from rollout.sampling import SamplingParams


def check_prompt(prompt_token_ids, params: SamplingParams, cfg: ModelConfig, ec: EngineConfig,
                 max_len: int) -> list:
  """The prompt as ints in the vocabulary that, with max_tokens, fits the context."""
  if not isinstance(params, SamplingParams):
    raise TypeError("params must be a rollout.sampling.SamplingParams")
  if isinstance(prompt_token_ids, (str, bytes, dict)):
    raise ValueError("prompt_token_ids must be a sequence of integers")
  try:
    prompt = [int(t) for t in prompt_token_ids]
  except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
    raise ValueError("prompt_token_ids must be a sequence of integers") from None
  if any(isinstance(t, bool) or t != int(t) for t in prompt_token_ids):
    raise ValueError("prompt_token_ids must be integers")
  if not prompt:
    raise ValueError("the prompt is empty")
  v = cfg.vocab_size
  for i, t in enumerate(prompt):
    if not 0 <= t < v:
      raise ValueError(f"token id {t} at prompt position {i} is outside the vocabulary "
                       f"(size {v})")
  if len(prompt) + params.max_tokens > max_len:
    raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                     f"the context length {max_len}")
  if params.n > ec.max_slots:
    raise ValueError(f"n ({params.n}) exceeds the engine's slots ({ec.max_slots})")
  return prompt


def check_timeout(timeout) -> Optional[float]:
  """The request timeout in seconds (None: none), or ValueError.

  A NaN deadline would never pass and a negative one would end the request before it ran, so
  both are refused; infinity means no timeout.
  """
  if timeout is None:
    return None
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
    raise ValueError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
  if isinstance(timeout, int) and timeout > 10**9:
    return None  # beyond any server's lifetime (and float(int) could overflow)
  if not timeout > 0:  # also refuses NaN
    raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
  return None if math.isinf(timeout) else float(timeout)


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, cfg: ModelConfig,
                  ec: EngineConfig, max_len: int, tokenizer: Optional[object]) -> tuple:
  """Returns (prompt list, stop token ids tuple) or raises ValueError / TypeError.

  Together with `SamplingParams`' own checks, every value the engine stages into its int32 /
  float32 / uint32 slot tables is in range after this, so client input cannot make the engine
  thread fail.
  """
  prompt = check_prompt(prompt_token_ids, params, cfg, ec, max_len)
  stop_ids = tuple(sorted(set(params.stop_token_ids) | (
      set() if params.ignore_eos else set(ec.eos_token_ids))))
  for t in stop_ids:
    if t >= cfg.vocab_size:
      raise ValueError(f"stop token id {t} is outside the vocabulary (size {cfg.vocab_size})")
  if len(stop_ids) > ec.max_stop_ids:
    raise ValueError(f"at most {ec.max_stop_ids} stop token ids, got {len(stop_ids)}")
  if params.stop and tokenizer is None:
    raise ValueError("stop strings need a tokenizer; this engine has none")
  return prompt, stop_ids
