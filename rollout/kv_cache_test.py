"""The slot KV cache: writes land in the right slot and position, windows round-trip, and a slot
reused without clearing decodes exactly as a fresh one (masked entries get probability 0, so the
same program on other values there gives bit-identical logits)."""

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

CFG = testing.tiny_config()
KV, HD = CFG.num_kv_heads, CFG.resolved_head_dim


def _prompt_kv(p, length, seed=0):
  rng = np.random.default_rng(seed)
  ks = tuple(jnp.asarray(rng.normal(size=(p, KV, HD, length)), jnp.float32)
             for _ in range(CFG.num_layers))
  vs = tuple(jnp.asarray(rng.normal(size=(p, KV, length, HD)), jnp.float32)
             for _ in range(CFG.num_layers))
  return ks, vs


def test_allocate_has_the_documented_layout():
  ck, cv = kv_cache.allocate(CFG, 3, 16, jnp.bfloat16)
  assert len(ck) == len(cv) == CFG.num_layers
  assert ck[0].shape == (3, KV, HD, 16) and cv[0].shape == (3, KV, 16, HD)
  assert ck[0].dtype == jnp.bfloat16 and not np.asarray(ck[1], np.float32).any()


def test_write_prompts_copies_one_prompt_into_several_slots_and_drops_padding():
  ck, cv = kv_cache.allocate(CFG, 4, 16)
  ks, vs = _prompt_kv(2, 8)
  dst = np.array([3, 1, 0, 4], np.int32)  # 4 = out of range: a padding entry
  src = np.array([1, 1, 0, 0], np.int32)
  ck, cv = kv_cache.write_prompts(ck, cv, ks, vs, dst, src)
  for li in range(CFG.num_layers):
    for slot, row in ((3, 1), (1, 1), (0, 0)):
      np.testing.assert_array_equal(ck[li][slot, :, :, :8], ks[li][row])
      np.testing.assert_array_equal(cv[li][slot, :, :8], vs[li][row])
    assert not np.asarray(ck[li][2]).any() and not np.asarray(cv[li][2]).any()
    assert not np.asarray(ck[li][:, :, :, 8:]).any()


def test_write_step_writes_each_slot_at_its_position_and_drops_past_the_end():
  ck, cv = kv_cache.allocate(CFG, 3, 8)
  k = jnp.arange(3 * KV * HD, dtype=jnp.float32).reshape(3, KV, HD) + 1
  v = -k
  positions = jnp.array([0, 5, 8], jnp.int32)  # slot 2 is one past the end
  nk, nv = kv_cache.write_step(ck[0], cv[0], positions, k, v)
  want_k = np.zeros((3, KV, HD, 8), np.float32)
  want_v = np.zeros((3, KV, 8, HD), np.float32)
  want_k[0, :, :, 0], want_k[1, :, :, 5] = k[0], k[1]
  want_v[0, :, 0], want_v[1, :, 5] = v[0], v[1]
  np.testing.assert_array_equal(nk, want_k)
  np.testing.assert_array_equal(nv, want_v)


def test_window_and_write_back_round_trip():
  ks, vs = _prompt_kv(4, 16, seed=1)
  ck, cv = kv_cache.window(ks, vs, 2, 8)
  assert ck[0].shape == (2, KV, HD, 8) and cv[0].shape == (2, KV, 8, HD)
  ck = tuple(c + 1 for c in ck)
  fk, fv = kv_cache.write_back(ks, vs, ck, cv)
  for li in range(CFG.num_layers):
    np.testing.assert_array_equal(fk[li][:2, :, :, :8], ks[li][:2, :, :, :8] + 1)
    np.testing.assert_array_equal(fk[li][:, :, :, 8:], ks[li][:, :, :, 8:])
    np.testing.assert_array_equal(fk[li][2:], ks[li][2:])
    np.testing.assert_array_equal(fv[li], vs[li])
  whole = kv_cache.window(ks, vs, 4, 16)
  assert whole[0] is ks and whole[1] is vs


def test_a_reused_slot_decodes_like_a_fresh_one():
  """Entries past a slot's position, left by an earlier occupant, are masked, never read."""
  model = testing.tiny_model(seed=3)
  p = packed_weights.pack(moe_params.flatten(model), model.config)
  caps = forward.capacity_tiers(2, model.config, (1.0,), False)
  step = jax.jit(forward.decode_step, static_argnames=("cfg", "caps"))
  prompt_k, prompt_v = _prompt_kv(2, 4, seed=2)
  rows = np.arange(2, dtype=np.int32)
  fresh = kv_cache.write_prompts(*kv_cache.allocate(CFG, 2, 16), prompt_k, prompt_v, rows, rows)
  stale_k, stale_v = _prompt_kv(2, 16, seed=4)  # a longer earlier occupant
  stale = kv_cache.write_prompts(stale_k, stale_v, prompt_k, prompt_v, rows, rows)
  tokens, positions = jnp.array([5, 9], jnp.int32), jnp.array([4, 4], jnp.int32)
  a = step(p, model.config, tokens, positions, *fresh, caps=caps)
  b = step(p, model.config, tokens, positions, *stale, caps=caps)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert float(jnp.abs(fresh[0][0] - stale[0][0]).max()) > 0.1  # the caches did differ



@pytest.mark.parametrize("poison", [np.nan, np.inf, 1e30])
def test_a_slot_left_with_nan_or_inf_decodes_exactly_like_a_fresh_one(poison):
  """Entries past the position holding NaN, inf or huge values (left by bad weights) change
  nothing: they are selected out of scores and values, not multiplied by probability 0."""
  model = testing.tiny_model(seed=3)
  p = packed_weights.pack(moe_params.flatten(model), model.config)
  caps = forward.capacity_tiers(2, model.config, (1.0,), False)
  step = jax.jit(forward.decode_step, static_argnames=("cfg", "caps"))
  prompt_k, prompt_v = _prompt_kv(2, 4, seed=2)
  rows = np.arange(2, dtype=np.int32)
  fresh = kv_cache.write_prompts(*kv_cache.allocate(CFG, 2, 16), prompt_k, prompt_v, rows, rows)
  bad = tuple(tuple(jnp.full_like(c, poison) for c in caches)
              for caches in kv_cache.allocate(CFG, 2, 16))
  stale = kv_cache.write_prompts(*bad, prompt_k, prompt_v, rows, rows)
  tokens, positions = jnp.array([5, 9], jnp.int32), jnp.array([4, 4], jnp.int32)
  a, b = fresh, stale
  for _ in range(3):  # several steps: each writes its entry, the rest stays poisoned
    out_a = step(p, model.config, tokens, positions, *a, caps=caps)
    out_b = step(p, model.config, tokens, positions, *b, caps=caps)
    assert np.isfinite(np.asarray(out_a[0])).all()
    np.testing.assert_array_equal(out_a[0], out_b[0])
    np.testing.assert_array_equal(out_a[1], out_b[1])
    a, b = out_a[2:], out_b[2:]
    positions = positions + 1
  np.testing.assert_array_equal(np.asarray(b[1][0][:, :, 7:]), np.float32(poison))  # still poisoned


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
