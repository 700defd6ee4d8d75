"""Consecutive sampler weight versions from real training steps of the project's learner.

What: `learner_versions(cfg, steps=..., learning_rate=...)` builds an `rl.learner.Learner`
(fp32 master weights, AdamW from `rl.train_state`), trains it on next-token loss over random
token rows and yields the sampler's copy after every optimizer step, exactly what the learner
publishes: `Learner.sampler_weights("bfloat16")` (router biases stay fp32).

Why: how well a delta compresses depends on how weights change, and synthetic updates only
model that. These versions are the real thing for this code base: Adam moves nearly every fp32
master by about the learning rate per step, so the changed fraction of the bf16 copy is set by
the learning rate against each weight's bf16 ulp (small weights have small ulps), and the
changed values are mostly +-1 ulp. Random tokens keep the benchmark self-contained; the
gradients' direction differs from a corpus or RL advantages, their per-step magnitude (what
Adam normalises away) hardly matters here.
"""

from collections.abc import Iterator

import numpy as np

from moe import sharding
from moe.config import ModelConfig
from rl import learner as learner_lib
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig


def random_batch(vocab_size: int, rows: int, seq_len: int, seed: int) -> dict:
  """A next-token batch of random tokens (every position in the loss)."""
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, vocab_size, (rows, seq_len)).astype(np.int32),
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
          "segment_ids": np.ones((rows, seq_len), np.int32),
          "loss_mask": np.ones((rows, seq_len), np.int32)}


def learner_versions(cfg: ModelConfig, *, steps: int, learning_rate: float, rows: int = 4,
                     seq_len: int = 32, seed: int = 0,
                     dtype: str = "bfloat16") -> Iterator[tuple[int, dict, float]]:
  """Yields (version, flat sampler weights, loss of the step that made them), version 0 first.

  Args:
    cfg: the model (fp32 `param_dtype` for fp32 masters, as the learner expects).
    steps: optimizer steps after version 0.
    learning_rate: constant AdamW learning rate (RL runs use ~1e-6..3e-4).
    rows, seq_len: batch shape; a new random batch every step.
    seed: initialisation and data seed.
    dtype: the sampler dtype of the published copies.
  """
  if steps < 1:
    raise ValueError("steps must be >= 1")
  learner = learner_lib.build_learner(
      learner_lib.LearnerConfig(
          optimizer=OptimizerConfig(learning_rate=learning_rate, warmup_steps=0,
                                    schedule="constant"),
          loss=LossConfig(objective="next_token")),
      cfg, mesh=sharding.make_mesh((1, 1, 1, 1)), seed=seed)
  flat, version = learner.sampler_weights(dtype)
  yield version, flat, float("nan")
  for i in range(steps):
    metrics = learner.train_step(random_batch(cfg.vocab_size, rows, seq_len, seed + 1 + i))
    flat, version = learner.sampler_weights(dtype)
    yield version, flat, float(metrics["loss"])
