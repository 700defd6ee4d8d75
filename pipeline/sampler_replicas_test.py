"""The pipeline's samplers as data-parallel replicas (pipeline.samplers.build_engines,
rollout.replicas) on 8 CPU devices: the layout over the devices, requests through the
SamplerSet reaching every replica, a subscriber's swap reaching every replica at one version,
and the in-process pipeline run with `sampler_replicas=2, sampler_expert=2`."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import concurrent.futures  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from envs.sandbox import pool as pool_lib  # noqa: E402
from moe import build  # noqa: E402
from moe import params as moe_params  # noqa: E402
from pipeline import local  # noqa: E402
from pipeline import samplers as samplers_lib  # noqa: E402
from pipeline import testing  # noqa: E402
from rollout import replicas  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.sampling import SamplingParams  # noqa: E402

FLAT = moe_params.flatten(build.create(testing.MODEL, seed=0))
TIMEOUT_S = 300


def test_build_engines_lays_samplers_and_replicas_over_the_devices():
  devs = jax.devices()
  made = samplers_lib.build_engines(FLAT, testing.MODEL, count=2, replicas=2, devices=devs[2:6],
                                    config=testing.ENGINE, version=3)
  try:
    assert all(isinstance(s, replicas.ReplicaSet) for s in made)
    assert [[e.placement.devices for e in s.engines] for s in made] == [
        [[devs[2]], [devs[3]]], [[devs[4]], [devs[5]]]]
    assert all(s.version == 3 and s.running for s in made)
  finally:
    for s in made:
      s.stop()
  # One engine per sampler and no devices named: engines on the default device, as before.
  plain = samplers_lib.build_engines(FLAT, testing.MODEL, count=2, config=testing.ENGINE)
  try:
    assert all(type(e) is Engine and e.placement.device is None for e in plain)
  finally:
    for e in plain:
      e.stop()
  with pytest.raises(ValueError, match="2 samplers of 3 replicas of 1 devices need 6 devices, have 2"):
    samplers_lib.build_engines(FLAT, testing.MODEL, count=2, replicas=3, devices=devs[:2])


def test_the_sampler_set_reaches_every_replica_and_a_swap_reaches_all_at_one_version():
  made = samplers_lib.build_engines(FLAT, testing.MODEL, count=2, replicas=2,
                                    config=testing.ENGINE, devices=jax.devices()[:4])
  try:
    sset = samplers_lib.SamplerSet([samplers_lib.EngineSampler(s, f"sampler-{i}")
                                    for i, s in enumerate(made)])
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0)
    futs = [sset.submit([1 + i, 2, 3], params, timeout=TIMEOUT_S) for i in range(16)]
    for f in concurrent.futures.as_completed(futs, timeout=TIMEOUT_S):
      comps = f.result()  # (a sampled end-of-sequence token may end one early)
      assert len(comps) == 2 and all(c.policy_versions == [0] * len(c.token_ids) for c in comps)
    served = [e.stats["requests_total"] for s in made for e in s.engines]
    assert sum(served) == 16 and min(served) >= 1, served
    # The subscriber's apply function (what pipeline.local hands each sampler's subscriber)
    # swaps a replica set as one sampler: every replica serves the new version after it.
    new = {k: np.asarray(v) * np.float32(1.01) for k, v in FLAT.items()}
    local.swap_into(made[0])(new, 1)
    assert [e.version for e in made[0].engines] == [1, 1]
    assert sset.min_version() == 0  # the other sampler has not swapped
    local.swap_into(made[1])(new, 1)
    assert sset.min_version() == 1
    out = sset.submit([4, 5, 6], SamplingParams(max_tokens=4), timeout=TIMEOUT_S).result(
        TIMEOUT_S)
    assert out[0].policy_versions == [1] * len(out[0].token_ids)
  finally:
    for s in made:
      s.stop()


@pytest.fixture(scope="module")
def pool():
  p = pool_lib.WarmPool(size=2)
  yield p
  p.close()


def test_the_pipeline_runs_with_replicated_sharded_samplers(pool, tmp_path):
  """Two replicas, each sharding the model's experts over two devices."""
  seen = {}
  res = local.run(learner=testing.learner(1), tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path), config=testing.config(max_staleness=1), num_steps=2,
                  num_samplers=1, sampler_replicas=2, sampler_expert=2,
                  engine_config=testing.ENGINE, after_start=seen.update)
  assert res.steps == 2 and res.batcher["infra_failures"] == 0
  (rs,) = seen["engines"]
  assert isinstance(rs, replicas.ReplicaSet) and len(rs.engines) == 2
  devs = jax.devices()
  assert [e.placement.devices for e in rs.engines] == [devs[0:2], devs[2:4]]
  # Both replicas sampled episodes, and the weights the learner published reached both.
  assert all(e.stats["requests_total"] >= 1 for e in rs.engines)
  versions = [e.version for e in rs.engines]
  assert versions[0] == versions[1] >= 1
  assert res.samplers["requests_total"] == sum(e.stats["requests_total"] for e in rs.engines)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
