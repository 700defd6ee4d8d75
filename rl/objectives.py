"""Training objectives: next-token loss and the asynchronous-RL policy-gradient losses.

Everything here is a pure function of arrays so it can be checked against hand computations.
Arrays are "target aligned": entry [b, t] describes the token predicted at position t (the input
token at t + 1), so `logp[b, t]` is the learner's log-probability of that token and `mask[b, t]`
says whether it is trained.

Aggregation is expressed as per-token weights computed once over a whole optimizer minibatch
(`aggregation_weights`), so that accumulating gradients over micro-batches gives exactly the
full-minibatch loss: the loss is always `sum(per_token_loss * weight)`.

Policy loss (one function covers GRPO, GSPO and PPO, chosen by `PolicyLossConfig`):
  * behaviour policy mu (the sampler, possibly several versions old) produced the tokens;
  * proximal policy pi_prox = the learner before this update (decoupled PPO, Hilton et al. 2021);
    with `decoupled=False` the behaviour policy serves as the old policy (plain PPO);
  * ratio r = pi_theta / pi_prox, per token ("token") or the length-normalised sequence ratio
    exp(mean_t log r) ("sequence", GSPO), clipped to [1 - eps_low, 1 + eps_high];
  * the behaviour importance weight w = pi_prox / mu corrects the staleness of mu; it is truncated
    at `is_cap` ("truncate") or tokens whose w leaves [is_low, is_high] are masked ("mask");
  * optional KL penalty to a reference policy with the k3 estimator (Schulman 2020).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token", "sequence")
IS_MODES = ("none", "truncate", "mask")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """Selects and parameterises the policy loss. Hashable, so it can be a static jit argument.

  Attributes:
    ratio_level: "token" (PPO / GRPO) or "sequence" (GSPO: one ratio per episode).
    clip_eps_low: lower clip range of the ratio (1 - eps_low).
    clip_eps_high: upper clip range (1 + eps_high); DAPO-style asymmetric clipping when larger.
    aggregation: "token" (every trained token of the minibatch weighs the same) or "sequence"
      (mean over each episode's tokens, then mean over episodes).
    decoupled: use the learner's pre-update logprobs as the proximal policy (decoupled PPO).
      False: the behaviour logprobs are the old policy (plain PPO).
    is_mode: behaviour importance correction: "none", "truncate" (w = min(w, is_cap)) or "mask"
      (tokens with w outside [is_low, is_high] get no loss).
    is_cap: truncation threshold.
    is_low, is_high: masking thresholds.
    kl_coef: weight of the k3 KL penalty to the reference policy (0 disables it).
  """

  ratio_level: str = "token"
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  aggregation: str = "token"
  decoupled: bool = True
  is_mode: str = "truncate"
  is_cap: float = 2.0
  is_low: float = 0.5
  is_high: float = 2.0
  kl_coef: float = 0.0

  def __post_init__(self):
    if self.ratio_level not in RATIO_LEVELS:
      raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
    if self.is_mode not in IS_MODES:
      raise ValueError(f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}")
    if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
      raise ValueError("clip ranges must satisfy 0 <= eps_low < 1 and eps_high >= 0")
    if not (0 < self.is_low <= 1 <= self.is_high and self.is_cap >= 1):
      raise ValueError("need 0 < is_low <= 1 <= is_high and is_cap >= 1")
    if self.kl_coef < 0:
      raise ValueError("kl_coef must be >= 0")


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log softmax(logits)[targets] in float32: [B, T, V], [B, T] -> [B, T]."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - lse


def shift_left(x: jax.Array, fill=0) -> jax.Array:
  """x[:, 1:] padded with `fill` at the end: turns per-input-token arrays into target-aligned."""
  pad = jnp.full_like(x[:, :1], fill)
  return jnp.concatenate([x[:, 1:], pad], axis=1)


def target_mask(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Target-aligned float mask: the next token is trained and lies in the same (non-pad) segment.

  Args:
    loss_mask: [B, T] 1 where the input token at t was produced by the model (trained).
    segment_ids: [B, T] packing segments, 0 for padding.
  """
  nxt_seg = shift_left(segment_ids)
  same = (nxt_seg == segment_ids) & (segment_ids > 0)
  return (shift_left(loss_mask).astype(bool) & same).astype(jnp.float32)


def _segment_index(segment_ids: jax.Array) -> tuple[jax.Array, int]:
  """Flat ids row * T + segment so each (row, segment) pair is one episode; and the count."""
  b, t = segment_ids.shape
  return (jnp.arange(b)[:, None] * t + segment_ids).reshape(-1), b * t


def segment_sum(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Per-episode sums of x [B, T], broadcast back to every token of the episode."""
  ids, n = _segment_index(segment_ids)
  sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=n)
  return sums[ids].reshape(x.shape)


def aggregation_weights(mask: jax.Array, segment_ids: jax.Array, aggregation: str) -> jax.Array:
  """Per-token weights w with loss = sum(per_token_loss * w) over a whole minibatch.

  token: w = mask / (number of trained tokens). sequence: w = mask / (tokens of the episode *
  number of episodes with a trained token).
  """
  mask = mask.astype(jnp.float32)
  if aggregation == "token":
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  if aggregation == "sequence":
    per_seq = segment_sum(mask, segment_ids)
    ids, n = _segment_index(segment_ids)
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=n)
    n_seqs = jnp.sum(counts > 0)
    return mask / jnp.maximum(per_seq, 1.0) / jnp.maximum(n_seqs, 1).astype(jnp.float32)
  raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array):
  """Weighted cross-entropy: sum(-log p(target) * weights). Returns (loss, per-token nll)."""
  nll = -token_logprobs(logits, targets)
  return jnp.sum(nll * weights), nll


def group_advantages(rewards: np.ndarray, valid: Optional[np.ndarray] = None, *,
                     normalize_std: bool = True, negative_scale: float = 1.0,
                     eps: float = 1e-6) -> np.ndarray:
  """GRPO advantages of one group of attempts at the same prompt.

  A_i = r_i - mean(r) (divided by std(r) + eps when `normalize_std`), mean and std over the valid
  attempts only. Invalid attempts (infrastructure failures) get advantage 0 and must also be
  masked out of the loss: they are never scored as reward 0.

  `negative_scale` multiplies the negative advantages (below-mean attempts): 1 is GRPO, 0 trains
  on the better-than-average attempts only (rejection-sampling fine-tuning with GRPO's weights),
  values between damp the push away from failed attempts, which dominate a group when few
  attempts pass and whose tokens mostly match the passing ones'.
  """
  if not 0.0 <= negative_scale <= 1.0:
    raise ValueError(f"negative_scale must lie in [0, 1], got {negative_scale}")
  r = np.asarray(rewards, np.float64)
  v = np.ones(r.shape, bool) if valid is None else np.asarray(valid, bool)
  out = np.zeros(r.shape, np.float32)
  if v.sum() == 0:
    return out
  mean = r[v].mean()
  adv = r - mean
  if normalize_std:
    adv = adv / (r[v].std() + eps)
  adv = np.where(adv < 0, adv * negative_scale, adv)
  out[v] = adv[v]
  return out


def behaviour_weights(prox_logp: jax.Array, behav_logp: jax.Array, mask: jax.Array,
                      cfg: PolicyLossConfig):
  """Importance weights pi_prox / mu with truncation or masking.

  Returns (weights used in the loss [B, T], mask after IS masking, raw weights, truncated flags,
  masked flags); all flags are limited to `mask`.
  """
  log_w = jnp.clip(prox_logp - behav_logp, -20.0, 20.0)
  raw = jnp.exp(log_w)
  on = mask > 0
  truncated = jnp.zeros_like(on)
  masked = jnp.zeros_like(on)
  w = raw
  if cfg.is_mode == "truncate":
    truncated = on & (raw > cfg.is_cap)
    w = jnp.minimum(raw, cfg.is_cap)
  elif cfg.is_mode == "mask":
    masked = on & ((raw < cfg.is_low) | (raw > cfg.is_high))
    w = jnp.where(masked, 0.0, raw)
  new_mask = mask * (1.0 - masked.astype(mask.dtype))
  return jax.lax.stop_gradient(w), new_mask, raw, truncated, masked


def k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(pi || ref) on samples of pi: exp(d) - d - 1, d = ref - logp."""
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def policy_loss(logp: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array,
                advantages: jax.Array, mask: jax.Array, weights: jax.Array,
                segment_ids: jax.Array, cfg: PolicyLossConfig,
                ref_logp: Optional[jax.Array] = None):
  """The clipped, importance-corrected policy-gradient loss.

  Args:
    logp: learner logprobs under the parameters being differentiated [B, T].
    prox_logp: proximal (pre-update learner) logprobs; ignored unless cfg.decoupled.
    behav_logp: sampler logprobs.
    advantages: per-token advantages (the episode's advantage on each of its tokens).
    mask: trained tokens (float), staleness already applied.
    weights: aggregation weights from `aggregation_weights` (computed with `mask`).
    segment_ids: packing segments (for sequence-level ratios).
    cfg: PolicyLossConfig.
    ref_logp: reference-policy logprobs for the KL penalty (needed when cfg.kl_coef > 0).

  Returns:
    (loss scalar, metrics dict of sums over the tokens of this call: "pg_loss", "kl_loss",
    "clipped", "truncated", "is_masked", "is_weight_sum", "is_weight_max", "tokens").
  """
  logp = logp.astype(jnp.float32)
  old = prox_logp if cfg.decoupled else behav_logp
  old = jax.lax.stop_gradient(old.astype(jnp.float32))
  if cfg.decoupled:
    w, mask_is, raw, truncated, masked = behaviour_weights(old, behav_logp, mask, cfg)
  else:
    w = jnp.ones_like(logp)
    mask_is, raw = mask, jnp.ones_like(logp)
    truncated = masked = jnp.zeros(logp.shape, bool)
  # IS masking removes tokens from the loss but keeps the aggregation denominator unchanged, so
  # masking never inflates the remaining tokens' weight.
  eff_weights = jnp.where(masked, 0.0, weights)
  log_ratio = jnp.where(mask > 0, logp - old, 0.0)
  if cfg.ratio_level == "sequence":
    n_tok = jnp.maximum(segment_sum(mask, segment_ids), 1.0)
    seq_log_ratio = segment_sum(log_ratio * mask, segment_ids) / n_tok
    # GSPO-token form: value = the sequence ratio, gradient flows through each token.
    log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp)
    log_ratio = jnp.where(mask > 0, log_ratio, 0.0)
  ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
  clipped_ratio = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
  unclipped = ratio * advantages
  clipped_obj = clipped_ratio * advantages
  per_token = -w * jnp.minimum(unclipped, clipped_obj)
  was_clipped = (clipped_obj < unclipped) & (mask_is > 0)
  pg = jnp.sum(per_token * eff_weights)
  kl = jnp.zeros(())
  if cfg.kl_coef > 0:
    if ref_logp is None:
      raise ValueError("kl_coef > 0 needs reference logprobs")
    kl = jnp.sum(k3(logp, jax.lax.stop_gradient(ref_logp)) * eff_weights)
  loss = pg + cfg.kl_coef * kl
  on = mask > 0
  metrics = {
      "pg_loss": pg,
      "kl_loss": kl,
      "clipped": jnp.sum(was_clipped),
      "truncated": jnp.sum(truncated),
      "is_masked": jnp.sum(masked),
      "is_weight_sum": jnp.sum(jnp.where(on, raw, 0.0)),
      "is_weight_max": jnp.max(jnp.where(on, raw, 0.0)),
      "tokens": jnp.sum(on),
  }
  return loss, metrics


def sampler_kl_k3(learner_logp: jax.Array, behav_logp: jax.Array, mask: jax.Array) -> jax.Array:
  """Sum over tokens of the k3 estimate of KL(sampler || learner) (tokens were drawn from the
  sampler): with r = pi / mu, k3 = r - 1 - log r, unbiased and non-negative."""
  d = jnp.clip(learner_logp - behav_logp, -20.0, 20.0)
  return jnp.sum((jnp.exp(d) - 1.0 - d) * mask)
