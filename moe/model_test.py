"""Model behaviour on tiny configs: shapes, replay, packing, experts, routers.

(Cached decoding is the sampler's: rollout/forward_test.py checks it against this model's full
forward, rollout/kv_cache_test.py the reuse of slots.)

Tolerance policy (fp32): paths that compute the same math in a different order (packed vs
separate rows, ragged vs dispatch experts) agree within 1e-5 absolute on logits of O(1)
magnitude; a path that is the same computation (replaying the routing just chosen) must be
bit-identical.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import build
from moe.config import ModelConfig
from moe.router import update_bias

TOL = 1e-5


def tiny(**kw):
  base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=64, moe_intermediate_size=32, num_experts=4,
              num_experts_per_tok=2, max_seq_len=64, init_std=0.2)
  base.update(kw)
  return ModelConfig(**base)


def tokens(b=2, t=12, vocab=64, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_shapes_and_dtypes():
  cfg = tiny(first_k_dense=1, num_layers=3)
  out = build.create(cfg)(tokens())
  assert out.logits.shape == (2, 12, 64) and out.logits.dtype == jnp.float32
  assert out.routing.shape == (2, 2, 12, 2) and out.routing.dtype == jnp.uint8
  assert out.aux["expert_counts"].shape == (2, 4)
  # every token picks k distinct experts
  r = np.asarray(out.routing)
  assert (r[..., 0] != r[..., 1]).all()
  # counts add up to tokens * k per layer
  np.testing.assert_allclose(np.asarray(out.aux["expert_counts"]).sum(-1), 2 * 12 * 2)


def test_replay_same_routing_is_bit_identical():
  model = build.create(tiny())
  x = tokens()
  out = model(x)
  again = model(x, routing=out.routing)
  np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(again.logits))
  np.testing.assert_array_equal(np.asarray(out.routing), np.asarray(again.routing))


def test_replay_forces_other_experts_and_gradients_reach_router():
  model = build.create(tiny())
  x = tokens()
  out = model(x)
  forced = (out.routing.astype(jnp.int32) + 1) % 4  # still k distinct experts per token
  replayed = model(x, routing=forced.astype(jnp.uint8))
  np.testing.assert_array_equal(np.asarray(replayed.routing), np.asarray(forced))
  assert float(jnp.abs(replayed.logits - out.logits).max()) > 1e-3

  graphdef, state = nnx.split(model)

  def loss(state):
    m = nnx.merge(graphdef, state)
    return jnp.mean(m(x, routing=forced.astype(jnp.uint8)).logits ** 2)

  grads = jax.grad(loss)(state)
  g = grads["layers"][0]["ffn"]["router"]["weight"].get_value()
  assert float(jnp.abs(g).max()) > 0.0


def test_bad_routing_shape_raises():
  model = build.create(tiny())
  with pytest.raises(ValueError, match="routing has shape"):
    model(tokens(), routing=jnp.zeros((2, 2, 12, 3), jnp.uint8))
  with pytest.raises(ValueError, match="tokens must be"):
    model(jnp.zeros((12,), jnp.int32))


def test_packed_segments_do_not_attend_across():
  model = build.create(tiny())
  a, b = tokens(b=1, t=5, seed=5), tokens(b=1, t=7, seed=6)
  packed = jnp.concatenate([a, b], axis=1)
  seg = jnp.array([[1] * 5 + [2] * 7])
  pos = jnp.array([list(range(5)) + list(range(7))])
  out = model(packed, positions=pos, segment_ids=seg)
  np.testing.assert_allclose(out.logits[:, :5], model(a).logits, atol=TOL)
  np.testing.assert_allclose(out.logits[:, 5:], model(b).logits, atol=TOL)


def test_ragged_dispatch_and_grouped_agree_when_nothing_drops():
  cfg = tiny(num_experts=8, num_experts_per_tok=2)
  ragged = build.create(cfg.replace(expert_impl="ragged"))
  dispatch = build.create(cfg.replace(expert_impl="dispatch", capacity_factor=None))
  x = tokens(t=16)
  r, d = ragged(x), dispatch(x)
  np.testing.assert_array_equal(np.asarray(r.routing), np.asarray(d.routing))
  np.testing.assert_allclose(r.logits, d.logits, atol=TOL)
  grouped = build.create(cfg.replace(expert_impl="grouped"))(x)
  np.testing.assert_array_equal(np.asarray(grouped.routing), np.asarray(r.routing))
  np.testing.assert_allclose(grouped.logits, r.logits, atol=TOL)
  # A generous capacity factor that still never overflows agrees too.
  roomy = build.create(cfg.replace(expert_impl="dispatch", capacity_factor=4.0))(x)
  np.testing.assert_allclose(roomy.logits, r.logits, atol=TOL)
  # A tiny capacity drops assignments, which changes the output.
  tight = build.create(cfg.replace(expert_impl="dispatch", capacity_factor=0.25))(x)
  assert float(jnp.abs(tight.logits - r.logits).max()) > 1e-4


def test_ties_break_to_lowest_index():
  cfg = tiny()
  model = build.create(cfg)
  for layer in model.layers:
    w = layer.ffn.router.weight
    w.set_value(jnp.zeros_like(w.get_value()))  # all router logits equal
  out = model(tokens())
  r = np.asarray(out.routing)
  assert (r[..., 0] == 0).all() and (r[..., 1] == 1).all()


def test_sigmoid_router_bias_steers_selection_and_shared_experts():
  cfg = tiny(router_type="sigmoid", num_shared_experts=1, routed_scaling_factor=2.5,
             first_k_dense=1, num_layers=2)
  model = build.create(cfg)
  x = tokens()
  out = model(x)
  assert out.routing.shape == (1, 2, 12, 2)
  router = model.layers[1].ffn.router
  before = np.asarray(out.aux["expert_counts"][0])
  # A large bias on expert 3 makes every token pick it; gate weights still come from the scores.
  router.bias.set_value(jnp.array([0.0, 0.0, 0.0, 10.0]))
  forced = model(x)
  assert (np.asarray(forced.routing)[0] == 3).any(axis=-1).all()
  # The balancing rule lowers the bias of the over-loaded expert.
  update_bias(router, forced.aux["expert_counts"][0], rate=0.5)
  assert float(router.bias.get_value()[3]) == pytest.approx(9.5)
  assert before.sum() == 2 * 12 * 2


def test_aux_losses():
  model = build.create(tiny())
  out = model(tokens())
  lb = float(out.aux["load_balance_loss"])
  z = float(out.aux["router_z_loss"])
  # Each layer's Switch loss is >= ~1 for any routing (1 when perfectly balanced): two layers.
  assert lb > 1.5 and z > 0
  assert float(model.aux_loss(out)) == pytest.approx(0.01 * lb + 0.001 * z, rel=1e-6)


def test_bf16_compute_and_untied_head():
  cfg = tiny(param_dtype="bfloat16", dtype="bfloat16", tie_word_embeddings=False)
  model = build.create(cfg)
  out = model(tokens())
  assert out.logits.dtype == jnp.float32
  assert model.lm_head.get_value().dtype == jnp.bfloat16
  ref = build.create(cfg.replace(param_dtype="float32", dtype="float32"))
  # Same seed: the fp32 model's weights are the bf16 ones before rounding. Replaying the fp32
  # routing keeps the experts equal, so the gap is bf16 rounding alone (8-bit mantissa, ~0.4% per
  # op over two layers): bounded by 0.1 absolute, and on average by 2% of the logits' scale.
  want = ref(tokens())
  got = model(tokens(), routing=want.routing)
  diff = np.abs(np.asarray(got.logits) - np.asarray(want.logits))
  scale = np.abs(np.asarray(want.logits)).mean()
  assert diff.max() < 0.1 and diff.mean() < 0.02 * scale, (diff.max(), diff.mean(), scale)


def test_config_validation():
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    tiny(num_heads=3)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    tiny(num_experts_per_tok=5)
  with pytest.raises(ValueError, match="router_type"):
    tiny(router_type="relu")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
