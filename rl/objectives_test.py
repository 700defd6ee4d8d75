"""Objectives against hand-computed values.

Tolerance policy: everything here is float32 arithmetic on a handful of numbers; hand values are
computed in float64, so comparisons use rtol=1e-6 / atol=1e-6 (a few float32 ulps).
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import objectives
from rl.objectives import PolicyLossConfig

TOL = dict(rtol=1e-6, atol=1e-6)


def test_group_advantages_std_normalised():
  adv = objectives.group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), normalize_std=True, eps=0.0)
  np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, 1.0], **TOL)
  adv = objectives.group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), normalize_std=False)
  np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5], **TOL)


def test_group_advantages_skip_infra_failures():
  # The failed attempt neither counts as reward 0 nor gets an advantage.
  adv = objectives.group_advantages(np.array([1.0, 0.0, np.nan, 0.0]),
                                    valid=np.array([True, True, False, True]),
                                    normalize_std=True, eps=0.0)
  std = math.sqrt(2.0 / 9.0)
  np.testing.assert_allclose(adv, [(2 / 3) / std, (-1 / 3) / std, 0.0, (-1 / 3) / std], **TOL)
  assert np.all(objectives.group_advantages(np.ones(3), normalize_std=True) == 0)


def test_group_advantages_negative_scale():
  # One pass in four: the failures' advantages are scaled, the pass keeps its own.
  r = np.array([1.0, 0.0, 0.0, 0.0])
  full = objectives.group_advantages(r, eps=0.0)
  half = objectives.group_advantages(r, eps=0.0, negative_scale=0.5)
  only_pos = objectives.group_advantages(r, eps=0.0, negative_scale=0.0)
  np.testing.assert_allclose(half, [full[0]] + [0.5 * a for a in full[1:]], **TOL)
  np.testing.assert_allclose(only_pos, [full[0], 0.0, 0.0, 0.0], **TOL)
  assert full[1] < 0
  with pytest.raises(ValueError, match="negative_scale"):
    objectives.group_advantages(r, negative_scale=1.5)


def _hand_example():
  """One packed row: episode 1 (segment 1) trains 2 tokens with A=+1, episode 2 trains 1 token
  with A=-1; log-ratios 0.1, 0.3, -0.5 against the old policy."""
  old = jnp.array([[-1.0, -2.0, -1.5, 0.0]])
  logp = old + jnp.array([[0.1, 0.3, -0.5, 0.0]])
  adv = jnp.array([[1.0, 1.0, -1.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  seg = jnp.array([[1, 1, 2, 0]])
  return logp, old, adv, mask, seg


@pytest.mark.parametrize("aggregation,expected", [
    # t0: r=e^0.1 unclipped -> -e^0.1; t1: r=e^0.3 clipped at 1.2 -> -1.2;
    # t2: A<0, r=e^-0.5 below 0.8 -> pessimistic clipped term 0.8.
    ("token", (-math.exp(0.1) - 1.2 + 0.8) / 3),
    ("sequence", ((-math.exp(0.1) - 1.2) / 2 + 0.8) / 2),
])
def test_grpo_loss_hand_computed(aggregation, expected):
  logp, old, adv, mask, seg = _hand_example()
  cfg = PolicyLossConfig(aggregation=aggregation, decoupled=False, clip_eps_low=0.2,
                         clip_eps_high=0.2)
  w = objectives.aggregation_weights(mask, seg, aggregation)
  loss, m = objectives.policy_loss(logp, old, old, adv, mask, w, seg, cfg)
  np.testing.assert_allclose(float(loss), expected, **TOL)
  assert int(m["clipped"]) == 2 and int(m["tokens"]) == 3


def test_gspo_sequence_ratio_hand_computed():
  logp, old, adv, mask, seg = _hand_example()
  cfg = PolicyLossConfig(ratio_level="sequence", decoupled=False)
  w = objectives.aggregation_weights(mask, seg, "token")
  loss, _ = objectives.policy_loss(logp, old, old, adv, mask, w, seg, cfg)
  # Episode 1: ratio exp(mean(0.1, 0.3)) = e^0.2 > 1.2 -> clipped to 1.2 on both tokens.
  np.testing.assert_allclose(float(loss), (-1.2 - 1.2 + 0.8) / 3, **TOL)


def test_decoupled_equals_plain_ppo_when_sampler_agrees():
  logp, old, adv, mask, seg = _hand_example()
  w = objectives.aggregation_weights(mask, seg, "token")
  dec = PolicyLossConfig(decoupled=True, is_mode="truncate")
  plain = PolicyLossConfig(decoupled=False)

  def f(cfg):
    return jax.value_and_grad(
        lambda lp: objectives.policy_loss(lp, old, old, adv, mask, w, seg, cfg)[0])(logp)

  (l1, g1), (l2, g2) = f(dec), f(plain)
  np.testing.assert_allclose(float(l1), float(l2), **TOL)
  np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), **TOL)
  _, m = objectives.policy_loss(logp, old, old, adv, mask, w, seg, dec)
  assert float(m["is_weight_sum"]) == pytest.approx(3.0, rel=1e-6)
  assert float(m["is_weight_max"]) == pytest.approx(1.0, rel=1e-6)


def test_importance_weight_truncation_and_masking():
  logp = jnp.zeros((1, 3))
  prox = jnp.zeros((1, 3))
  behav = jnp.log(jnp.array([[1.0, 1 / 3.0, 4.0]]))  # w = prox/behav = 1, 3, 0.25
  adv = jnp.ones((1, 3))
  mask = jnp.ones((1, 3))
  seg = jnp.ones((1, 3), jnp.int32)
  w = objectives.aggregation_weights(mask, seg, "token")
  cfg = PolicyLossConfig(is_mode="truncate", is_cap=2.0)
  loss, m = objectives.policy_loss(logp, prox, behav, adv, mask, w, seg, cfg)
  np.testing.assert_allclose(float(loss), -(1.0 + 2.0 + 0.25) / 3, **TOL)
  assert int(m["truncated"]) == 1
  np.testing.assert_allclose(float(m["is_weight_max"]), 3.0, rtol=1e-6)
  cfg = PolicyLossConfig(is_mode="mask", is_low=0.5, is_high=2.0)
  loss, m = objectives.policy_loss(logp, prox, behav, adv, mask, w, seg, cfg)
  # Tokens 2 and 3 are masked; the denominator keeps all three tokens.
  np.testing.assert_allclose(float(loss), -1.0 / 3, **TOL)
  assert int(m["is_masked"]) == 2


def test_kl_penalty_k3():
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.25]]))
  d = np.log(0.25) - np.log(0.5)
  np.testing.assert_allclose(np.asarray(objectives.k3(logp, ref)),
                             [[math.exp(d) - d - 1, 0.0]], **TOL)
  mask = jnp.ones((1, 2))
  seg = jnp.ones((1, 2), jnp.int32)
  w = objectives.aggregation_weights(mask, seg, "token")
  cfg = PolicyLossConfig(kl_coef=0.5, decoupled=False)
  zero_adv = jnp.zeros((1, 2))
  loss, m = objectives.policy_loss(logp, logp, logp, zero_adv, mask, w, seg, cfg, ref_logp=ref)
  np.testing.assert_allclose(float(loss), 0.5 * (math.exp(d) - d - 1) / 2, **TOL)
  with pytest.raises(ValueError, match="reference"):
    objectives.policy_loss(logp, logp, logp, zero_adv, mask, w, seg, cfg)


def test_target_mask_respects_segments_and_padding():
  loss_mask = jnp.array([[0, 1, 1, 0, 1, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])
  # Position t trains token t+1 only inside the same segment.
  np.testing.assert_array_equal(np.asarray(objectives.target_mask(loss_mask, seg)),
                                [[1, 1, 0, 1, 0, 0]])


def test_next_token_loss_and_logprobs():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
  targets = jnp.array([[0, 2]])
  lp = objectives.token_logprobs(logits, targets)
  np.testing.assert_allclose(np.asarray(lp), np.log([[0.5, 0.8]]), **TOL)
  loss, _ = objectives.next_token_loss(logits, targets, jnp.array([[0.5, 0.5]]))
  np.testing.assert_allclose(float(loss), -(np.log(0.5) + np.log(0.8)) / 2, **TOL)


def test_bad_config_rejected():
  with pytest.raises(ValueError, match="ratio_level"):
    PolicyLossConfig(ratio_level="episode")
  with pytest.raises(ValueError, match="is_mode"):
    PolicyLossConfig(is_mode="clip")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
