"""A sharded engine (tensor and expert parallel, rollout.placement) against one device, on 8 CPU
devices: the same tokens, routing and versions, logprobs within tolerance; the layout the
placement promises; no compilation after warm-up; clear errors for meshes it cannot use.

The model has a dense first layer, shared experts, 4 routed experts and a vocabulary that splits
in two, so every sharded weight kind (attention, dense and shared SwiGLU, routed experts,
embedding and head) is exercised. Engines run
in deterministic mode, where a request's arithmetic does not depend on the batch, so the two
engines must agree request by request.

Tolerance policy (float32): a sharded program computes the same sums in other groupings (the
output projections' and the experts' partial sums added across tensor shards, the expert
exchange's buffers of other shapes, which XLA:CPU blocks differently), so log-probabilities
differ by float32 rounding only (observed <= 1e-6 here). We assert testing.ATOL (1e-5): ten
times that, far below any real error (a wrong head, expert or shard moves a log-probability by
>= 1e-2). Tokens, routing and versions are compared exactly: the router runs replicated on the
same activations, and sampling runs on logits gathered whole (rollout.forward._head).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from moe import build  # noqa: E402
from moe import params as moe_params  # noqa: E402
from moe import sharding  # noqa: E402
from rollout import testing  # noqa: E402
from rollout import warmup  # noqa: E402
from rollout.engine import Engine, EngineConfig  # noqa: E402
from rollout.sampling import SamplingParams  # noqa: E402

# vocab 260: split over tensor (rollout.testing's 259 would stay whole).
CFG = testing.tiny_config(vocab_size=260, first_k_dense=1, num_shared_experts=1)
FLAT = moe_params.flatten(build.create(CFG, seed=3))
EC = EngineConfig(max_slots=4, max_len=64, decode_steps=4, deterministic=True, prefill_rows=2)
# Greedy, seeded sampling, and seeded sampling with top-k / top-p, n = 1 and 2.
REQUESTS = [([5, 17, 200, 3, 9, 44, 12], SamplingParams(max_tokens=12, temperature=0.0)),
            ([100, 101, 102], SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=7)),
            ([7] * 11, SamplingParams(max_tokens=9, temperature=0.8, top_k=20, top_p=0.9,
                                      seed=3)),
            ([250, 1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=1.0, seed=11))]
TIMEOUT_S = 300


def _run(engine) -> list:
  handles = [engine.submit(p, params) for p, params in REQUESTS]
  return [c for h in handles for c in h.result(timeout=TIMEOUT_S)]


def _assert_same(got: list, want: list) -> None:
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids
    np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=testing.ATOL)
    np.testing.assert_array_equal(g.routing, w.routing)
    np.testing.assert_array_equal(g.prompt_routing, w.prompt_routing)
    assert g.policy_versions == w.policy_versions and g.finish_reason == w.finish_reason


@pytest.fixture(scope="module")
def reference():
  eng = Engine.from_flat(FLAT, CFG, config=EC)
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def sharded():
  """Sharded engines by mesh shape, built on first use and stopped at the end."""
  made = {}

  def get(shape):
    if shape not in made:
      made[shape] = Engine.from_flat(FLAT, CFG, config=EC, mesh=sharding.make_mesh(shape))
    return made[shape]
  yield get
  for e in made.values():
    e.stop()


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (1, 1, 2, 2), (1, 1, 4, 2)],
                         ids=["tensor2", "expert2-tensor2", "expert4-tensor2"])
def test_a_sharded_engine_samples_what_one_device_samples(shape, reference, sharded):
  want = _run(reference)
  eng = sharded(shape)
  ep, tp = shape[2], shape[3]
  # The layout rollout.placement describes: kv heads (cache, prefix store) and heads split over
  # tensor, routed experts over expert, the vocabulary over tensor.
  runner = eng._runner  # pylint: disable=protected-access
  for arr in (runner.ck[0], runner.cv[0], runner.prefix.store_k[0]):
    spec = tuple(arr.sharding.spec)
    assert spec[:2] == (None, "tensor") and not any(spec[2:])
    assert {s.data.shape[1] for s in arr.addressable_shards} == {CFG.num_kv_heads // tp}
  moe_layer = runner.params["layers"][1]
  assert {s.data.shape[:3] for s in moe_layer["experts_gu"].addressable_shards} == {
      (CFG.num_experts // ep, CFG.hidden_size, 1)}
  assert {s.data.shape[1] for s in runner.params["layers"][0]["wqkv"].addressable_shards} == {1}
  assert {s.data.shape[1] for s in runner.params["head"].addressable_shards} == {
      CFG.vocab_size // tp}
  assert len(eng.placement.devices) == ep * tp
  # Warm-up compiles under the mesh, with the state's shardings; requests then compile nothing,
  # which also shows that every program hands the cache back in the layout it took it in.
  eng.warm_up()
  with warmup.CompileCounter() as compiled:
    got = _run(eng)
    again = _run(eng)
  assert compiled.compiled == 0
  _assert_same(got, want)
  _assert_same(again, want)


def test_a_swap_on_a_sharded_engine_serves_the_new_weights(reference, sharded):
  eng = sharded((1, 1, 2, 2))
  rng = np.random.default_rng(0)
  new = {k: (np.asarray(v) * (1 + 0.05 * rng.standard_normal(np.shape(v)))).astype(np.float32)
         for k, v in FLAT.items()}
  try:
    for e in (reference, eng):
      out = e.swap_weights(new, 1)
      assert out["version"] == 1 and e.version == 1
    got, want = _run(eng), _run(reference)
    _assert_same(got, want)
    assert all(c.policy_versions == [1] * len(c.token_ids) for c in got)
  finally:
    for e in (reference, eng):
      e.swap_weights(FLAT, 2)


@pytest.mark.parametrize("shape, match", [
    ((2, 1, 1, 1), "data parallelism is by replicas"),
    ((1, 2, 1, 1), "data parallelism is by replicas"),
    ((1, 1, 1, 4), "does not divide .*num_kv_heads"),
    ((1, 1, 3, 1), "expert axis of 3 must divide num_experts"),
])
def test_meshes_the_model_cannot_use_are_refused_before_anything_is_placed(shape, match):
  with pytest.raises(ValueError, match=match):
    Engine.from_flat(FLAT, CFG, config=EC, mesh=sharding.make_mesh(shape), start=False)


def test_a_mesh_without_the_sampler_axes_or_with_a_device_too_is_refused():
  other = Mesh(np.asarray(jax.devices()[:2]), ("model",))
  with pytest.raises(ValueError, match="axes"):
    Engine.from_flat(FLAT, CFG, config=EC, mesh=other, start=False)
  with pytest.raises(ValueError, match="a mesh or a device"):
    Engine.from_flat(FLAT, CFG, config=EC, mesh=sharding.make_mesh((1, 1, 1, 2)),
                     device=jax.devices()[0], start=False)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
