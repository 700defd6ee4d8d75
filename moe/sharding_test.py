"""Sharding on 8 CPU devices: sharded forward == single-device forward, and a sharded train step.

Tolerance policy (fp32): a sharded forward reorders reductions (psum over expert/tensor shards,
split contractions), so logits agree within 1e-5 absolute; routing must be identical.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moe import build, params, sharding  # noqa: E402
from moe.config import ModelConfig  # noqa: E402

TOL = 1e-5
CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, num_shared_experts=1, first_k_dense=0, max_seq_len=32,
                  init_std=0.2, expert_impl="dispatch")
TOKENS = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)


def _forward(model, tokens):
  graphdef, state = nnx.split(model)

  @jax.jit
  def f(state, tokens):
    out = nnx.merge(graphdef, state)(tokens)
    return out.logits, out.routing

  return f(state, tokens)


@pytest.fixture(scope="module")
def reference():
  model = build.create(CFG, seed=3)
  return params.flatten(model), _forward(model, TOKENS)


# Every mesh shape with the CPU's dispatch experts; one expert-parallel shape each with
# ragged_dot and with grouped blocks.
@pytest.mark.parametrize("shape,impl", [((8, 1, 1, 1), "dispatch"), ((2, 2, 2, 1), "dispatch"),
                                        ((1, 1, 4, 2), "dispatch"), ((2, 1, 2, 2), "dispatch"),
                                        ((1, 1, 4, 2), "ragged"), ((2, 1, 2, 2), "grouped")])
def test_sharded_forward_matches_single_device(reference, shape, impl):
  flat, (want_logits, want_routing) = reference
  mesh = sharding.make_mesh(shape)
  with jax.set_mesh(mesh):
    model = build.create(CFG.replace(expert_impl=impl), seed=3, mesh=mesh)
    # Same seed, same weights up to XLA fusing the initialiser's arithmetic differently under jit.
    got_flat = params.flatten(model)
    for k in flat:
      np.testing.assert_allclose(got_flat[k], flat[k], atol=1e-6, err_msg=k)
    # Compare forwards on identical weights (load_flat keeps each parameter's sharding).
    params.load_flat(model, flat)
    spec = model.layers[0].ffn.experts.gate.get_value().sharding.spec
    assert spec == sharding.logical_to_spec(("exp", "embed", "mlp"), mesh=mesh,
                                            shape=(4, 32, 32))
    tokens = jax.device_put(TOKENS, NamedSharding(mesh, sharding.batch_spec(2)))
    logits, routing = _forward(model, tokens)
  np.testing.assert_array_equal(np.asarray(routing), np.asarray(want_routing))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=TOL)


def test_sharded_train_step_lowers_loss():
  mesh = sharding.make_mesh((2, 1, 2, 2))
  with jax.set_mesh(mesh):
    model = build.create(CFG, seed=1, mesh=mesh)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jax.device_put(TOKENS, NamedSharding(mesh, sharding.batch_spec(2)))

    @nnx.jit
    def step(model, opt, tokens):
      def loss_fn(model):
        out = model(tokens)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
        return nll + model.aux_loss(out)
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    losses = [float(step(model, opt, tokens)) for _ in range(8)]
    # Parameters keep their shardings through the update.
    assert model.layers[0].ffn.experts.gate.get_value().sharding.spec == P("expert", None, "tensor")
  assert losses[-1] < losses[0] - 0.1, losses


def test_logical_to_spec_rules():
  mesh = sharding.make_mesh((2, 2, 2, 1))
  assert sharding.logical_to_spec(("batch", "length")) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("exp", "embed", "mlp")) == P("expert", "fsdp", "tensor")
  # An axis that does not divide the dimension is dropped (replicated).
  assert sharding.logical_to_spec(("embed",), mesh=mesh, shape=(3,)) == P(None)
  with pytest.raises(KeyError, match="no rule"):
    sharding.logical_to_spec(("nonsense",))
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh((4, 4, 1, 1))


def test_resource_plan_counts_bytes_per_device():
  mesh = sharding.make_mesh((1, 2, 4, 1))
  plan = build.resource_plan(CFG, mesh)
  assert plan["params"] == build.param_count(build.create(CFG))
  assert plan["param_bytes"] == 4 * plan["params"]
  # Experts split 4 ways and embed 2 ways: well under the replicated size, above a perfect 1/8.
  assert plan["param_bytes"] / 8 <= plan["param_bytes_per_device"] < plan["param_bytes"] / 2


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
