"""Joining a multi-process learner: `jax.distributed` set-up and the checks its processes share.

What: `initialize(coordinator, num_processes, process_id)` starts `jax.distributed` (CPU
collectives over gloo, so the same program runs across processes on a CPU-only machine as on
accelerators); `batch_digest` and `mismatched_processes` let every process check that it passes
the same global batch as the others (rl.learner.Learner.train_step does, see there).

Why here: every multi-process program of the project (the learner part of the pipeline,
`tools/rl_part.py learner --num_processes=N`, and the smoke run rl/multihost_smoke.py) joins the
same way, and the set-up must run before anything initialises a JAX backend, so it lives in one
small module with no JAX work at import.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins the `num_processes`-process JAX runtime as process `process_id`.

  `coordinator` is process 0's "host:port" (every process names the same one). CPU collectives
  go over gloo (no effect on accelerators). Must run before anything initialises a JAX backend
  (jax.devices(), any computation); afterwards jax.devices() lists every process's devices.

  Raises:
    ValueError: num_processes < 1, process_id outside [0, num_processes), or no coordinator
      address with several processes.
  """
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is not one of {num_processes} processes")
  if num_processes > 1 and (not coordinator or ":" not in coordinator):
    raise ValueError(f"{num_processes} processes need a coordinator address host:port (process "
                     f"0's), got {coordinator!r}")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def batch_digest(batch: Mapping[str, np.ndarray]) -> np.ndarray:
  """A digest of a host batch (every field's name, dtype, shape and bytes) as 8 uint32 words,
  the form a cross-process all-gather takes."""
  h = hashlib.sha256()
  for name in sorted(batch):
    arr = np.ascontiguousarray(batch[name])
    h.update(f"{name}:{arr.dtype.str}:{arr.shape};".encode())
    h.update(arr.tobytes())
  return np.frombuffer(h.digest(), np.uint32).copy()


def mismatched_processes(digests: Sequence[np.ndarray]) -> list[int]:
  """The processes whose batch digest differs from process 0's (`digests[p]` is process p's)."""
  digests = [np.asarray(d) for d in digests]
  return [p for p, d in enumerate(digests) if not np.array_equal(d, digests[0])]
