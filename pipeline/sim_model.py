"""The pipeline simulator's inputs and its result: workload, pools, weight sync, `Result`.

What: frozen dataclasses describing one RL step's work (`Workload`), the sampler replicas
(`InferencePool`), the learner (`TrainingPool`), and the learner-to-sampler weight sync
(`WeightSync`), each with `validate()` giving a clear error for impossible values; and `Result`,
what `pipeline.simulator.simulate` returns, with its steady-state views (`mid_step_s`,
`bottleneck`). Split from the event loop in `pipeline.simulator`, which re-exports all of them.
"""

import dataclasses
import math

import numpy as np

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclasses.dataclass(frozen=True)
class Workload:
  """One RL step's work and the shape of an episode."""
  prompts_per_step: int  # P: prompt groups per learner step
  attempts: int  # n: attempts (episodes) per prompt
  prompt_tokens: int
  response_median: float  # generated tokens per episode, all turns together
  response_p99: float  # == median gives constant lengths
  max_tokens: int  # clip
  env_median_s: float = 0.0  # environment time per turn (tool / test execution)
  env_p99_s: float = 0.0
  turns: int = 1
  obs_tokens: int = 0  # tokens prefilled at the start of each later turn (tool output)

  def validate(self):
    _positive_int(self, "prompts_per_step", "attempts", "turns", "max_tokens")
    _nonneg(self, "prompt_tokens", "obs_tokens", "env_median_s", "env_p99_s")
    if not 1 <= self.response_median <= self.response_p99:
      raise ValueError(f"need 1 <= response_median <= response_p99, got {self.response_median}, "
                       f"{self.response_p99}")
    if self.env_p99_s < self.env_median_s:
      raise ValueError(f"env_p99_s {self.env_p99_s} < env_median_s {self.env_median_s}")
    if self.max_tokens < self.turns:
      raise ValueError(f"max_tokens {self.max_tokens} < turns {self.turns}")


@dataclasses.dataclass(frozen=True)
class InferencePool:
  samplers: int  # sampler replicas
  slots: int  # concurrent sequences per sampler
  step_s: float  # decode step time (all sequences advance one token)
  step_per_seq_s: float = 0.0  # added per occupied slot
  prefill_s_per_token: float = 0.0

  def validate(self):
    _positive_int(self, "samplers", "slots")
    _nonneg(self, "step_per_seq_s", "prefill_s_per_token")
    if not self.step_s > 0:
      raise ValueError(f"step_s must be > 0, got {self.step_s}")

  def tokens_per_s(self, occupancy: float | None = None) -> float:
    """Decode throughput of the whole pool at the given per-sampler occupancy (default full)."""
    b = self.slots if occupancy is None else occupancy
    return self.samplers * b / (self.step_s + self.step_per_seq_s * b)


@dataclasses.dataclass(frozen=True)
class TrainingPool:
  step_fixed_s: float = 0.0  # per learner step (optimizer, checkpoint, data loading)
  s_per_token: float = 0.0

  def validate(self):
    _nonneg(self, "step_fixed_s", "s_per_token")

  def step_time(self, tokens: float) -> float:
    return self.step_fixed_s + tokens * self.s_per_token

  @classmethod
  def from_hardware(cls, accelerators: int, active_params: float, peak_flops: float, mfu: float,
                    flops_per_param_token: float = 6.0, step_fixed_s: float = 0.0):
    """flops_per_param_token * active_params flops per token over accelerators * peak * MFU."""
    if accelerators < 1 or not 0 < mfu <= 1 or peak_flops <= 0 or active_params <= 0:
      raise ValueError("need accelerators >= 1, 0 < mfu <= 1, peak_flops > 0, active_params > 0")
    return cls(step_fixed_s, flops_per_param_token * active_params /
               (accelerators * peak_flops * mfu))


