"""Learner: agreement of sampler and learner, accumulation, mixed precision, a bandit task.

Tolerance policy: quantities that are mathematically equal but computed by differently compiled
programs (a separate forward pass, a different micro-batch split, hence a different float32
summation order) are compared with rtol=1e-5 / atol=1e-6; the CPU's float32 matmuls differ by
about 1e-6 relative between such programs (see /work/shared/verified-here.md).
"""

import dataclasses
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
import pytest

from moe import params
from moe import sharding
from moe.config import ModelConfig
from rl import learner as learner_lib
from rl import objectives
from rl.learner import Learner
from rl.objectives import PolicyLossConfig
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig

CFG = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=16)
CLOSE = dict(rtol=1e-5, atol=1e-6)


def _own_rollouts(learner, rows=4, length=8, seed=0):
  """Sequences scored by the learner's own model (as a perfectly in-sync sampler would)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, (rows, length)).astype(np.int32)
  logits, routing = learner.forward(tokens)
  lp = np.asarray(objectives.token_logprobs(logits[:, :-1], jnp.asarray(tokens[:, 1:])))
  behav = np.zeros((rows, length), np.float32)
  behav[:, 1:] = lp
  return {
      "tokens": tokens,
      "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
      "segment_ids": np.ones((rows, length), np.int32),
      "loss_mask": np.r_[np.zeros(2), np.ones(length - 2)][None].repeat(rows, 0).astype(np.int32),
      "behaviour_logprobs": behav,
      "policy_versions": np.zeros((rows, length), np.int32),
      "advantages": rng.normal(size=(rows, 1)).repeat(length, 1).astype(np.float32),
      "routing": np.transpose(routing, (1, 2, 0, 3)),
  }


def _policy_learner(decoupled, mesh, aux_loss=True, replay="on", **kw):
  loss = LossConfig(objective="policy", replay=replay, aux_loss=aux_loss,
                    policy=PolicyLossConfig(decoupled=decoupled, is_mode="truncate"))
  return Learner(CFG, mesh=mesh, loss_cfg=loss, opt_cfg=OptimizerConfig(learning_rate=1e-2),
                 **kw)


def test_in_sync_sampler_gives_unit_weights_and_plain_ppo():
  mesh = sharding.make_mesh((1, 1, 1, 1))
  dec = _policy_learner(True, mesh, replay="on")
  # Replaying the routing the learner itself would choose must equal not replaying at all.
  plain = _policy_learner(False, mesh, replay="off")
  batch = _own_rollouts(dec)
  md = dec.train_step(batch)
  mp = plain.train_step(batch)
  assert md["is_weight_mean"] == pytest.approx(1.0, rel=1e-5)
  assert md["is_weight_max"] == pytest.approx(1.0, rel=1e-5)
  assert md["frac_truncated"] == 0.0 and md["frac_clipped"] == 0.0
  assert abs(md["sampler_kl"]) < 1e-6
  np.testing.assert_allclose(md["loss"], mp["loss"], **CLOSE)
  assert mp["routing_agreement"] == 1.0 and "routing_agreement" not in md
  wd, wp = params.flatten(dec.model()), params.flatten(plain.model())
  for k in wd:
    np.testing.assert_allclose(wd[k], wp[k], **CLOSE)


def test_micro_batches_match_one_big_batch():
  mesh = sharding.make_mesh((1, 1, 1, 1))  # sharded micro-batching: trainer/multihost tests
  # The router's load-balancing loss is a non-linear function of the whole batch (so it is
  # averaged per micro-batch); without it the objective is exactly additive over micro-batches.
  one = _policy_learner(True, mesh, aux_loss=False, micro_batches=1)
  two = _policy_learner(True, mesh, aux_loss=False, micro_batches=2)
  batch = _own_rollouts(one)
  batch["loss_mask"][1, 3:] = 0  # uneven token counts across micro-batches
  m1, m2 = one.train_step(batch), two.train_step(batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], **CLOSE)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], **CLOSE)
  # Parameters are not compared: Adam's first step is ~lr * sign(g), so elements whose gradient
  # is ~0 turn float32 summation-order noise into visible differences.


def test_staleness_bound_drops_and_counts_tokens():
  mesh = sharding.make_mesh((1, 1, 1, 1))
  learner = Learner(CFG, mesh=mesh, loss_cfg=LossConfig(objective="policy", replay="off",
                                                        max_staleness=1))
  batch = _own_rollouts(learner)
  learner.state = learner.state.replace(policy_version=jnp.asarray(3, jnp.int32))
  batch["policy_versions"][0] = 3  # fresh
  batch["policy_versions"][1] = 2  # lag 1: kept
  batch["policy_versions"][2:] = 0  # lag 3: dropped
  m = learner.train_step(batch)
  trained_per_row = 6
  assert m["stale_tokens"] == 2 * trained_per_row
  assert m["tokens"] == 2 * trained_per_row
  np.testing.assert_array_equal(m["staleness_hist"][:4], [6, 6, 0, 12])
  # The recorded routing is the learner's own, and agreement counts every token (stale ones too).
  assert m["routing_agreement"] == 1.0


def test_build_learner_takes_the_nested_config_and_the_pipelines_bound():
  """build_learner is what every program calls: each setting of the nested config reaches the
  learner; the staleness bound comes from the caller (the pipeline), and with no bound (None)
  no token is dropped however stale."""
  mesh = sharding.make_mesh((1, 1, 1, 1))
  config = learner_lib.LearnerConfig(
      optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      loss=LossConfig(objective="policy", replay="off", aux_loss=False,
                      policy=PolicyLossConfig(clip_eps_high=0.3)),
      micro_batches=2, minibatches=1, sampler_dtype="float32")
  learner = learner_lib.build_learner(config, CFG, mesh=mesh, seed=3, max_staleness=1)
  assert learner.opt_cfg == config.optimizer and learner.micro_batches == 2
  assert learner.loss_cfg == dataclasses.replace(config.loss, max_staleness=1)
  assert learner.sampler_dtype == np.float32
  assert learner_lib.build_learner(config, CFG, mesh=mesh, max_staleness=1).loss_cfg == (
      learner.loss_cfg)  # the same bound named twice is fine
  with pytest.raises(ValueError, match=r"LossConfig.max_staleness \(2\) disagrees"):
    learner_lib.build_learner(
        dataclasses.replace(config, loss=dataclasses.replace(config.loss, max_staleness=2)),
        CFG, mesh=mesh, max_staleness=1)
  unbounded = learner_lib.build_learner(config, CFG, mesh=mesh)
  assert unbounded.loss_cfg.max_staleness is None
  batch = _own_rollouts(unbounded)
  unbounded.state = unbounded.state.replace(policy_version=jnp.asarray(9, jnp.int32))
  m = unbounded.train_step(batch)
  assert m["stale_tokens"] == 0 and m["tokens"] == float(np.sum(batch["loss_mask"]))


def test_routing_agreement_counts_what_the_sampler_chose_differently():
  """Row 0 records the k experts the learner did not choose (agreement 0), row 1 swaps one of
  its two for an unchosen one (1/2), rows 2-3 record the learner's own: (0 + 1/2 + 1 + 1) / 4."""
  learner = _policy_learner(True, sharding.make_mesh((1, 1, 1, 1)), replay="off")
  batch = _own_rollouts(learner)
  own = batch["routing"]  # [N, T, L, k]
  batch["routing"] = own.copy()
  others = np.array([[e for e in range(CFG.num_experts) if e not in chosen]
                     for chosen in own[0].reshape(-1, CFG.num_experts_per_tok)])
  batch["routing"][0] = others.reshape(own[0].shape)
  batch["routing"][1, ..., 1] = np.array(
      [[e for e in range(CFG.num_experts) if e not in chosen][0]
       for chosen in own[1].reshape(-1, CFG.num_experts_per_tok)]).reshape(own.shape[1:3])
  m = learner.train_step(batch)
  assert m["routing_agreement"] == pytest.approx((0 + 0.5 + 1 + 1) / 4, abs=1e-6)


