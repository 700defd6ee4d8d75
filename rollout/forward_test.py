"""Sampler forward passes equal the model's forward (logits within ATOL, routing exactly)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe import params as moe_params
from rollout import forward
from rollout import kv_cache
from rollout import packed_weights
from rollout import testing

# Jitted once per (config, capacity tiers): eager op-by-op execution is several times slower.
_prefill = jax.jit(forward.prefill, static_argnames=("cfg", "caps"))
_decode_step = jax.jit(forward.decode_step, static_argnames=("cfg", "caps"))


VARIANTS = {
    "mixtral_like": {},
    "qwen3_like": dict(qk_norm=True, first_k_dense=1, norm_topk_prob=False, head_dim=16),
    "deepseek_like": dict(router_type="sigmoid", num_shared_experts=1, routed_scaling_factor=2.5,
                          tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_then_decode_matches_full_forward(variant):
  model = testing.tiny_model(seed=1, **VARIANTS[variant])
  cfg = model.config
  if "router_b" in str(VARIANTS[variant]) or cfg.router_type == "sigmoid":
    flat = moe_params.flatten(model)
    for k in flat:
      if k.endswith("router/bias"):
        flat[k] = np.linspace(-0.3, 0.3, flat[k].size).astype(np.float32)
    moe_params.load_flat(model, flat)
  p = packed_weights.pack(moe_params.flatten(model), cfg)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
  full = model(jnp.asarray(toks))
  lengths = np.array([7, 9], np.int32)
  tiers = forward.capacity_tiers(2 * 16, cfg, (1.0, 1.5), False)
  padded = np.zeros((2, 16), np.int32)
  for r in range(2):
    padded[r, :lengths[r]] = toks[r, :lengths[r]]
  logits, routing, ks, vs = _prefill(p, cfg, jnp.asarray(padded), jnp.asarray(lengths),
                                     caps=tiers)
  for r in range(2):
    np.testing.assert_allclose(logits[r], full.logits[r, lengths[r] - 1], atol=testing.ATOL)
    np.testing.assert_array_equal(np.sort(routing[:, r, :lengths[r]], -1),
                                  np.sort(full.routing[:, r, :lengths[r]], -1))
  # Decode the remaining tokens one at a time from the prefilled cache.
  ck, cv = kv_cache.allocate(cfg, 2, 32)
  rows = np.arange(2, dtype=np.int32)
  ck, cv = kv_cache.write_prompts(ck, cv, ks, vs, rows, rows)
  pos = lengths.copy()
  dtiers = forward.capacity_tiers(2, cfg, (1.0,), False)
  for _ in range(12 - 9):
    tok = toks[np.arange(2), pos]
    logits, routing, ck, cv = _decode_step(p, cfg, jnp.asarray(tok), jnp.asarray(pos), ck, cv,
                                           caps=dtiers)
    for r in range(2):
      np.testing.assert_allclose(logits[r], full.logits[r, pos[r]], atol=testing.ATOL)
      np.testing.assert_array_equal(np.sort(routing[:, r], -1),
                                    np.sort(full.routing[:, r, pos[r]], -1))
    pos = pos + 1


def test_capacity_tiers_never_drop_even_when_all_tokens_pick_one_expert():
  model = testing.tiny_model(seed=2)
  cfg = model.config
  flat = moe_params.flatten(model)
  for k in flat:  # every token routes to experts 0 and 1
    if k.endswith("router/weight"):
      flat[k] = np.zeros_like(flat[k])
      flat[k][:, 0] = 5.0
      flat[k][:, 1] = 4.0
  moe_params.load_flat(model, flat)
  p = packed_weights.pack(flat, cfg)
  x = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (16, cfg.hidden_size)))
  lp = p["layers"][0]
  tiers = forward.capacity_tiers(16, cfg, (1.0,), False)
  assert tiers[0] < 16 and tiers[-1] == 16
  y_tiers, idx = forward.ffn(x, lp, cfg, tiers)
  y_dropless, _ = forward.ffn(x, lp, cfg, (16,))
  assert set(np.unique(np.asarray(idx)).tolist()) == {0, 1}
  np.testing.assert_allclose(y_tiers, y_dropless, atol=testing.ATOL)
  assert float(jnp.abs(y_dropless).min(axis=-1).max()) > 0


def test_prefill_outputs_do_not_depend_on_pad_tokens_and_pad_values_are_zero():
  """Nothing past a prompt's length reaches its outputs; the values it leaves there are zeros."""
  model = testing.tiny_model(seed=1)
  cfg = model.config
  p = packed_weights.pack(moe_params.flatten(model), cfg)
  tiers = (2 * 16,)
  a = np.zeros((2, 16), np.int32)
  a[0, :5], a[1, :9] = np.arange(1, 6), np.arange(10, 19)
  b = a.copy()
  b[0, 5:], b[1, 9:] = 258, 7  # other pad tokens
  lengths = jnp.asarray([5, 9], jnp.int32)
  out_a = _prefill(p, cfg, jnp.asarray(a), lengths, caps=tiers)
  out_b = _prefill(p, cfg, jnp.asarray(b), lengths, caps=tiers)
  np.testing.assert_array_equal(out_a[0], out_b[0])
  for li in range(cfg.num_layers):
    np.testing.assert_array_equal(out_a[3][li][0, :, :5], out_b[3][li][0, :, :5])
    assert not np.asarray(out_b[3][li][0, :, 5:]).any()
    assert not np.asarray(out_b[3][li][1, :, 9:]).any()


def test_capacity_tiers():
  cfg = testing.tiny_config()
  assert forward.capacity_tiers(64, cfg, (1.0, 1.5), False) == (32, 48, 64)
  assert forward.capacity_tiers(64, cfg, (1.0, 1.5), True) == (64,)


def test_pack_rejects_weights_of_another_model():
  model = testing.tiny_model()
  flat = moe_params.flatten(model)
  bad = dict(flat)
  bad["embed"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match="embed"):
    packed_weights.pack(bad, model.config)
  bad = dict(flat)
  del bad["final_norm/scale"]
  with pytest.raises(ValueError, match="missing"):
    packed_weights.pack(bad, model.config)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
