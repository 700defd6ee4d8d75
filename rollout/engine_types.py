"""The engine's data types: settings, requests, results and errors.

What: `EngineConfig` (serving settings), `RequestHandle` (a submitted request: wait, cancel,
stream), `Completion` (one result), `PreparedWeights` (weights packed for a swap), and the
errors `QueueFull` / `EngineStopped`. Split from `rollout.engine` so the serving loop stays one
readable module; `rollout.engine` re-exports all of them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from typing import Any, Callable, Optional

import numpy as np

from rollout.sampling import SamplingParams


class QueueFull(RuntimeError):
  """The bounded request queue is full; retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
  """The engine is not running."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Serving settings.

  Attributes:
    max_slots: decode batch rows (completions in flight at once).
    max_len: KV-cache length per slot = the context: prompt + max_tokens must fit. None uses the
      model's max_seq_len.
    decode_steps: decode steps per device call (tokens are handed back once per call).
    deterministic: fixed shapes and dropless experts (reproducible whatever the batch).
    max_queue: most completions (sum of n) waiting for a slot before submit raises QueueFull.
    prefill_rows: most prompts prefilled per device call (deterministic mode always uses this
      many rows, padding the rest).
    min_prefill_len: smallest prompt length bucket (buckets double up to max_len).
    length_bucket: granularity of the attended cache prefix in decode (its smallest bucket).
    capacity_factors: expert capacity tiers as multiples of the even share; a dropless tier is
      always added (see rollout.forward).
    dtype: compute dtype of the sampler ("float32" is fastest on the CPU); None keeps the model's.
    eos_token_ids: stop ids added to every request unless it sets ignore_eos.
    max_stop_ids: most stop token ids per request (a fixed-width device table).
    idle_wait_s: how long the loop sleeps when there is nothing to do (new work wakes it).
    prefix_cache_blocks: blocks of automatic prefix caching (`rollout.prefix_reuse`): KV of
      prompt and generated token prefixes kept past their requests, in blocks of
      `prefix_block_size` positions, so a request that starts with a cached prefix prefills
      only the rest (the next turn of a conversation, the n attempts of a prompt, a repeated
      system prompt). Memory: this many blocks of every layer's keys and values. None (the
      default) sizes it as the slot cache (max_slots * max_len / prefix_block_size blocks, so
      KV memory doubles); 0 is off. On by default: it costs single-turn work nothing measurable
      (BENCHMARKS.md, "Prefix caching in the sampler").
    prefix_block_size: tokens per cached block (only whole blocks are cached).
    shape_buckets: how finely the static shapes of the device programs follow a call's work
      (`rollout.scheduler`). Each shape is compiled once, and `//tools:serve` compiles every
      reachable one before it is ready (`rollout.warmup`), so the size of the set is the
      server's start-up time on a cold compilation cache.
      "coarse" (the default): decode attends over `length_bucket` x a power of two positions;
      a prefill call has a fixed number of rows per prompt bucket (`prefill_tokens`); with a
      prefix cache every prefill is an extend (from an empty prefix when nothing is cached)
      whose block table is a power of four wide; every call returns the top logprobs.
      "fine": decode attends over a multiple of `length_bucket` positions; a prefill call has
      the power of two rows covering its prompts; block tables are a power of two wide; a
      prefill without a cached prefix has programs of its own; top logprobs only in calls
      with a request that asked for them.
      tiny.gin at serve.gin's settings: 60 programs "coarse", 449 "fine"; what the padding
      costs in decode tokens/s: BENCHMARKS.md, "Shape buckets". Deterministic mode's shapes
      are fixed either way ("coarse" shares the top-logprobs program, outputs unchanged).
    prefill_tokens: "coarse" prefill calls of prompt bucket L have min(prefill_rows,
      max(1, prefill_tokens // L)) rows, padded when fewer prompts wait: short prompts share a
      call, a long one fills one alone, and the rows are not a shape dimension of their own.
  """
  max_slots: int = 64
  max_len: Optional[int] = None
  decode_steps: int = 16
  deterministic: bool = False
  max_queue: int = 4096
  prefill_rows: int = 8
  min_prefill_len: int = 16
  length_bucket: int = 64
  capacity_factors: tuple = (1.0, 1.125, 1.25, 1.375, 1.5, 1.75, 2.0, 2.5)
  dtype: Optional[str] = "float32"
  eos_token_ids: tuple = ()
  max_stop_ids: int = 8
  idle_wait_s: float = 0.05
  prefix_cache_blocks: Optional[int] = None
  prefix_block_size: int = 16
  shape_buckets: str = "coarse"
  prefill_tokens: int = 512