def test_bf16_compute_keeps_fp32_master_weights():
  cfg = CFG.replace(dtype="bfloat16")
  learner = Learner(cfg, mesh=sharding.make_mesh((1, 1, 1, 1)))
  rows, length = 2, 8
  batch = {"tokens": np.ones((rows, length), np.int32),
           "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
           "segment_ids": np.ones((rows, length), np.int32),
           "loss_mask": np.ones((rows, length), np.int32)}
  m = learner.train_step(batch)
  assert np.isfinite(m["loss"])
  assert learner.state.params["embed"].get_value().dtype == jnp.float32
  weights, version = learner.sampler_weights()
  assert weights["embed"].dtype == jnp.bfloat16 and version == 1


def test_missing_fields_rejected():
  learner = _policy_learner(True, sharding.make_mesh((1, 1, 1, 1)))
  # The fields are checked before anything runs, so the batch needs no forward pass of its own.
  rows, length = 4, 8
  batch = {k: np.zeros((rows, length), np.int32)
           for k in ("tokens", "positions", "segment_ids", "loss_mask", "policy_versions")}
  batch.update(behaviour_logprobs=np.zeros((rows, length), np.float32),
               advantages=np.zeros((rows, length), np.float32))
  with pytest.raises(ValueError, match="routing"):
    learner.train_step(batch)
  with pytest.raises(ValueError, match="multiple"):
    Learner(CFG, mesh=sharding.make_mesh((2, 1, 1, 1))).place({"tokens": np.zeros((3, 4))})


