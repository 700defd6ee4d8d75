"""Sampler-vs-learner agreement: do the sampler's logprobs and routing match the full forward?

What: `measure(model, prompts, completions, ...)` runs the learner's forward
(`moe.model.MoEDecoder.__call__`, no cache) on prompt + completion tokens twice -- once replaying
the sampler's recorded routing, once routing freely -- and compares with what the sampler
returned:
  * max / mean |delta logprob| of the sampled tokens (replayed routing), under the same sampling
    transform (temperature, top-k, top-p) applied to the learner's logits;
  * KL(sampler || learner) estimated on the sampled tokens (they are draws from the sampler's
    distribution): k1 = mean(log q - log p) (unbiased, can be negative) and
    k3 = mean(p/q - 1 - log(p/q)) (non-negative);
  * routing agreement: the fraction of (MoE layer, position) whose expert set the free-running
    learner chooses equal to the sampler's;
  * max |delta logprob| without replay, to show what replay buys.

Why: RL objectives take ratios of learner and sampler probabilities; any systematic gap biases
them. This is the measurement the issue asks for, used by the tests and the benchmark.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollout import sampling


def _transform_logprobs(logits, tokens, temperature, top_k, top_p):
  """log q(token) under the sampler's transform of `logits` [T, V] (see rollout.sampling)."""
  t = logits.shape[0]
  if temperature <= 0:
    return np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, None],
                                          -1)[:, 0])
  scaled = logits / temperature
  keep = sampling.filter_mask(scaled, jnp.full((t,), top_k, jnp.int32),
                              jnp.full((t,), top_p, jnp.float32))
  logp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), -1)
  return np.asarray(jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0])


def measure(model, prompts: Sequence[Sequence[int]], completions: Sequence, *,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> dict:
  """Agreement statistics over completions (each a rollout.engine.Completion of its prompt)."""
  dl, dl_free, k1, k3 = [], [], [], []
  agree = total = 0
  for prompt, c in zip(prompts, completions):
    if not c.token_ids:
      continue
    seq = np.asarray(list(prompt) + list(c.token_ids[:-1]), np.int32)[None]
    toks = np.asarray(c.token_ids, np.int32)
    p = len(prompt)
    replay = None
    if c.routing is not None:
      replay = np.concatenate([c.prompt_routing, c.routing], axis=1)[:, None]
    out = model(jnp.asarray(seq), routing=None if replay is None else jnp.asarray(replay))
    free = model(jnp.asarray(seq))
    lp = _transform_logprobs(out.logits[0, p - 1:], jnp.asarray(toks), temperature, top_k, top_p)
    lp_free = _transform_logprobs(free.logits[0, p - 1:], jnp.asarray(toks), temperature, top_k,
                                  top_p)
    lq = np.asarray(c.logprobs, np.float64)
    d = lq - lp
    dl.append(np.abs(d))
    dl_free.append(np.abs(lq - lp_free))
    k1.append(d)
    r = np.exp(-d)
    k3.append(r - 1 + d)
    if replay is not None:
      ours = np.sort(np.asarray(free.routing)[:, 0], -1)
      theirs = np.sort(replay[:, 0], -1)
      same = np.all(ours == theirs, axis=-1)
      agree += int(same.sum())
      total += same.size
  cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)
  dl, dl_free, k1, k3 = cat(dl), cat(dl_free), cat(k1), cat(k3)
  return {
      "tokens": int(dl.size),
      "max_abs_dlogprob": float(dl.max()) if dl.size else 0.0,
      "mean_abs_dlogprob": float(dl.mean()) if dl.size else 0.0,
      "bit_identical_fraction": float(np.mean(dl == 0)) if dl.size else 1.0,
      "kl_k1": float(k1.mean()) if k1.size else 0.0,
      "kl_k3": float(k3.mean()) if k3.size else 0.0,
      "routing_agreement": agree / total if total else 1.0,
      "max_abs_dlogprob_free_routing": float(dl_free.max()) if dl_free.size else 0.0,
  }
