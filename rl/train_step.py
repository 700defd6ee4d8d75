"""Jitted learner computations: the no-grad preparation pass and the sharded update step.

Batches are dicts of [N, T] arrays in *input* alignment, exactly as packed by the pipelines:
  tokens, positions, segment_ids (0 = padding), loss_mask (1 on the model's own tokens);
RL batches add behaviour_logprobs (sampler logprob of the input token at t), policy_versions
(the policy version that sampled token t), advantages (the episode's advantage on each token) and
optionally routing [N, T, moe_layers, k] recorded by the sampler.

`prepare` (no gradients, learner parameters before the update) turns this into the target-aligned
arrays the loss needs: the trained-token mask after the staleness bound, the proximal logprobs
(decoupled PPO), reference logprobs (KL penalty) and batch statistics (staleness histogram,
KL(sampler || learner), importance weights).

`update` takes one optimizer step on a minibatch: the minibatch is split into `micro_batches`
interleaved micro-batches (row i*M + j goes to micro-batch j, which keeps each micro-batch evenly
spread over the batch shards), gradients are accumulated with `lax.scan`, clipped and applied.
The state is donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe import router as router_lib
from rl import objectives
from rl.objectives import PolicyLossConfig
from rl.train_state import TrainState

OBJECTIVES = ("next_token", "policy")
REPLAY_MODES = ("on", "off", "proximal")
# Reductions of per-micro-batch metrics that are not sums.
_MAX_METRICS = ("is_weight_max",)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """What the learner optimises (hashable: a static argument of the jitted functions).

  Attributes:
    objective: "next_token" (continual pre-training) or "policy" (RL).
    policy: the policy-loss configuration (objective "policy").
    replay: router replay of recorded routing: "on" (proximal and gradient passes), "off"
      (neither) or "proximal" (the proximal pass only).
    max_staleness: tokens sampled by a policy more than this many versions older than the
      learner are dropped from the loss (and counted); None: no bound. An RL run does not set
      it here: `rl.learner.build_learner` fills it from the pipeline's bound
      (PipelineConfig.max_staleness), so the rollouts' admission, the batcher and this mask
      share one number.
    staleness_bins: histogram bins of the version lag (the last bin collects larger lags).
    aux_loss: add the model's router auxiliary losses.
  """

  objective: str = "next_token"
  policy: PolicyLossConfig = PolicyLossConfig()
  replay: str = "on"
  max_staleness: Optional[int] = None
  staleness_bins: int = 8
  aux_loss: bool = True

  def __post_init__(self):
    if self.objective not in OBJECTIVES:
      raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
    if self.replay not in REPLAY_MODES:
      raise ValueError(f"replay must be one of {REPLAY_MODES}, got {self.replay!r}")
    if (self.max_staleness is not None and self.max_staleness < 0) or self.staleness_bins < 2:
      raise ValueError("need max_staleness >= 0 and staleness_bins >= 2")


def _routing_for_model(routing: Optional[jax.Array]) -> Optional[jax.Array]:
  """[N, T, L, k] pipeline layout -> [L, N, T, k] model layout."""
  return None if routing is None else jnp.transpose(routing, (2, 0, 1, 3))


def _forward(graphdef, params, rest, batch, replay: bool):
  model = nnx.merge(graphdef, params, rest)
  routing = _routing_for_model(batch.get("routing")) if replay else None
  seg = batch["segment_ids"]
  out = model(batch["tokens"], positions=batch["positions"], segment_ids=seg, routing=routing,
              token_mask=(seg > 0).astype(jnp.float32))
  logp = objectives.token_logprobs(out.logits, objectives.shift_left(batch["tokens"]))
  return model, out, logp


def routing_agreement(chosen: jax.Array, recorded: jax.Array, num_experts: int,
                      token_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum over tokens of |chosen ∩ recorded| / k averaged over layers, token count).

  chosen: [L, N, T, k] from the learner's router; recorded: [N, T, L, k] from the sampler.
  """
  rec = _routing_for_model(recorded)
  a = jax.nn.one_hot(chosen.astype(jnp.int32), num_experts).sum(-2)
  b = jax.nn.one_hot(rec.astype(jnp.int32), num_experts).sum(-2)
  k = chosen.shape[-1]
  per_token = jnp.mean(jnp.sum(jnp.minimum(a, b), -1), 0) / k  # [N, T]
  m = token_mask.astype(jnp.float32)
  return jnp.sum(per_token * m), jnp.sum(m)


