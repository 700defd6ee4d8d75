"""Multi-process learner smoke run: every process joins one global mesh and trains together.

`python -m rl.multihost_smoke --num_processes 2 --process_id I --port P` (one command per
process) initialises `jax.distributed` (CPU collectives over gloo on the CPU), builds one mesh over
all processes' devices with the batch split across them, runs a few deterministic learner steps
and prints, as JSON on the last line, each step's loss, trained tokens and policy version and how
far each weight moved. Even steps give every process the global batch, odd steps give each
process only its own rows (`process_local`), so both placements are checked. With
`--num_processes 1` it runs the same program in one process, which is how the multi-host path is
checked on a single machine: the figures must agree. On a cluster the same entry point runs once
per host.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np

from moe import sharding
from moe.config import ModelConfig
from rl import distributed
from rl import learner as learner_lib
from rl.train_state import OptimizerConfig

SMOKE_CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, intermediate_size=64, moe_intermediate_size=32,
                        num_experts=4, num_experts_per_tok=2, max_seq_len=16)


def smoke_batches(steps: int, rows: int, length: int, vocab: int, seed: int = 0):
  """Deterministic global batches (identical in every process)."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    yield {"tokens": rng.integers(0, vocab, (rows, length)).astype(np.int32),
           "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
           "segment_ids": np.ones((rows, length), np.int32),
           "loss_mask": np.ones((rows, length), np.int32)}


def run(steps: int = 4, rows: int = 4, length: int = 8) -> dict:
  """Trains `steps` steps; returns what shows they trained, for comparison across processes.

  {"losses": [per step], "steps": [{"loss", "grad_norm", "tokens", "policy_version"} per step],
   "weight_change": {weight name: L2 norm of final - initial}}.
  """
  devices = jax.devices()  # global: every process's devices
  mesh = sharding.make_mesh((len(devices), 1, 1, 1), devices)
  learner = learner_lib.build_learner(
      learner_lib.LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-2), micro_batches=2,
                                sampler_dtype="float32"), SMOKE_CFG, mesh=mesh)
  initial, _ = learner.sampler_weights()  # all-gathered: every process calls it
  records = []
  n_proc, pid = jax.process_count(), jax.process_index()
  for i, b in enumerate(smoke_batches(steps, rows * len(devices), length, SMOKE_CFG.vocab_size)):
    if i % 2:  # odd steps: each process passes only its own rows
      per = b["tokens"].shape[0] // n_proc
      b = {k: v[pid * per:(pid + 1) * per] for k, v in b.items()}
    m = learner.train_step(b, process_local=bool(i % 2))
    records.append({"loss": m["loss"], "grad_norm": float(m["grad_norm"]), "tokens": m["tokens"],
                    "policy_version": int(m["policy_version"])})
  final, _ = learner.sampler_weights()
  change = {k: float(np.linalg.norm(final[k] - initial[k])) for k in sorted(initial)}
  return {"losses": [r["loss"] for r in records], "steps": records, "weight_change": change}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--steps", type=int, default=4)
  args = p.parse_args(argv)
  if args.num_processes > 1:
    distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)
  result = run(args.steps)
  print(json.dumps({"process_id": args.process_id, "process_count": jax.process_count(),
                    "devices": jax.device_count(), **result}))
  sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
