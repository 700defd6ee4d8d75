"""Shared fixtures for sync tests: a small model and a history of RL-like versions."""

import numpy as np

from sync import synthetic
from sync import weights

SIZES = {"layers/0/w": (120, 250), "layers/0/norm": (250,), "layers/1/w": (120, 250),
         "embed": (64, 33)}
CHUNK = 8192


def history(n: int, seed: int = 0, frac: float = 0.04):
  """n successive bf16 versions of a small model, as the sampler would see them."""
  master = synthetic.init_master(SIZES, seed)
  out = []
  for i in range(n):
    if i:
      synthetic.rl_step(master, frac, seed * 1000 + i)
    out.append(synthetic.cast(master))
  return out


def same_bits(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
      np.array_equal(weights.words(a[k]), weights.words(b[k])) for k in a)
