"""Training checkpoints: restore onto a different mesh, retention policies, params-only restore.

Restored arrays must equal the saved ones bit for bit (checkpoints are lossless).
"""

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
from rl import checkpointing
from rl.learner import Learner
from rl.train_state import OptimizerConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=32)


def _batch(rows=8, length=8, seed=0):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, 32, (rows, length)).astype(np.int32),
          "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
          "segment_ids": np.ones((rows, length), np.int32),
          "loss_mask": np.ones((rows, length), np.int32)}


def _leaves(tree):
  return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def test_save_2x4_restore_8x1(tmp_path):
  mesh_a = sharding.make_mesh((1, 2, 4, 1))  # fsdp 2 x expert 4
  learner = Learner(CFG, mesh=mesh_a, opt_cfg=OptimizerConfig(learning_rate=1e-2))
  learner.train_step(_batch())
  mgr = checkpointing.CheckpointManager(str(tmp_path), max_to_keep=2)
  assert mgr.save(learner, data_state={"pretrain": {"next_index": 7}})
  mgr.wait()

  mesh_b = sharding.make_mesh((1, 8, 1, 1))  # fsdp 8
  other = Learner(CFG, mesh=mesh_b, seed=5)
  data = mgr.restore(other)
  assert data == {"pretrain": {"next_index": 7}}
  assert other.step == 1 and other.policy_version == 1
  for a, b in zip(_leaves(learner.state), _leaves(other.state)):
    np.testing.assert_array_equal(a, b)
  embed = other.state.params["embed"].get_value()
  assert embed.sharding.mesh.shape["fsdp"] == 8
  # The restored learner keeps training on its new mesh.
  m = other.train_step(_batch(seed=1))
  assert np.isfinite(m["loss"]) and other.step == 2

  # Params-only restore for serving reads the same step directory.
  served = mgr.restore_params(1)
  want = params.flatten(learner.model())
  for k, v in params.flatten(served).items():
    np.testing.assert_array_equal(v, want[k])
  # A new phase (e.g. RL after pre-training) starts from those weights with a fresh optimizer.
  rl_learner = Learner(CFG, mesh=mesh_a, init_model=served)
  assert rl_learner.step == 0
  for k, v in params.flatten(rl_learner.model()).items():
    np.testing.assert_array_equal(v, want[k])
  mgr.close()


def test_retention_keep_last_and_every(tmp_path):
  learner = Learner(CFG, mesh=sharding.make_mesh((1, 1, 1, 1)))
  mgr = checkpointing.CheckpointManager(str(tmp_path), max_to_keep=2, keep_every=3)
  for step in range(1, 8):
    learner.state = learner.state.replace(step=jnp.asarray(step, jnp.int32))
    mgr.save(learner)
  mgr.wait()
  assert mgr.all_steps() == [3, 6, 7]
  assert mgr.latest_step() == 7
  mgr.close()


def test_restore_rejects_other_model(tmp_path):
  learner = Learner(CFG, mesh=sharding.make_mesh((1, 1, 1, 1)))
  mgr = checkpointing.CheckpointManager(str(tmp_path))
  mgr.save(learner)
  mgr.wait()
  other = Learner(CFG.replace(hidden_size=64), mesh=sharding.make_mesh((1, 1, 1, 1)))
  with pytest.raises(ValueError, match="differs"):
    mgr.restore(other)
  empty = checkpointing.CheckpointManager(str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError):
    empty.restore(learner)
  mgr.close()
  empty.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
