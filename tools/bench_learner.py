r"""Learner throughput: trained tokens/s and model-FLOPs utilisation of `rl.learner.Learner`.

Runs warm-up steps (compilation) and then timed steps on random full-length rows, for the
next-token objective or the RL policy objective (which adds the no-grad proximal pass), and
reports tokens/s, step time and MFU (rl/flops.py) against a peak: a chip's datasheet figure
(--chip), a given one (--peak_tflops), or by default the best rate of square jitted matmuls in the
model's dtype measured on this machine in the same run (`matmul_peak`), so the MFU on a CPU is
against what this CPU was shown to reach, not one small matmul's rate.

  bazel run //tools:bench_learner -- --gin_file=moe/configs/tiny.gin --seq_len 256 --batch_rows 8
  .venv/bin/python -m tools.bench_learner --gin_file=moe/configs/tiny.gin --objective policy \
      --chip h200 --mesh 1,1,1,1
  .venv/bin/python -m tools.bench_learner --gin_file=moe/configs/tiny.gin --seq_len 512 \
      --expert_impls dispatch,grouped      # the routed-expert paths, same batch, same process
  .venv/bin/python -m tools.bench_learner --gin_file=moe/configs/tiny.gin --seq_len 512 \
      --query_chunks 0,128,0,128           # whole-square attention against causal chunks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from moe import sharding
from rl import flops
from rl import learner as learner_lib
from rl.objectives import PolicyLossConfig
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig
from tools import configs


def random_batch(cfg, rows: int, seq_len: int, policy: bool, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  b = {"tokens": rng.integers(0, cfg.vocab_size, (rows, seq_len)).astype(np.int32),
       "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
       "segment_ids": np.ones((rows, seq_len), np.int32),
       "loss_mask": np.ones((rows, seq_len), np.int32)}
  if policy:
    b["behaviour_logprobs"] = np.full((rows, seq_len), -np.log(cfg.vocab_size), np.float32)
    b["policy_versions"] = np.zeros((rows, seq_len), np.int32)
    b["advantages"] = rng.normal(size=(rows, seq_len)).astype(np.float32)
    b["routing"] = rng.integers(0, cfg.num_experts, (rows, seq_len, cfg.num_moe_layers,
                                                     cfg.num_experts_per_tok)).astype(np.uint8)
  return b


def matmul_peak(dtype="float32", sizes=(256, 512, 1024, 2048), repeats: int = 5) -> dict:
  """Best measured rate of jitted [n, n] x [n, n] matmuls on the default device, in FLOP/s.

  Each size is compiled and run once, then timed `repeats` times (best kept); the rate is
  2 n^3 / seconds. Returns {"flops": best, "n": its size, "rates": {n: FLOP/s}}.
  """
  f = jax.jit(lambda a, b: a @ b)
  rates = {}
  for n in sizes:
    k1, k2 = jax.random.split(jax.random.PRNGKey(n))
    a = jax.random.normal(k1, (n, n), dtype)
    b = jax.random.normal(k2, (n, n), dtype)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    rates[n] = 2 * n ** 3 / best
  n = max(rates, key=rates.get)
  return {"flops": rates[n], "n": n, "rates": rates}


def bench(cfg, *, seq_len: int, batch_rows: int, steps: int, warmup: int, objective: str,
          mesh_shape, micro_batches: int, chip=None, peak_tflops=None,
          measure_peak: bool = False) -> dict:
  """Times `steps` learner steps after `warmup`; MFU against `peak_tflops`, `chip`'s datasheet
  peak, or (measure_peak, neither given) the best matmul rate measured here after the steps."""
  mesh = sharding.make_mesh(mesh_shape)
  loss = LossConfig(objective=objective, replay="on", policy=PolicyLossConfig())
  learner = learner_lib.build_learner(
      learner_lib.LearnerConfig(optimizer=OptimizerConfig(), loss=loss,
                                micro_batches=micro_batches), cfg, mesh=mesh)
  batch = random_batch(cfg, batch_rows, seq_len, objective == "policy")
  for _ in range(warmup):
    learner.train_step(batch)
  t0 = time.perf_counter()
  for _ in range(steps):
    m = learner.train_step(batch)
  dt = (time.perf_counter() - t0) / steps
  tokens = batch_rows * seq_len
  peak = peak_tflops * 1e12 if peak_tflops else flops.peak_flops(chip)
  source = "given" if peak_tflops else (f"datasheet {chip}" if chip else None)
  measured = None
  if peak is None and measure_peak:
    measured = matmul_peak(cfg.dtype)
    peak, source = measured["flops"], f"best measured {cfg.dtype} matmul here (n={measured['n']})"
  out = {
      "backend": jax.default_backend(), "devices": int(np.prod(mesh_shape)),
      "objective": objective, "seq_len": seq_len, "batch_rows": batch_rows,
      "micro_batches": micro_batches, "active_params": flops.active_matmul_params(cfg),
      "step_time_s": dt, "tokens_per_s": tokens / dt,
      "model_tflops_per_s": tokens / dt * flops.train_flops_per_token(cfg, seq_len) / 1e12,
      "final_loss": m["loss"],
  }
  if peak:
    out["mfu"] = flops.mfu(tokens / dt, cfg, seq_len, peak, out["devices"])
    out["peak_tflops"] = peak / 1e12
    out["peak_source"] = source
  if measured is not None:
    out["matmul_tflops_by_n"] = {str(n): r / 1e12 for n, r in measured["rates"].items()}
  return out


def compare_runs(runs: dict, by: str = "expert_impl") -> dict:
  """One report of several settings of `by` (a ModelConfig field) timed in one process: each
  one's figures and its step time over the first one's (the same batch, the same threads)."""
  first = next(iter(runs.values()))
  return {f"by_{by}": runs,
          "step_time_over_first": {k: r["step_time_s"] / first["step_time_s"]
                                   for k, r in runs.items()},
          "loss_diff_from_first": {k: abs(r["final_loss"] - first["final_loss"])
                                   for k, r in runs.items()}}


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    return ""


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--batch_rows", type=int, default=8)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--objective", choices=("next_token", "policy"), default="next_token")
  p.add_argument("--mesh", default="1,1,1,1", help="data,fsdp,expert,tensor")
  p.add_argument("--micro_batches", type=int, default=1)
  p.add_argument("--expert_impls", default="",
                 help="comma-separated ModelConfig.expert_impl values to time one after the "
                      "other in this process (e.g. dispatch,grouped); the report adds each "
                      "one's step time over the first's")
  p.add_argument("--query_chunks", default="",
                 help="comma-separated ModelConfig.attention_query_chunk values to time the "
                      "same way (0: whole-square attention); a value repeated is timed again "
                      "and reported as VALUE#N")
  p.add_argument("--chip", default=None, help=f"one of {sorted(flops.PEAK_FLOPS)}")
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="peak per device, TFLOP/s (default: without --chip, the best matmul "
                      "rate measured in this run)")
  args, files, bindings = configs.parse_flags(p, sys.argv[1:] if argv is None else argv)
  flops.peak_flops(args.chip)  # unknown chips fail before the run
  configs.parse(files or ["moe/configs/tiny.gin"], bindings)
  cfg = configs.model_config()
  if args.seq_len > cfg.max_seq_len:
    cfg = cfg.replace(max_seq_len=args.seq_len)
  kw = dict(seq_len=args.seq_len, batch_rows=args.batch_rows, steps=args.steps,
            warmup=args.warmup, objective=args.objective,
            mesh_shape=tuple(int(x) for x in args.mesh.split(",")),
            micro_batches=args.micro_batches, chip=args.chip, peak_tflops=args.peak_tflops)
  impls = [x for x in args.expert_impls.split(",") if x]
  chunks = [int(x) for x in args.query_chunks.split(",") if x]
  if impls and chunks:
    raise SystemExit("give --expert_impls or --query_chunks, not both")
  if impls or chunks:
    field, values = ("expert_impl", impls) if impls else ("attention_query_chunk", chunks)
    runs = {}
    for i, v in enumerate(values):
      n = values[:i].count(v)
      runs[f"{v}#{n + 1}" if n else str(v)] = bench(cfg.replace(**{field: v}), **kw)
    result = compare_runs(runs, field)
  else:
    result = bench(cfg, **kw, measure_peak=True)
  result["machine"] = {"cpu": _cpu_name(), "xla_cpu_threads": len(os.sched_getaffinity(0)),
                       "loadavg": list(os.getloadavg())}
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
