"""Routers: which experts each token uses, with what gate weights, and the auxiliary losses.

Two families, chosen by config values:
  * softmax (Mixtral, Qwen-MoE): probabilities = softmax(logits); top-k of the probabilities;
    optionally renormalise the k weights.
  * sigmoid (DeepSeek-V3): scores = sigmoid(logits); top-k of (score + bias), where the bias is a
    non-trained variable nudged towards balanced load ("aux-loss-free"); the gate weights come
    from the scores alone, renormalised, then scaled by routed_scaling_factor.

Router math runs in float32. `jax.lax.top_k` returns the lower index first among equal values, so
ties are broken deterministically.

Replay: given recorded expert indices the router skips the top-k and gathers the gate weights of
exactly those experts from the live scores, so gradients still flow into the router weights.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moe import layers
from moe.config import ModelConfig


class RouterBias(nnx.Variable):
  """Selection bias of the aux-loss-free router: updated by a rule, never by the optimizer."""


class Router(nnx.Module):
  """Computes expert choices and gate weights for flattened tokens."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.router_type = cfg.router_type
    self.k = cfg.num_experts_per_tok
    self.num_experts = cfg.num_experts
    self.norm_topk_prob = cfg.norm_topk_prob
    self.scaling = cfg.routed_scaling_factor
    self.weight = layers.param(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", "exp_router"),
                               std=cfg.init_std, dtype=cfg.jnp_param_dtype)
    if cfg.router_type == "sigmoid":
      self.bias = RouterBias(jnp.zeros((cfg.num_experts,), jnp.float32),
                             logical_axes=("exp_router",))
    else:
      self.bias = None

  def __call__(self, x: jax.Array, routing: Optional[jax.Array] = None,
               token_mask: Optional[jax.Array] = None):
    """Routes tokens.

    Args:
      x: [N, D] tokens.
      routing: optional [N, k] recorded expert indices to replay.
      token_mask: optional [N] weights (1 for real tokens) for the auxiliary losses and counts.

    Returns:
      (indices [N, k] int32, gates [N, k] float32, aux dict with `load_balance_loss`,
      `router_z_loss` and `expert_counts` [E]).
    """
    logits = x.astype(jnp.float32) @ self.weight.get_value().astype(jnp.float32)
    if self.router_type == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
    if routing is None:
      select = scores if self.bias is None else scores + self.bias.get_value()
      _, idx = jax.lax.top_k(jax.lax.stop_gradient(select), self.k)
    else:
      if routing.shape != (x.shape[0], self.k):
        raise ValueError(f"replayed routing has shape {routing.shape}, expected "
                         f"{(x.shape[0], self.k)}")
      idx = routing.astype(jnp.int32)
    gates = jnp.take_along_axis(scores, idx, axis=-1)
    if self.norm_topk_prob:
      gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    gates = gates * self.scaling

    w = jnp.ones((x.shape[0],), jnp.float32) if token_mask is None else token_mask.astype(
        jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    onehot = jax.nn.one_hot(idx, self.num_experts, dtype=jnp.float32).sum(axis=1)  # [N, E]
    counts = jnp.sum(onehot * w[:, None], axis=0)
    frac_tokens = counts / (n * self.k)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    frac_probs = jnp.sum(probs * w[:, None], axis=0) / n
    aux = {
        "load_balance_loss": self.num_experts * jnp.sum(frac_tokens * frac_probs),
        "router_z_loss": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * w) / n,
        "expert_counts": counts,
    }
    return idx, gates, aux


def update_bias(router: Router, expert_counts: jax.Array, rate: float) -> None:
  """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded.

  `expert_counts` [E] are the tokens each expert received in the last batch(es).
  """
  if router.bias is None:
    raise ValueError("update_bias applies to sigmoid routers only")
  counts = expert_counts.astype(jnp.float32)
  err = jnp.mean(counts) - counts
  router.bias.set_value(router.bias.get_value() + rate * jnp.sign(err))
