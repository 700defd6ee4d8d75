"""The in-process pipeline with its learner on an 8-device mesh (issue #20): (data, fsdp, expert,
tensor) = (1, 2, 4, 1), the RL objective with router replay, real samplers, controller and weight
sync (pipeline.local.run). The same records, replayed through a one-device learner from the same
initial weights, give the same per-step losses and gradient norms, and the mesh learner's
parameters really are split: each expert weight over the expert axis (one expert per shard of the
tiny model) and the embedding dimension over fsdp.

Tolerance policy: the two learners run differently partitioned programs of the same arithmetic
(fsdp splits the embedding contractions into partial sums added across devices, the batch's loss
sums are added per shard, and the experts run on the rows an all-to-all brought them), so float32
sums may be ordered differently and the results differ by round-off only; router replay fixes
the experts each token uses, so no discrete choice can flip. Per-step losses and gradient norms
are compared at rtol 1e-5 (the CPU's float32 programs differ by ~1e-6 relative,
rl/learner_test.py), the final weights (weights ~0.02, after three Adam steps of lr 1e-3) at
atol 1e-5. Observed on this machine: step 1 identical, steps 2-3 within 8e-8 relative, weights
within 1.1e-7.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np
import pytest
from flax import nnx

from envs.sandbox import pool as pool_lib
from moe import sharding
from pipeline import local
from pipeline import testing
from pipeline.learner_loop import LearnerLoop
from pipeline.step_batches import StepBatcher
from rl import learner as learner_lib
from rl import testing as rl_testing
from rl.episodes import ValidationSpec

MESH = (1, 2, 4, 1)
STEPS = 3


@pytest.fixture(scope="module")
def pool():
  p = pool_lib.WarmPool(size=2)
  yield p
  p.close()


def _expert_weights(learner) -> dict:
  return {"/".join(map(str, path)): v.get_value()
          for path, v in nnx.to_flat_state(learner.state.params) if "experts" in path}


def test_rl_steps_on_a_mesh_match_one_device(pool, tmp_path):
  assert jax.device_count() == 8
  cfg = testing.config(max_staleness=1)
  mesh = sharding.make_mesh(MESH)
  learner = learner_lib.build_learner(testing.LEARNER, testing.MODEL, mesh=mesh,
                                      max_staleness=cfg.max_staleness)
  assert learner.loss_cfg.objective == "policy" and learner.loss_cfg.replay == "on"

  # Each expert weight [E, ., .] is split over the expert axis (E / 4 experts a shard) and over
  # fsdp along its embedding dimension: 8 distinct blocks, one per device.
  experts = _expert_weights(learner)
  assert len(experts) == 3 * testing.MODEL.num_layers
  for name, w in experts.items():
    assert w.sharding.spec[0] == "expert", (name, w.sharding.spec)
    assert "fsdp" in tuple(w.sharding.spec), (name, w.sharding.spec)
    blocks = {tuple((s.start, s.stop) for s in sh.index) for sh in w.addressable_shards}
    assert len(blocks) == 8 and len(w.sharding.device_set) == 8, name
    assert all(sh.data.shape[0] == testing.MODEL.num_experts // 4 for sh in w.addressable_shards)

  on_mesh = []
  res = local.run(learner=learner, tasks=testing.tasks(), pool=pool,
                  workdir=str(tmp_path / "run"), config=cfg, num_steps=STEPS,
                  engine_config=testing.ENGINE,
                  on_step=lambda s, m, i: on_mesh.append(
                      dict(m, trained_episodes=i["trained_episodes"], step=s)))
  assert res.learner is learner and res.steps == STEPS
  rl_testing.assert_steps_trained(on_mesh, steps=STEPS, episodes_per_step=cfg.episodes_per_step)
  # Still sharded after training (the step's out_shardings keep the layout).
  for name, w in _expert_weights(learner).items():
    assert w.sharding.spec == experts[name].sharding.spec, name

  # The same records through a one-device learner from the same initial weights.
  single = learner_lib.build_learner(testing.LEARNER, testing.MODEL,
                                     mesh=sharding.make_mesh((1, 1, 1, 1)),
                                     max_staleness=cfg.max_staleness)
  initial, _ = testing.published_weights(str(tmp_path / "run"), 0)
  for name, w in single.sampler_weights()[0].items():
    np.testing.assert_array_equal(w, initial[name], err_msg=name)
  m = testing.MODEL
  spec = ValidationSpec(vocab_size=m.vocab_size, max_len=cfg.seq_len,
                        routing_shape=(m.num_moe_layers, m.num_experts_per_tok),
                        num_experts=m.num_experts, require_routing=True)
  channel = local.WeightChannel("file://" + str(tmp_path / "replay_weights"), model_cfg=m)
  replayed = []
  loop = LearnerLoop(single, StepBatcher(str(tmp_path / "run" / "trajectories"), config=cfg,
                                         spec=spec),
                     publish=channel.publish, published_version=channel.latest,
                     weights_of=channel.weights_of,
                     on_step=lambda s, m, i: replayed.append(dict(m, group_ids=i["group_ids"])))
  loop.run(STEPS)
  assert [r["tokens"] for r in replayed] == [r["tokens"] for r in on_mesh]
  for i, (a, b) in enumerate(zip(on_mesh, replayed)):
    for key in ("loss", "grad_norm", "pg_loss", "aux_loss"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-8,
                                 err_msg=f"step {i + 1} {key}")
  final_mesh, _ = learner.sampler_weights()
  final_single, _ = single.sampler_weights()
  rl_testing.assert_weights_changed(initial, final_mesh)
  for name in final_mesh:
    np.testing.assert_allclose(final_mesh[name], final_single[name], rtol=0, atol=1e-5,
                               err_msg=name)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