def make_prepare(graphdef: nnx.GraphDef, loss_cfg: LossConfig):
  """Returns prepare(state, batch, ref_params) -> (extra target-aligned arrays, metrics).

  `ref_params` is the reference policy's nnx.Param state (or None without a KL penalty).
  """

  def prepare(state: TrainState, batch: dict, ref_params: Any):
    seg = batch["segment_ids"]
    mask = objectives.target_mask(batch["loss_mask"], seg)
    extra, metrics = {}, {}
    if loss_cfg.objective == "next_token":
      extra["mask"] = mask
      metrics["tokens"] = jnp.sum(mask)
      return extra, metrics
    lag = state.policy_version - objectives.shift_left(batch["policy_versions"])
    lag = jnp.maximum(lag, 0)
    if loss_cfg.max_staleness is None:
      stale = jnp.zeros(mask.shape, bool)
    else:
      stale = (lag > loss_cfg.max_staleness) & (mask > 0)
    hist = jnp.bincount(jnp.minimum(lag, loss_cfg.staleness_bins - 1).reshape(-1),
                        weights=mask.reshape(-1), length=loss_cfg.staleness_bins)
    mask = mask * (1.0 - stale.astype(jnp.float32))
    replay = loss_cfg.replay in ("on", "proximal")
    _, _, prox = _forward(graphdef, state.params, state.rest, batch, replay)
    prox = jax.lax.stop_gradient(prox)
    extra["mask"] = mask
    extra["prox_logp"] = prox
    if loss_cfg.policy.kl_coef > 0:
      _, _, ref = _forward(graphdef, ref_params, state.rest, batch, replay)
      extra["ref_logp"] = jax.lax.stop_gradient(ref)
    behav = objectives.shift_left(batch["behaviour_logprobs"])
    n = jnp.maximum(jnp.sum(mask), 1.0)
    log_w = jnp.clip(prox - behav, -20.0, 20.0)
    metrics.update({
        "tokens": jnp.sum(mask),
        "stale_tokens": jnp.sum(stale),
        "staleness_hist": hist,
        "sampler_kl": objectives.sampler_kl_k3(prox, behav, mask) / n,
        "prox_is_weight_mean": jnp.sum(jnp.exp(log_w) * mask) / n,
    })
    return extra, metrics

  return prepare


def make_update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_cfg: LossConfig,
                micro_batches: int, schedule: Optional[optax.Schedule] = None,
                router_bias_rate: float = 0.0):
  """Returns update(state, batch) -> (state, metrics), one optimizer step on a minibatch.

  `batch` holds the pipeline arrays plus `prepare`'s outputs (mask, prox_logp, ref_logp), all
  with the same leading row count N (a multiple of `micro_batches`).
  """
  m_count = int(micro_batches)
  pcfg = loss_cfg.policy

  def loss_fn(params, rest, mb):
    replay = loss_cfg.replay == "on"
    model, out, logp = _forward(graphdef, params, rest, mb, replay)
    seg = mb["segment_ids"]
    metrics = {}
    if loss_cfg.objective == "next_token":
      loss = jnp.sum(-logp * mb["weights"])
      metrics["nll_sum"] = jnp.sum(-logp * mb["mask"])
    else:
      behav = objectives.shift_left(mb["behaviour_logprobs"])
      adv = objectives.shift_left(mb["advantages"])
      loss, metrics = objectives.policy_loss(logp, mb["prox_logp"], behav, adv, mb["mask"],
                                             mb["weights"], seg, pcfg, mb.get("ref_logp"))
      if not replay and "routing" in mb:
        agree, n = routing_agreement(out.routing, mb["routing"], model.config.num_experts,
                                     seg > 0)
        metrics["routing_agree_sum"] = agree
        metrics["routing_tokens"] = n
    aux = model.aux_loss(out) / m_count if loss_cfg.aux_loss else jnp.zeros(())
    metrics["aux_loss"] = aux
    metrics["objective"] = loss
    metrics["expert_counts"] = out.aux["expert_counts"]
    return loss + aux, metrics

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def update(state: TrainState, batch: dict):
    mask = batch["mask"]
    agg = "token" if loss_cfg.objective == "next_token" else pcfg.aggregation
    batch = dict(batch, weights=objectives.aggregation_weights(mask, batch["segment_ids"], agg))
    n = batch["tokens"].shape[0]
    if n % m_count:
      raise ValueError(f"minibatch of {n} rows does not split into {m_count} micro-batches")

    def to_micro(x):
      x = x.reshape((n // m_count, m_count) + x.shape[1:])
      return jnp.swapaxes(x, 0, 1)

    micro = jax.tree.map(to_micro, batch)
    zeros = jax.tree.map(jnp.zeros_like, state.params)

    def body(acc, mb):
      (loss, metrics), grads = grad_fn(state.params, state.rest, mb)
      return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

    grads, (losses, metrics) = jax.lax.scan(body, zeros, micro)
    metrics = {k: (jnp.max(v, 0) if k in _MAX_METRICS else jnp.sum(v, 0))
               for k, v in metrics.items()}
    metrics["loss"] = jnp.sum(losses)
    metrics["grad_norm"] = optax.tree.norm(grads)
    if schedule is not None:
      metrics["learning_rate"] = schedule(state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rest = state.rest
    if router_bias_rate > 0:
      rest = _update_router_biases(graphdef, params, rest, metrics["expert_counts"],
                                   router_bias_rate)
    new_state = state.replace(params=params, rest=rest, opt_state=opt_state,
                              step=state.step + 1, policy_version=state.policy_version + 1)
    return new_state, metrics

  return update


def _update_router_biases(graphdef, params, rest, expert_counts, rate):
  """Aux-loss-free balancing of sigmoid routers from this step's expert counts [L, E]."""
  model = nnx.merge(graphdef, params, rest)
  moe_layers = [layer for layer in model.layers if layer.is_moe]
  for i, layer in enumerate(moe_layers):
    if layer.ffn.router.bias is not None:
      router_lib.update_bias(layer.ffn.router, expert_counts[i], rate)
  return nnx.state(model, nnx.Not(nnx.Param))
