"""Synthetic RL-like weight updates for tests, benchmarks and simulator calibration.

What: `rl_step(master, lr_ulps)` mimics one optimizer step as the sampler sees it: the fp32
master weights move by a small update and the sampler's bf16 copy is re-rounded. Only weights
whose rounding crosses a bf16 boundary change, nearly always by +-1 ulp, like real RL steps
(~1-4% of bf16 weights change per step). `changed_fraction_step` picks the update size that
gives a target changed fraction.

Why: the compression ratio depends on *how* weights change, not only how many, so benchmarks
need updates with the statistics of real optimizer steps rather than random bit flips.
"""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def init_master(sizes: dict[str, int], seed: int = 0, scale: float = 0.02):
  """fp32 master weights: name -> N(0, scale) array of the given sizes (1-D or shapes)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in sizes.items():
    out[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
  return out


def _ulp_bf16(x: np.ndarray) -> np.ndarray:
  """Spacing of bf16 numbers around |x| (fp32), 2**(exponent - 7)."""
  bits = np.abs(x).view(np.uint32) & np.uint32(0x7F800000)
  return (bits - np.uint32(7 << 23)).clip(np.uint32(1 << 23)).view(np.float32)


def rl_step(master: dict, changed_fraction: float, seed: int, dtype=BF16) -> None:
  """Updates `master` in place by N(0, s * ulp_bf16(w)) so that ~changed_fraction of the
  bf16-rounded weights change (P(round crosses) ~= E|u|/ulp = 0.8 s for small s)."""
  rng = np.random.default_rng(seed)
  s = changed_fraction / 0.8
  for name, w in master.items():
    u = rng.standard_normal(w.shape, dtype=np.float32)
    u *= np.float32(s)
    u *= _ulp_bf16(w)
    w += u


def cast(master: dict, dtype=BF16) -> dict:
  """The sampler's copy: every master tensor rounded to `dtype`."""
  return {k: v.astype(dtype) for k, v in master.items()}


def model_sizes(total_params: int, num_tensors: int = 16) -> dict[str, tuple]:
  """A handful of 2-D tensors plus small 1-D ones adding up to ~total_params."""
  big = total_params // num_tensors
  cols = 1024 if big >= 1024 else max(1, big)
  sizes = {}
  for i in range(num_tensors):
    sizes[f"layers/{i}/w"] = (max(1, big // cols), cols)
    sizes[f"layers/{i}/norm"] = (min(1024, max(1, big // 64)),)
  return sizes