def test_bandit_expected_reward_rises():
  """The "action" is the first generated token; reward 1 for tokens in TARGET. Attempts are
  sampled from the current policy with jax.random, scored, grouped (GRPO) and trained on."""
  target = np.array([3, 7, 11])
  prompt = 1
  group, groups = 8, 2
  learner = Learner(CFG, mesh=sharding.make_mesh((1, 1, 1, 1)),
                    opt_cfg=OptimizerConfig(learning_rate=3e-3, clip_norm=1.0),
                    loss_cfg=LossConfig(objective="policy", replay="on"))
  key = jax.random.key(0)

  def expected_reward():
    logits = learner.forward(np.array([[prompt]]))[0][0, -1]
    return float(jnp.sum(jax.nn.softmax(logits)[target]))

  start = expected_reward()
  rewards_seen = []
  for _ in range(12):
    key, sub = jax.random.split(key)
    n = group * groups
    logits = learner.forward(np.full((n, 1), prompt))[0][:, -1]
    actions = np.asarray(jax.random.categorical(sub, logits))
    logp = np.asarray(jax.nn.log_softmax(logits))[np.arange(n), actions]
    reward = np.isin(actions, target).astype(np.float64)
    rewards_seen.append(reward.mean())
    adv = np.concatenate([objectives.group_advantages(reward[g * group:(g + 1) * group])
                          for g in range(groups)])
    tokens = np.stack([np.full(n, prompt), actions], 1).astype(np.int32)
    _, routing = learner.forward(tokens)
    learner.train_step({
        "tokens": tokens,
        "positions": np.tile(np.arange(2, dtype=np.int32), (n, 1)),
        "segment_ids": np.ones((n, 2), np.int32),
        "loss_mask": np.tile(np.array([0, 1], np.int32), (n, 1)),
        "behaviour_logprobs": np.stack([np.zeros(n), logp], 1).astype(np.float32),
        "policy_versions": np.full((n, 2), learner.policy_version, np.int32),
        "advantages": np.repeat(adv[:, None], 2, 1).astype(np.float32),
        "routing": np.transpose(np.asarray(routing), (1, 2, 0, 3)),
    })
  end = expected_reward()
  assert end > start + 0.3, (start, end, rewards_seen)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
