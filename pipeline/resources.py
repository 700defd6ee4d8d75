"""How devices are split between inference (samplers) and training (the learner).

Config decides the split with `inference_fraction` (the seed system gives inference about a
third). On a machine with one device (this CPU), both sides share it; with several, the first
`round(n * fraction)` devices (at least one, at most n - 1) serve samplers and the rest form the
learner's mesh. Across processes the same split is expressed per process by the device ids it may
use (e.g. CUDA_VISIBLE_DEVICES for a sampler process), see `process_env`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class ResourceSplit:
  sampler_devices: tuple
  learner_devices: tuple

  @property
  def shared(self) -> bool:
    return set(map(id, self.sampler_devices)) == set(map(id, self.learner_devices))


def split_devices(devices: Sequence, inference_fraction: float) -> ResourceSplit:
  """Splits `devices` (jax.devices() or ids) for samplers and learner."""
  if not 0.0 < inference_fraction < 1.0:
    raise ValueError(f"inference_fraction must lie in (0, 1), got {inference_fraction}")
  devices = tuple(devices)
  if not devices:
    raise ValueError("no devices to split")
  if len(devices) == 1:
    return ResourceSplit(devices, devices)
  k = min(len(devices) - 1, max(1, round(len(devices) * inference_fraction)))
  return ResourceSplit(devices[:k], devices[k:])


def assign(devices: Sequence, n: int) -> list:
  """Round-robin assignment of `n` samplers to `devices`."""
  if not devices:
    raise ValueError("no devices to assign")
  return [devices[i % len(devices)] for i in range(n)]


def process_env(device_ids: Sequence[int], platform: str = "gpu") -> dict:
  """Environment that confines a process to `device_ids` (GPUs; on CPU, a device count)."""
  if platform == "gpu":
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(int(i)) for i in device_ids)}
  if platform == "cpu":
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={len(device_ids)}"}
  raise ValueError(f"unknown platform {platform!r}")
