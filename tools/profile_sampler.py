"""Where a sampler decode step spends its time: `rollout.device_programs.decode_chunk`, op by op.

Run (BENCHMARKS.md "## Sampler (rollout/)" quotes its output):
  .venv/bin/python -m tools.profile_sampler --batch 64 --cache_len 160
  bazel run //tools:profile_sampler -- --batch 64

What it does: builds the benchmark's tiny Mixtral shape (vocab 1024, hidden 256, 4 layers, 8
experts top-2, fp32; random weights, or `--hf_checkpoint DIR` through `moe.hf`), fills `--batch`
engine slots, compiles one `decode_chunk` of `--steps` greedy steps attending over `--cache_len`
positions, then traces `--repeats` calls with the JAX profiler. Every compiled operation carries
the `jax.named_scope` it came from (rollout.forward labels qkv, kv_write, attention, out_proj,
router, experts, lm_head; rollout.device_programs labels sampling and cache_window); the report sums
each operation's time per decode step under its scope, and splits matrix products from the rest.

How to read it: on the CPU, XLA runs a step's operations on a small thread pool, so the times
are thread-time (summed over the threads that ran them), and they add up to more than the
wall-clock step time printed alongside. The shares are what matter: they say which part of the
step a faster kernel would have to replace.

The XLA flag `--xla_cpu_enable_xprof_traceme=true` (needed for per-operation events on the CPU)
is added to XLA_FLAGS before JAX starts; run this as its own process.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
SCOPES = ("qkv", "kv_write", "attention", "out_proj", "router", "experts", "lm_head", "sampling",
          "cache_window")
# Profiler events that are not one compiled operation (waits, executor and control-flow spans).
_NOT_AN_OP = re.compile(r"Execute|Await|wait|acquire|^cond|^while|^conditional|^\$")


def tiny_mixtral_config(quick: bool = False):
  from moe.config import ModelConfig
  if quick:
    return ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=64, moe_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2, max_seq_len=64, norm_topk_prob=True)
  return ModelConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                     intermediate_size=512, moe_intermediate_size=512, num_experts=8,
                     num_experts_per_tok=2, max_seq_len=512, norm_topk_prob=True)


def op_scopes(hlo_text: str) -> dict:
  """Maps each instruction name of a compiled HLO module to (named scope, is a matmul)."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    name = re.search(r'op_name="([^"]+)"', line)
    if not m or not name:
      continue
    path = name.group(1).split("/")
    scope = next((p for p in reversed(path) if p in SCOPES), "other")
    out[m.group(1)] = (scope, "dot_general" in path[-1] or " dot(" in line)
  return out


def breakdown(events: dict, scopes: dict, steps: int) -> dict:
  """Thread-time per decode step (ms) by scope and kind from {event name: total ns}."""
  table = collections.Counter()
  unknown = 0.0
  for name, ns in events.items():
    if _NOT_AN_OP.search(name):
      continue
    if name not in scopes:
      unknown += ns
      continue
    scope, is_dot = scopes[name]
    table[(scope, "matmul" if is_dot else "other")] += ns / 1e6 / steps
  return {"by_scope": {f"{s}/{k}": round(v, 4) for (s, k), v in table.most_common()},
          "total_ms": round(sum(table.values()), 4),
          "unattributed_ms": round(unknown / 1e6 / steps, 4)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--cache_len", type=int, default=160, help="attended cache positions")
  p.add_argument("--position", type=int, default=96, help="each slot's current position")
  p.add_argument("--steps", type=int, default=16, help="decode steps per call")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--hf_checkpoint", help="profile this checkpoint instead of random weights")
  p.add_argument("--quick", action="store_true", help="a tiny model (tests)")
  p.add_argument("--json", help="write the report here")
  args = p.parse_args(argv)
  if not 0 <= args.position < args.cache_len:
    p.error("--position must be in [0, cache_len)")
  if "jax" in sys.modules and TRACE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    p.error("JAX is already imported without per-operation tracing; run as its own process")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TRACE_FLAG).strip()

  import jax
  import numpy as np
  from moe import build
  from moe import hf
  from rollout import forward
  from rollout import device_programs
  from rollout.engine import Engine, EngineConfig

  if args.hf_checkpoint:
    model = hf.load_pretrained(args.hf_checkpoint)
  else:
    model = build.create(tiny_mixtral_config(args.quick), seed=0)
  cfg = model.config
  ec = EngineConfig(max_slots=args.batch, max_len=args.cache_len, decode_steps=args.steps)
  engine = Engine(model, config=ec, start=False)
  slots = {k: v.copy() for k, v in engine._slots.items()}  # pylint: disable=protected-access
  slots["active"][:] = True
  slots["remaining"][:] = 1 << 30
  slots["pos"][:] = args.position
  slots["tok"][:] = np.random.default_rng(0).integers(0, cfg.vocab_size, args.batch)
  slots["temp"][:] = 0.0  # greedy
  caps = forward.capacity_tiers(args.batch, cfg, ec.capacity_factors, False)
  runner = engine._runner  # pylint: disable=protected-access
  params, ck, cv = runner.params, runner.ck, runner.cv
  static = dict(cfg=cfg, nb=args.batch, sv=args.cache_len, steps=args.steps, caps=caps, top_n=0)

  # One compilation, used for every call: the operation names in its HLO are the event names.
  compiled = device_programs.decode_chunk.lower(params, ck, cv, slots, **static).compile()

  def call(ck, cv):
    ck, cv, _, outs = compiled(params, ck, cv, slots)
    jax.block_until_ready(outs)
    return ck, cv

  for _ in range(2):  # warm up
    ck, cv = call(ck, cv)
  wall = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    ck, cv = call(ck, cv)
    wall.append((time.perf_counter() - t0) / args.steps * 1e3)
  events = collections.Counter()
  with tempfile.TemporaryDirectory() as tdir:
    with jax.profiler.trace(tdir):
      for _ in range(args.repeats):
        ck, cv = call(ck, cv)
    path = glob.glob(os.path.join(tdir, "**", "*.xplane.pb"), recursive=True)
    if not path:
      raise RuntimeError("the profiler wrote no trace")
    for plane in jax.profiler.ProfileData.from_file(path[0]).planes:
      for line in plane.lines:
        for ev in line.events:
          events[ev.name] += ev.duration_ns
  report = {"batch": args.batch, "cache_len": args.cache_len, "steps": args.steps,
            "wall_ms_per_step_untraced": round(min(wall), 4),
            **breakdown(events, op_scopes(compiled.as_text()), args.repeats * args.steps)}
  print(f"decode step, batch {args.batch}, {args.cache_len}-position cache: "
        f"{report['wall_ms_per_step_untraced']:.2f} ms wall (untraced, best of {args.repeats}); "
        f"thread-time by part (traced):")
  for key, ms in report["by_scope"].items():
    print(f"  {key:24s} {ms:7.3f} ms  {ms / report['total_ms']:6.1%}")
  print(f"  {'total':24s} {report['total_ms']:7.3f} ms  (+ {report['unattributed_ms']:.3f} ms "
        f"in events outside the compiled module)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