@dataclasses.dataclass(frozen=True)
class WeightSync:
  """Per sampler: seconds from the learner's step to the start of its swap, and the swap pause."""
  ready_s: tuple
  pause_s: tuple

  @property
  def end_to_end_s(self) -> float:
    return max(r + p for r, p in zip(self.ready_s, self.pause_s))

  @property
  def max_pause_s(self) -> float:
    return max(self.pause_s)

  @classmethod
  def constant(cls, samplers: int, end_to_end_s: float, pause_s: float = 0.0):
    if not 0 <= pause_s <= end_to_end_s:
      raise ValueError(f"need 0 <= pause_s <= end_to_end_s, got {pause_s}, {end_to_end_s}")
    return cls((end_to_end_s - pause_s,) * samplers, (pause_s,) * samplers)

  def validate(self, samplers: int):
    if len(self.ready_s) != samplers or len(self.pause_s) != samplers:
      raise ValueError(f"WeightSync has {len(self.ready_s)}/{len(self.pause_s)} entries for "
                       f"{samplers} samplers")
    if min(self.ready_s) < 0 or min(self.pause_s) < 0:
      raise ValueError("WeightSync times must be >= 0")


@dataclasses.dataclass
class Result:
  max_staleness: int
  steps: int
  wall_s: float  # to the S-th version served by every sampler
  train_busy_frac: float
  train_idle_frac: float
  inference_idle_frac: float  # sampler-time with no sequence in a slot
  slot_occupancy: float  # occupied slot-time / all slot-time
  staleness_mean: float  # per consumed trajectory: learner step - oldest token version
  staleness_max: int
  swapped_midflight_frac: float  # consumed trajectories that saw a weight swap while decoding
  dropped_groups: int
  wasted_token_frac: float  # generated tokens thrown away with dropped groups
  tokens_generated: float
  # Fraction of wall time by what the learner was doing or waiting on: "training" (busy),
  # "inference" (idle while requests wait for a slot), "long tail" (idle, free slots, waiting on
  # the longest episodes: more staleness or more work in flight would help), "environment",
  # "weight sync", "startup/other". The bottleneck is the largest.
  shares: dict
  sync_end_to_end_s: float
  sync_max_pause_s: float
  served_at: list  # served_at[v - 1]: when every sampler served version v
  mid_shares: dict  # `shares` over the mid-run window (versions S/4 to 3S/4)
  mid_slot_occupancy: float

  @property
  def mid_step_s(self) -> float:
    """Seconds per learner step between versions S/4 and 3S/4 (away from startup and drain)."""
    lo, hi = _window(self.steps)
    if lo == 0:
      return self.served_at[hi - 1] / hi
    return (self.served_at[hi - 1] - self.served_at[lo - 1]) / (hi - lo)

  @property
  def bottleneck(self) -> str:
    """What the learner spent most of the mid-run window doing or waiting on (steady state)."""
    return max(self.mid_shares, key=self.mid_shares.get)

  @property
  def binding_utilisation(self) -> float:
    """Mid-run utilisation of the resource named by `bottleneck` (slots for inference)."""
    b = self.bottleneck
    return self.mid_slot_occupancy if b in ("inference", "long tail") else self.mid_shares[b]


def _window(steps):
  """Versions (lo, hi] of the mid-run window; lo = 0 means from the start."""
  lo, hi = steps // 4, max(1, (3 * steps) // 4)
  return (lo, hi) if hi > lo else (0, steps)


def lognormal_sigma(median: float, p99: float) -> float:
  return math.log(p99 / median) / _Z99



def _positive_int(obj, *names):
  for n in names:
    v = getattr(obj, n)
    if not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{type(obj).__name__}.{n} must be an int >= 1, got {v!r}")


def _nonneg(obj, *names):
  for n in names:
    v = getattr(obj, n)
    if not v >= 0:
      raise ValueError(f"{type(obj).__name__}.{n} must be >= 0, got {v!r}")
