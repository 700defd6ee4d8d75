"""The learner: owns the sharded train state and runs one training step per batch.

One `Learner.train_step(batch)` is one jitted call (state donated) that
  1. runs the no-grad preparation pass on the whole batch with the current parameters (proximal
     logprobs for decoupled PPO, staleness mask, reference logprobs, batch statistics), then
  2. takes `minibatches` optimizer steps, minibatch j being rows {i * minibatches + j}, each with
     gradients accumulated over `micro_batches` micro-batches.
The same code runs single-process and multi-process (`jax.distributed`): every process passes the
same global host batch and `place` hands each device its rows. Across processes `train_step`
first checks that they did (rl.distributed.batch_digest, one small all-gather): processes that
read their batches from files on their own (the pipeline's learner) and disagreed would otherwise
train one model on rows that no single batch holds, silently.

`sampler_weights` returns what weight sync publishes to samplers: the current policy's flat
weights (moe.params.flatten names) cast to the sampler dtype, and the policy version, gathered
whole on every process. `sampler_shards` yields the same weights as the blocks this process
holds (sync.sharded publishes them: no process gathers a tensor).

Every program builds its learner with `build_learner` from one nested `LearnerConfig` (the loss
and optimizer configs inside it, levanter-style), so the in-process pipeline, the multi-process
learner and the benchmarks cannot translate the same settings differently.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from moe import params as params_lib
from moe import sharding
from moe.config import ModelConfig
from moe.model import MoEDecoder
from rl import distributed
from rl import train_state as ts
from rl import train_step as step_lib
from rl.train_step import LossConfig
from rl.train_state import OptimizerConfig, TrainState

@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Everything that says how a learner trains, nested (hashable, gin-bindable at the edge).

  Attributes:
    optimizer: optimizer and learning-rate schedule.
    loss: objective, policy loss, router replay, auxiliary losses. Leave its max_staleness
      unset in RL runs: `build_learner` takes the pipeline's bound.
    micro_batches: gradient-accumulation micro-batches per optimizer step.
    minibatches: optimizer steps per train_step (PPO-style minibatch updates over one batch).
    sampler_dtype: dtype of the weights published to samplers.
  """

  optimizer: OptimizerConfig = OptimizerConfig()
  loss: LossConfig = LossConfig()
  micro_batches: int = 1
  minibatches: int = 1
  sampler_dtype: str = "bfloat16"

  def __post_init__(self):
    if self.micro_batches < 1 or self.minibatches < 1:
      raise ValueError("LearnerConfig: micro_batches and minibatches must be >= 1")


def build_learner(config: LearnerConfig, model_cfg: ModelConfig, *, mesh: Mesh, seed: int = 0,
                  init_model: Optional[MoEDecoder] = None,
                  max_staleness: Optional[int] = None) -> "Learner":
  """The learner `config` describes: the one way programs construct a `Learner`.

  Args:
    config: the learner's settings.
    model_cfg: the model (`init_model`, when given, is of this config).
    mesh: device mesh (moe.sharding.make_mesh).
    seed: parameter initialisation seed (unused with `init_model`).
    init_model: start from these parameters instead of a fresh initialisation.
    max_staleness: the run's staleness bound (PipelineConfig.max_staleness) for the policy
      loss's mask. It is the single source of that number: a config whose loss already names a
      different bound is refused rather than silently overridden.

  Raises:
    ValueError: `config.loss.max_staleness` is set and differs from `max_staleness`.
  """
  loss = config.loss
  if max_staleness is not None:
    if loss.max_staleness is not None and loss.max_staleness != max_staleness:
      raise ValueError(f"LossConfig.max_staleness ({loss.max_staleness}) disagrees with the "
                       f"pipeline's bound ({max_staleness}); set only "
                       "PipelineConfig.max_staleness")
    loss = dataclasses.replace(loss, max_staleness=max_staleness)
  return Learner(model_cfg, mesh=mesh, opt_cfg=config.optimizer, loss_cfg=loss,
                 micro_batches=config.micro_batches, minibatches=config.minibatches, seed=seed,
                 init_model=init_model, sampler_dtype=config.sampler_dtype)


