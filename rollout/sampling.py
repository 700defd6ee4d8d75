"""Token sampling on device: temperature, top-k, top-p, per-request seeds, and logprobs.

What: `sample(logits, temperature, top_k, top_p, seed, sample_index, token_index)` picks one token
per row and returns its log-probability under the distribution actually sampled from:
softmax(logits / temperature) restricted to the top-k tokens and then to the top-p nucleus,
renormalised. Temperature 0 means greedy (argmax); its logprob is the model's untempered
log-softmax (a point mass would always report 0, which no caller can use).

Why this shape:
  * Randomness is a pure function of (seed, sample index, token index): row r draws one uniform
    from fold_in(fold_in(PRNGKey(seed_r), sample_r), token_r) and inverts the row's CDF. Nothing
    depends on the batch, the slot, or how many steps ran per call, so a seeded request is
    reproducible whatever else is being served.
  * No sort: a full-vocabulary sort costs more than a whole decode step on this CPU. Top-k and
    top-p thresholds are found by bisection on probability (`_BISECT` halvings, relative
    resolution 2^-30 of the row's largest probability), run only when some row filters.
    A token whose probability lies within that resolution of the threshold is kept, which is the
    only departure from an exact sort.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

_BISECT = 30
MAX_TOP_LOGPROBS = 5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (validated on construction).

  Attributes:
    n: completions per prompt (they share the prompt's prefill).
    max_tokens: most tokens to generate per completion (>= 1).
    temperature: 0 = greedy; otherwise > 0.
    top_p: nucleus mass in (0, 1]; 1 = off.
    top_k: keep the k most likely tokens; 0 = off.
    stop_token_ids: token ids that end a completion (the stop token is returned with its logprob).
    stop: strings that end a completion (checked on decoded text; excluded from `text`).
    seed: makes sampling reproducible; None draws a random seed.
    ignore_eos: do not add the engine's default end-of-sequence ids to stop_token_ids.
    logprobs: also return this many most likely alternatives per token (0..MAX_TOP_LOGPROBS).
  """
  n: int = 1
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stop_token_ids: tuple = ()
  stop: tuple = ()
  seed: Optional[int] = None
  ignore_eos: bool = False
  logprobs: int = 0

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(msg)
    for name in ("n", "max_tokens", "top_k", "logprobs"):
      v = getattr(self, name)
      need(isinstance(v, int) and not isinstance(v, bool), f"{name} must be an integer, got {v!r}")
    need(self.n >= 1, f"n must be >= 1, got {self.n}")
    need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
    need(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
    need(0 <= self.logprobs <= MAX_TOP_LOGPROBS,
         f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
    for name in ("temperature", "top_p"):
      v = getattr(self, name)
      need(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v,
           f"{name} must be a number, got {v!r}")
    need(0 <= self.temperature <= 100, f"temperature must lie in [0, 100], got {self.temperature}")
    need(0 < self.top_p <= 1, f"top_p must lie in (0, 1], got {self.top_p}")
    need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
         f"seed must be an integer, got {self.seed!r}")
    for t in self.stop_token_ids:
      need(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
           f"stop_token_ids must be non-negative integers, got {t!r}")
    for s in self.stop:
      need(isinstance(s, str) and s, f"stop must be non-empty strings, got {s!r}")


def _largest_threshold(values, target, measure):
  """Per row, the largest tau in [0, max] (bisection) with measure(values >= tau) >= target."""
  lo = jnp.zeros(values.shape[:1], values.dtype)
  hi = jnp.max(values, axis=-1) * (1 + 1e-6) + 1e-30

  def body(_, c):
    lo, hi = c
    mid = 0.5 * (lo + hi)
    ok = measure(values >= mid[:, None]) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, _BISECT, body, (lo, hi))
  return lo


def filter_mask(scaled_logits, top_k, top_p):
  """Boolean [B, V] of tokens kept by top-k then top-p (see module docstring)."""
  v = scaled_logits.shape[-1]
  probs = jax.nn.softmax(scaled_logits, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v).astype(jnp.float32)
  tau_k = _largest_threshold(probs, k, lambda m: jnp.sum(m, axis=-1, dtype=jnp.float32))
  keep_k = probs >= tau_k[:, None]
  pk = jnp.where(keep_k, probs, 0.0)
  pk = pk / jnp.sum(pk, axis=-1, keepdims=True)
  tau_p = _largest_threshold(pk, top_p, lambda m: jnp.sum(jnp.where(m, pk, 0.0), axis=-1))
  keep = keep_k & (pk >= tau_p[:, None])
  return jnp.where((top_p >= 1)[:, None], keep_k, keep)


def row_uniform(seed, sample_index, token_index):
  """One uniform in (0, 1) per row from (seed, sample index, token index) alone."""
  def one(s, i, t):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), i), t)
    return jax.random.uniform(key, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny)
  return jax.vmap(one)(seed, sample_index, token_index)


def sample(logits, temperature, top_k, top_p, seed, sample_index, token_index, top_n: int = 0):
  """Samples one token per row.

  Args:
    logits: float32 [B, V].
    temperature: float32 [B] (0 = greedy).
    top_k: int32 [B] (0 = off).
    top_p: float32 [B] (1 = off).
    seed: uint32 [B]; sample_index, token_index: int32 [B] (see `row_uniform`).
    top_n: also return the top_n most likely tokens of that distribution (static; 0 = none).

  Returns:
    (tokens int32 [B], logprobs float32 [B], top logprobs float32 [B, top_n], top ids int32
     [B, top_n]) -- all under the distribution sampled from (the model's for greedy rows).
  """
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  filtering = jnp.any(((top_k > 0) | (top_p < 1)) & ~greedy)
  keep = jax.lax.cond(filtering, lambda: filter_mask(scaled, top_k, top_p),
                      lambda: jnp.ones(scaled.shape, bool))
  logp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
  cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
  u = row_uniform(seed, sample_index, token_index)
  drawn = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
  drawn = jnp.minimum(drawn, logits.shape[-1] - 1)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
  model_logp = jax.nn.log_softmax(logits, axis=-1)
  used = jnp.where(greedy[:, None], model_logp, logp)
  lp = jnp.take_along_axis(used, tokens[:, None], axis=-1)[:, 0]
  if top_n:
    top_lp, top_ids = jax.lax.top_k(used, top_n)
  else:
    top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
  return tokens, lp, top_lp, top_ids.astype(jnp.int32)

