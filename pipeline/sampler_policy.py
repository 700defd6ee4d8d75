"""The harness's `Policy` over the pipeline's samplers: how RL episodes reach the sampler set.

The RL controller runs every attempt through the harness (`envs.harness.attempts`), whose
policy must continue a context given as token ids. `SamplerPolicy` sends that context, exactly
as given, to a `pipeline.samplers.SamplerSet` (in-process engines or HTTP samplers, with
retries on another sampler when one fails) and hands back the harness's Completions.

A request a sampler refuses as invalid (`samplers.RequestRejected`) would be refused for every
attempt: it is recorded in `rejected` (the controller stops the run with it) and, like every
other failure, surfaces to the harness as a `PolicyError` (the episode is an infrastructure
failure, masked, never scored 0).
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from envs.harness import policy as policy_lib
from pipeline import samplers as samplers_lib
from rollout.sampling import SamplingParams


class SamplerPolicy:
  """Policy over a SamplerSet.

  Args:
    samplers: a pipeline.samplers.SamplerSet.
    tokenizer: the model's tokenizer (encode/decode, bos_id, eos_id).
    add_bos: contexts start with BOS (how the project's models are pre-trained).
    timeout_s: per sampler request; it is retried elsewhere when a sampler fails or runs over.
  """

  def __init__(self, samplers, tokenizer, *, add_bos: bool = True,
               timeout_s: Optional[float] = None):
    self.samplers = samplers
    self.tokenizer = tokenizer
    self.add_bos = add_bos
    self.timeout_s = timeout_s
    self._lock = threading.Lock()
    self.rejected: Optional[BaseException] = None
    self.requests = 0
    self.prompt_tokens = 0

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def start_ids(self) -> list[int]:
    return [self.tokenizer.bos_id] if self.add_bos else []

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1,
               top_p=1.0, stop_token_ids=()) -> list[policy_lib.Completion]:
    eos = self.tokenizer.eos_id
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=(eos, *(int(t) for t in stop_token_ids if t != eos)),
                            stop=tuple(stop),
                            seed=None if seed is None else int(seed) % (2**31))
    with self._lock:
      self.requests += 1
      self.prompt_tokens += len(prompt_ids)
    fut = self.samplers.submit(list(prompt_ids), params, timeout=self.timeout_s)
    try:
      # The set retries on other samplers and fails the future when all tries are spent, so
      # this wait ends; its bound covers every try.
      wait = None if self.timeout_s is None else (self.timeout_s + 60) * \
          max(1, getattr(self.samplers, "max_attempts", 1))
      return list(fut.result(timeout=wait))
    except samplers_lib.RequestRejected as e:
      with self._lock:
        if self.rejected is None:
          self.rejected = e
      raise policy_lib.PolicyError(f"the sampler rejected the request: {e}") from e
    except Exception as e:  # pylint: disable=broad-except
      raise policy_lib.PolicyError(f"every sampler attempt failed: {type(e).__name__}: {e}") \
          from e
