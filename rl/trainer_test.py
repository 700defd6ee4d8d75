"""Kill-and-restore: a run restored from a mid-run checkpoint reproduces the uninterrupted run.

Tolerance policy: both runs execute the same compiled programs on the same devices with the same
inputs, and XLA on the CPU is deterministic for a fixed program, so losses must match bit for bit.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest

from moe import sharding
from moe.config import ModelConfig
from rl import checkpointing
from rl import pretrain_data
from rl import rl_data
from rl import trajectory_io
from rl.episodes import Episode, ValidationSpec
from rl.learner import Learner
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig
from rl.trainer import Trainer

CFG = ModelConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=32)
OPT = OptimizerConfig(learning_rate=3e-3, schedule="cosine", warmup_steps=2, decay_steps=6)


def _files(tmp_path):
  root = tmp_path / "corpus"
  root.mkdir()
  for i in range(5):
    (root / f"f{i}.py").write_text(f"def g{i}(a, b):\n  return a + b * {i}\n" * 3)
  return pretrain_data.corpus_files(str(root))


def _trainer(files, ckpt_dir, save_every):
  mesh = sharding.make_mesh((2, 1, 1, 1))
  learner = Learner(CFG, mesh=mesh, opt_cfg=OPT, micro_batches=2)
  ds = pretrain_data.pretrain_dataset(files, seq_len=16, batch_rows=4, seed=0)
  mgr = checkpointing.CheckpointManager(ckpt_dir, max_to_keep=5)
  return Trainer(learner, ds, checkpoints=mgr, save_every=save_every)


def test_kill_and_restore_resumes_same_losses(tmp_path):
  files = _files(tmp_path)
  ckpt = str(tmp_path / "ckpt")
  full = _trainer(files, ckpt, save_every=3)
  losses = [m["loss"] for m in full.run(6)]
  assert full.checkpoints.all_steps() == [3, 6]
  assert losses[-1] < losses[0]

  # "Kill" after step 3: a fresh process-equivalent trainer restores step 3 and continues.
  resumed = _trainer(files, ckpt, save_every=0)
  assert resumed.restore(step=3)
  assert resumed.learner.step == 3
  again = [m["loss"] for m in resumed.run(3)]
  assert again == losses[3:]
  full.checkpoints.close()
  resumed.checkpoints.close()


def test_restore_without_checkpoint_is_a_fresh_start(tmp_path):
  t = _trainer(_files(tmp_path), str(tmp_path / "none"), save_every=0)
  assert not t.restore()
  t.checkpoints.close()


def test_rl_pipeline_feeds_the_learner(tmp_path):
  """Trajectory files -> RL grain pipeline -> Trainer -> policy-gradient steps.

  The episodes record the routing the learner itself chooses at its initial weights (as an
  in-sync sampler would), so the first step's routing agreement is exactly 1: the routing
  survived the files and the packing into rows aligned with its tokens.
  """
  rng = np.random.default_rng(0)
  learner = Learner(CFG, mesh=sharding.make_mesh((1, 1, 1, 1)),
                    loss_cfg=LossConfig(objective="policy", replay="proximal"))
  d = str(tmp_path / "traj")
  with trajectory_io.TrajectoryWriter(d, "rollout0", records_per_shard=5) as w:
    for g in range(4):
      for i in range(4):
        n = int(rng.integers(5, 9))
        tokens = rng.integers(0, CFG.vocab_size, n).astype(np.int32)
        routing = learner.forward(tokens[None])[1][:, 0]  # [moe_layers, n, k]
        w.write(Episode(
            group_id=f"p{g}", reward=float(i % 2), group_size=4, tokens=tokens,
            loss_mask=np.r_[np.zeros(2), np.ones(n - 2)].astype(np.int8),
            behaviour_logprobs=np.r_[np.zeros(2), -rng.random(n - 2) - 4].astype(np.float32),
            policy_versions=np.zeros(n, np.int32), routing=routing.astype(np.uint8)))
  spec = ValidationSpec(vocab_size=CFG.vocab_size, max_len=16,
                        routing_shape=(CFG.num_moe_layers, CFG.num_experts_per_tok),
                        num_experts=CFG.num_experts, require_routing=True)
  stats = rl_data.PipelineStats()
  ds = rl_data.rl_dataset(d, spec=spec, seq_len=16, batch_rows=2,
                          version_fn=lambda: learner.policy_version, stats=stats)
  trainer = Trainer(learner, ds, extra_metrics=lambda: {"groups": stats.groups})
  metrics = trainer.run(2)
  assert len(metrics) == 2 and learner.step == 2
  for m in metrics:
    assert np.isfinite(m["loss"]) and m["tokens"] > 0
    assert m["sampler_kl"] > 0
  assert metrics[0]["routing_agreement"] == 1.0
  assert metrics[-1]["groups"] >= 1


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
