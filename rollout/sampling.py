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
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_BISECT = 30
MAX_TOP_LOGPROBS = 5


# The engine stages every setting into a per-slot device table (rollout.engine): n, max_tokens,
# top_k, logprobs and stop ids into int32, temperature and top_p into float32, seeds into uint32.
# A value those tables cannot hold is refused here, with the field's name, so that it never
# reaches the engine thread.
INT32_MAX = 2**31 - 1
# Below this a temperature divides logits past float32's range (inf, then NaN probabilities).
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0
# The smallest normal float32: a smaller top_p rounds to 0 on device and keeps no token at all.
MIN_TOP_P = float(np.finfo(np.float32).tiny)
SEED_RANGE = (-2**63, 2**64)  # any 64-bit seed, signed or not; reduced mod 2**32 on device


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (validated on construction: ValueError naming the field).

  Attributes:
    n: completions per prompt (they share the prompt's prefill); 1..2**31-1 (the engine also
      bounds it by its slots).
    max_tokens: most tokens to generate per completion; 1..2**31-1 (the engine also bounds it by
      its context length).
    temperature: 0 = greedy; otherwise in [MIN_TEMPERATURE, MAX_TEMPERATURE].
    top_p: nucleus mass in [MIN_TOP_P, 1] (float32's smallest normal number); 1 = off.
    top_k: keep the k most likely tokens; 0 = off; at most 2**31-1 (int32). A top_k of the
      vocabulary size or more keeps every token, the same as 0.
    stop_token_ids: token ids that end a completion (the stop token is returned with its
      logprob); a tuple or list of non-negative ints (stored as a tuple; the engine checks them
      against its vocabulary).
    stop: strings that end a completion (checked on decoded text; excluded from `text`); a tuple
      or list of non-empty strings (stored as a tuple).
    seed: makes sampling reproducible; None draws a random seed. Any integer in
      [-2**63, 2**64); the device uses seed mod 2**32.
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
    for name, lo, hi in (("n", 1, INT32_MAX), ("max_tokens", 1, INT32_MAX),
                         ("top_k", 0, INT32_MAX), ("logprobs", 0, MAX_TOP_LOGPROBS)):
      v = getattr(self, name)
      need(_is_int(v), f"{name} must be an integer, got {_short(v)}")
      need(lo <= v <= hi, f"{name} must lie in [{lo}, {hi}], got {_short(v)}")
      object.__setattr__(self, name, int(v))
    for name in ("temperature", "top_p"):
      v = getattr(self, name)
      need((isinstance(v, (float, np.floating)) or _is_int(v)) and not isinstance(v, bool),
           f"{name} must be a number, got {_short(v)}")
      need(abs(v) <= 2**64 if _is_int(v) else math.isfinite(v),
           f"{name} must be a finite number in range, got {_short(v)}")
      object.__setattr__(self, name, float(v))
    need(self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
         f"temperature must be 0 (greedy) or lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
         f"got {self.temperature}")
    need(MIN_TOP_P <= self.top_p <= 1, f"top_p must lie in (0, 1] (at least {MIN_TOP_P:.3g}), "
         f"got {self.top_p}")
    if self.seed is not None:
      need(_is_int(self.seed), f"seed must be an integer, got {_short(self.seed)}")
      need(SEED_RANGE[0] <= self.seed < SEED_RANGE[1],
           f"seed must lie in [-2**63, 2**64), got {_short(self.seed)}")
      object.__setattr__(self, "seed", int(self.seed))
    need(isinstance(self.ignore_eos, (bool, np.bool_)),
         f"ignore_eos must be a boolean, got {_short(self.ignore_eos)}")
    for name in ("stop_token_ids", "stop"):
      v = getattr(self, name)
      need(isinstance(v, (tuple, list)), f"{name} must be a tuple or list, got {_short(v)}")
      object.__setattr__(self, name, tuple(v))
    for t in self.stop_token_ids:
      need(_is_int(t) and 0 <= t <= INT32_MAX,
           f"stop_token_ids must be integers in [0, {INT32_MAX}], got {_short(t)}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    for s in self.stop:
      need(isinstance(s, str) and s, f"stop must be non-empty strings, got {_short(s)}")


def _short(v, limit: int = 40) -> str:
  """repr(v) cut to `limit` characters, so an error message never echoes a huge value."""
  if _is_int(v) and abs(v) >= 10**limit:  # repr of a huge int is slow and long
    return f"an integer of about {int(v).bit_length() * 0.30103:.0f} digits"
  r = repr(v)
  return r if len(r) <= limit else r[:limit - 3] + "..."


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