# Jitted step functions by (model config, optimizer config, loss config, micro-batches,
# minibatches, mesh): everything the traced program depends on. Learners with equal keys (a
# restart in the same process, a second learner in a test) reuse the compiled executable.
_STEP_CACHE: dict = {}

_POLICY_FRACTIONS = {"clipped": "frac_clipped", "truncated": "frac_truncated",
                     "is_masked": "frac_is_masked"}


def _finalise(update_metrics: list[dict], prep: dict, objective: str) -> dict:
  """Turns per-minibatch sums into the reported per-step metrics (inside jit)."""
  out = dict(prep)
  total = {}
  for m in update_metrics:
    for k, v in m.items():
      if k == "expert_counts":
        continue
      if k in ("is_weight_max",):
        total[k] = jnp.maximum(total.get(k, v), v)
      elif k in ("grad_norm", "learning_rate"):
        total[k] = v  # of the last minibatch
      else:
        total[k] = total.get(k, 0) + v
  k_mb = len(update_metrics)
  out["loss"] = total["loss"] / k_mb
  out["aux_loss"] = total["aux_loss"] / k_mb
  out["grad_norm"] = total["grad_norm"]
  if "learning_rate" in total:
    out["learning_rate"] = total["learning_rate"]
  if objective == "next_token":
    out["nll"] = total["nll_sum"] / jnp.maximum(prep["tokens"], 1.0)
    return out
  n = jnp.maximum(total["tokens"], 1)
  out["pg_loss"] = total["pg_loss"] / k_mb
  out["kl_loss"] = total["kl_loss"] / k_mb
  out["is_weight_mean"] = total["is_weight_sum"] / n
  out["is_weight_max"] = total["is_weight_max"]
  for src, dst in _POLICY_FRACTIONS.items():
    out[dst] = total[src] / n
  if "routing_agree_sum" in total:
    out["routing_agreement"] = total["routing_agree_sum"] / jnp.maximum(
        total["routing_tokens"], 1.0)
  return out