@dataclasses.dataclass
class Completion:
  """One generated completion.

  Attributes:
    token_ids: generated tokens (a stop token that ended the completion is included, and so are
      the tokens up to the one that completed a stop string that ended it).
    logprobs: log-probability of each token under the distribution it was sampled from.
    routing: [moe_layers, T, k] experts of the forward step that produced each token (the step
      whose input was the previous token; for token 0 the prompt's last token). None for dense
      models.
    policy_versions: weight version that produced each token.
    finish_reason: "stop" (stop token or string), "length", "cancelled" or "timeout".
    text: decoded text if a tokenizer is set; a completion ended by a stop string has the text
      before it, while `token_ids` keep the tokens that wrote it (`rollout.outputs.find_stop`).
    prompt_routing: [moe_layers, P - 1, k] experts of prompt positions 0..P-2, so that
      concatenating it with `routing` along axis 1 replays routing for the learner's forward on
      prompt + token_ids[:-1].
    index: completion index within the request (0..n-1).
    top_logprobs: per token, {token id: logprob} of the `logprobs` most likely tokens of the
      distribution sampled from (None unless the request asked for alternatives).
    cached_tokens: prompt tokens of its request served from the prefix cache, not prefilled
      (the same for the n completions of a request, which share one prefill).
  """
  token_ids: list
  logprobs: list
  routing: Optional[np.ndarray]
  policy_versions: list
  finish_reason: str
  text: str = ""
  prompt_routing: Optional[np.ndarray] = None
  index: int = 0
  top_logprobs: Optional[list] = None
  cached_tokens: int = 0


class Sample:
  """Host-side progress of one completion."""

  def __init__(self, index: int):
    self.index = index
    self.tokens: list = []
    self.logprobs: list = []
    self.routing: list = []  # [moe_layers, k] per token
    self.versions: list = []
    self.top: list = []  # {token id: logprob} per token, when alternatives were asked for
    self.finish_reason: Optional[str] = None
    self.text = ""
    self.slot: Optional[int] = None


@dataclasses.dataclass
class PreparedWeights:
  """Weights validated and packed by `Engine.prepare_weights`, ready to swap in."""
  params: Any
  flat: dict
  prepare_s: float
  rms: Optional[dict] = None  # weight_checks' {name: RMS} of `flat`, the next swap's reference


class RequestHandle:
  """A submitted request: wait with `.result()`, or `await asyncio.wrap_future(h.future)`."""

  _ids = itertools.count()

  def __init__(self, prompt: list, params: SamplingParams, stop_ids: tuple, deadline,
               on_tokens: Optional[Callable] = None):
    self.id = next(RequestHandle._ids)
    self.prompt = prompt
    self.params = params
    self.stop_ids = stop_ids
    self.deadline = deadline
    self.on_tokens = on_tokens
    self.samples = [Sample(i) for i in range(params.n)]
    self.prompt_routing: Optional[np.ndarray] = None
    self.cached_tokens = 0  # prompt tokens taken from the prefix cache
    self.prefix_keys: Optional[list] = None  # rollout.prefix_cache.chain_keys of the prompt
    self.prefix_epoch: Optional[int] = None  # the prefix cache's epoch when it was prefilled
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.cancelled = False
    self.submitted_at = time.monotonic()

  def cancel(self) -> None:
    """Stops the request; completions finish with what they have (finish_reason "cancelled")."""
    self.cancelled = True

  def done(self) -> bool:
    return self.future.done()

  def result(self, timeout: Optional[float] = None) -> list:
    return self.future.result(timeout)