class Learner:
  """Sharded train state + jitted train step.

  Programs construct one with `build_learner`; the constructor's plain arguments are for the
  unit tests of the learner itself.

  Args:
    model_cfg: the model (ModelConfig.dtype is the compute dtype; param_dtype should be float32
      for fp32 master weights).
    mesh: device mesh (moe.sharding.make_mesh).
    opt_cfg: optimizer and schedule.
    loss_cfg: objective, policy loss, router replay, staleness bound.
    micro_batches: gradient-accumulation micro-batches per optimizer step.
    minibatches: optimizer steps per train_step (PPO-style minibatch updates over one batch).
    seed: parameter initialisation seed.
    init_model: start from these parameters instead of a fresh initialisation.
    sampler_dtype: dtype of the published sampler weights.
  """

  def __init__(self, model_cfg: ModelConfig, *, mesh: Mesh,
               opt_cfg: OptimizerConfig = OptimizerConfig(),
               loss_cfg: LossConfig = LossConfig(), micro_batches: int = 1,
               minibatches: int = 1, seed: int = 0, init_model: Optional[MoEDecoder] = None,
               sampler_dtype: str = "bfloat16"):
    if micro_batches < 1 or minibatches < 1:
      raise ValueError("micro_batches and minibatches must be >= 1")
    self.model_cfg = model_cfg
    self.mesh = mesh
    self.opt_cfg = opt_cfg
    self.loss_cfg = loss_cfg
    self.micro_batches = micro_batches
    self.minibatches = minibatches
    self.sampler_dtype = jnp.dtype(sampler_dtype)
    self.tx = ts.make_optimizer(opt_cfg)
    self.schedule = ts.make_schedule(opt_cfg)
    with jax.set_mesh(mesh):
      if init_model is None:
        self.graphdef, self.state, self.shardings = ts.create(model_cfg, self.tx, mesh, seed)
      else:
        self.graphdef, self.state, self.shardings = ts.from_model(init_model, self.tx, mesh)
    self.ref_params = None
    if loss_cfg.objective == "policy" and loss_cfg.policy.kl_coef > 0:
      self.set_reference(self.state.params)
    key = (model_cfg, opt_cfg, loss_cfg, micro_batches, minibatches, mesh)
    if key not in _STEP_CACHE:
      _STEP_CACHE[key] = self._build_step()
    self._step_fn = _STEP_CACHE[key]
    self.last_step_time = None
    self._forward_fn = None

  # -- construction -------------------------------------------------------------------------
  def _build_step(self):
    prepare = step_lib.make_prepare(self.graphdef, self.loss_cfg)
    rate = (self.model_cfg.router_bias_update_rate
            if self.model_cfg.router_type == "sigmoid" else 0.0)
    update = step_lib.make_update(self.graphdef, self.tx, self.loss_cfg, self.micro_batches,
                                  self.schedule, router_bias_rate=rate)
    k_mb = self.minibatches
    objective = self.loss_cfg.objective

    def step(state: TrainState, batch: dict, ref_params: Any):
      extra, prep_metrics = prepare(state, batch, ref_params)
      full = dict(batch, **extra)
      n = full["tokens"].shape[0]
      per_mb = []
      for j in range(k_mb):
        mb = jax.tree.map(lambda x: x.reshape((n // k_mb, k_mb) + x.shape[1:])[:, j], full)
        state, m = update(state, mb)
        per_mb.append(m)
      metrics = _finalise(per_mb, prep_metrics, objective)
      metrics["input_tokens"] = jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)
      metrics["step"] = state.step
      metrics["policy_version"] = state.policy_version
      return state, metrics

    return jax.jit(step, donate_argnums=(0,), out_shardings=(self.shardings, None))

  def set_reference(self, params_state: Any) -> None:
    """Uses a copy of `params_state` (an nnx.State of Params) as the KL reference policy."""
    self.ref_params = jax.tree.map(jnp.copy, params_state)

  # -- data placement ------------------------------------------------------------------------
  def place(self, batch: Mapping[str, np.ndarray], process_local: bool = False) -> dict:
    """Host batch -> global arrays sharded over the batch axes (rows split across devices).

    With `process_local=False` every process passes the same global batch and each device takes
    its rows. With `process_local=True` each process passes only its own rows (the global batch
    is the processes' rows concatenated in process order), as hosts of a cluster would.
    """
    local_rows = next(iter(batch.values())).shape[0]
    rows = local_rows * (jax.process_count() if process_local else 1)
    n_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    need = n_shards * self.micro_batches * self.minibatches
    if rows % need:
      raise ValueError(f"batch of {rows} rows must be a multiple of batch shards ({n_shards}) x "
                       f"micro_batches ({self.micro_batches}) x minibatches "
                       f"({self.minibatches}) = {need}")
    out = {}
    for name, arr in batch.items():
      arr = np.asarray(arr)
      sh = NamedSharding(self.mesh, sharding.batch_spec(arr.ndim))
      if process_local:
        out[name] = jax.make_array_from_process_local_data(sh, arr)
      else:
        out[name] = jax.make_array_from_callback(arr.shape, sh, lambda idx, a=arr: a[idx])
    return out

  # -- training ------------------------------------------------------------------------------
  def train_step(self, batch: Mapping[str, np.ndarray], process_local: bool = False) -> dict:
    """One training step on a host batch; returns metrics as Python floats / numpy arrays.

    `tokens_per_s` counts every non-padding token processed (prompts included) over the wall
    time of the jitted step (the first call includes compilation); `tokens` counts trained ones.
    """
    self._check_batch(batch)
    if not process_local and jax.process_count() > 1:
      self._check_same_batch(batch)
    placed = self.place(batch, process_local)
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.state, metrics = self._step_fn(self.state, placed, self.ref_params)
    metrics = jax.device_get(metrics)
    dt = time.perf_counter() - t0
    self.last_step_time = dt
    out = {k: (np.asarray(v) if np.ndim(v) else float(v)) for k, v in metrics.items()}
    out["tokens_per_s"] = out["input_tokens"] / dt
    out["step_time_s"] = dt
    return out

  def _check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
    need = ["tokens", "positions", "segment_ids", "loss_mask"]
    if self.loss_cfg.objective == "policy":
      need += ["behaviour_logprobs", "policy_versions", "advantages"]
      if self.loss_cfg.replay != "off" and "routing" not in batch:
        raise ValueError(f"router replay {self.loss_cfg.replay!r} needs a 'routing' field "
                         "(set LossConfig.replay='off' for trajectories without routing)")
    missing = [k for k in need if k not in batch]
    if missing:
      raise ValueError(f"batch lacks fields {missing}")

  def _check_same_batch(self, batch: Mapping[str, np.ndarray]) -> None:
    """Raises ValueError unless every process passed this same global batch."""
    digests = multihost_utils.process_allgather(distributed.batch_digest(batch))
    differ = distributed.mismatched_processes(list(np.asarray(digests)))
    if differ:
      raise ValueError(f"learner step {self.step + 1}: processes {differ} passed a different "
                       "global batch than process 0; every process must pass the same batch "
                       "(or its own rows with process_local=True)")

  # -- views of the state --------------------------------------------------------------------
  @property
  def step(self) -> int:
    return int(jax.device_get(self.state.step))

  @property
  def policy_version(self) -> int:
    return int(jax.device_get(self.state.policy_version))

  def model(self) -> MoEDecoder:
    """The current policy as a model (shares the state's arrays; do not mutate)."""
    return nnx.merge(self.graphdef, self.state.params, self.state.rest)

  def forward(self, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, T, V], routing [moe_layers, B, T, k]) of the current policy (jitted; for
    evaluation and in-process sampling)."""
    if self._forward_fn is None:
      def fwd(state, tokens):
        out = nnx.merge(self.graphdef, state.params, state.rest)(tokens)
        return out.logits, out.routing
      self._forward_fn = jax.jit(fwd)
    with jax.set_mesh(self.mesh):
      logits, routing = self._forward_fn(self.state, jnp.asarray(tokens, jnp.int32))
    return np.asarray(jax.device_get(logits)), np.asarray(jax.device_get(routing))

  def sampler_weights(self, dtype: Optional[str] = None) -> tuple[dict, int]:
    """(flat weights in the sampler dtype as numpy arrays, policy version) for weight sync.

    Names are moe.params.flatten names; router biases stay float32 (they select experts and are
    not matmul weights). Works on multi-process meshes (arrays are all-gathered).
    """
    dt = jnp.dtype(dtype) if dtype is not None else self.sampler_dtype
    flat = params_lib.flatten(self.model(), to_numpy=False)
    biases = {k for k in flat if k.endswith("router/bias")}
    cast = jax.jit(lambda t: {k: (v if k in biases else v.astype(dt)) for k, v in t.items()})
    with jax.set_mesh(self.mesh):
      flat = cast(flat)
    out = {}
    for k, v in flat.items():
      if not v.is_fully_addressable:
        v = multihost_utils.process_allgather(v, tiled=True)
      out[k] = np.asarray(jax.device_get(v))
    return out, self.policy_version

  def sampler_shards(self, dtype: Optional[str] = None):
    """(blocks, policy version): the weights of `sampler_weights`, as the blocks this process
    holds, for sharded publishing (sync.sharded.ShardedPublisher).

    `blocks` yields (name, box, global shape, numpy block) one at a time, sorted by name, for
    every addressable shard of every tensor that is its block's first replica (`replica_id`
    0), so across processes each block comes exactly once; `box` is the block's
    (start, stop) per dimension. Nothing is gathered: a block is copied to the host only when
    it is reached, and each tensor is cast to the sampler dtype on its own devices just before
    its blocks (one tensor's cast copy at a time). Consume it before the next train_step.
    """
    dt = jnp.dtype(dtype) if dtype is not None else self.sampler_dtype
    flat = params_lib.flatten(self.model(), to_numpy=False)
    version = self.policy_version

    def blocks():
      for name in sorted(flat):
        v = flat[name]
        if not name.endswith("router/bias") and v.dtype != dt:
          with jax.set_mesh(self.mesh):
            v = _cast(v, dt)
        for shard in v.addressable_shards:
          if shard.replica_id:
            continue
          box = tuple(sl.indices(d)[:2] for sl, d in zip(shard.index, v.shape))
          yield name, box, tuple(v.shape), np.asarray(shard.data)
        del v

    return blocks(), version


# A cast on the array's own devices, keeping its sharding (sampler_shards).
_cast = jax.jit(lambda x, dt: x.astype(dt), static_argnums=1)
