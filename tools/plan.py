"""Validates a real-size experiment and prints its resource plan, without allocating anything.

  bazel run //tools:plan -- --gin_file=tools/configs/experiments/qwen3_30b_a3b_plan.gin
  bazel run //tools:plan -- --gin_file=tools/configs/experiments/mixtral_8x7b_plan.gin \
      --gin.ExperimentConfig.mesh_shape="(1, 16, 4, 1)" --device_memory_gib=80

The model is built with `jax.eval_shape` (moe.build.abstract) and its shardings come from the
logical-axis table on a `jax.sharding.AbstractMesh`, so a 671B-parameter model on a 1024-device
mesh is planned on a laptop CPU. The mesh is checked against the model and the batches, not
against this machine's devices.

Training memory per device is estimated for AdamW with float32 optimizer state: the weights in
their `param_dtype`, a float32 master copy when the weights are narrower, and two float32
moments, each sharded like its parameter. Activations, KV caches, gradients in flight and
sampler copies are not included.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from experiment.config import ExperimentConfig
from moe import build
from moe import sharding
from tools import configs

GIB = 1024 ** 3


def abstract_mesh(mesh_shape: Sequence[int]) -> jax.sharding.AbstractMesh:
  """A device-free mesh with the project's axis names (only its shape is ever read)."""
  return jax.sharding.AbstractMesh(tuple(int(s) for s in mesh_shape), sharding.MESH_AXES)


def _shard_elements(state: Any, mesh: Any) -> list[tuple[int, int, Optional[tuple]]]:
  """(total elements, elements on the busiest device, logical axes) of every variable."""
  specs = sharding.state_specs(state, mesh)
  is_var = lambda x: isinstance(x, nnx.Variable)
  out = []
  for v, s in zip(jax.tree.leaves(state, is_leaf=is_var), jax.tree.leaves(specs, is_leaf=is_var)):
    shape = v.get_value().shape
    n = int(np.prod(shape))
    split = 1
    for ax in s.get_value():
      for a in ((ax,) if isinstance(ax, str) else (ax or ())):
        split *= mesh.shape[a]
    out.append((n, n // split, v.get_metadata().get("logical_axes")))
  return out


def plan(cfg: ExperimentConfig, model: Optional[nnx.Module] = None) -> dict:
  """The resource plan of `cfg` on its mesh, from shapes only.

  Args:
    cfg: a validated experiment (configs.load_experiment(..., check_devices=False)).
    model: its abstract model, if already built (moe.build.abstract(cfg.model)); building it
      takes ~25 s for the 61-layer DeepSeek-V3-like model on a loaded CPU.

  Returns:
    A dict of counts and bytes; `*_per_device` values are for the busiest device.
  """
  mcfg = cfg.model
  model = build.abstract(mcfg) if model is None else model
  mesh = abstract_mesh(cfg.mesh_shape)
  params = _shard_elements(nnx.state(model, nnx.Param), mesh)
  total = sum(n for n, _, _ in params)
  # Routed experts are the leaves with an `exp` axis; a token uses k of their E slices.
  routed = sum(n for n, _, axes in params if axes and "exp" in axes)
  active = total - routed * (mcfg.num_experts - mcfg.num_experts_per_tok) // mcfg.num_experts
  per_device = sum(d for _, d, _ in params)
  weight_bytes = sharding.bytes_per_device(nnx.state(model), mesh)
  master = 0 if np.dtype(mcfg.param_dtype) == np.float32 else 4 * per_device
  moments = 2 * 4 * per_device
  pipe = cfg.rl.pipeline
  tokens = pipe.batch_rows * pipe.seq_len if cfg.rl.steps else (
      cfg.pretrain.batch_rows * cfg.pretrain.seq_len)
  return {
      "mesh": dict(mesh.shape),
      "devices": math.prod(cfg.mesh_shape),
      "params": total,
      "active_params": active,
      "routed_expert_params": routed,
      "param_dtype": mcfg.param_dtype,
      "params_per_device": per_device,
      "weight_bytes_per_device": weight_bytes,
      "master_bytes_per_device": master,
      "adam_bytes_per_device": moments,
      "train_bytes_per_device": weight_bytes + master + moments,
      "tokens_per_step": tokens,
      # 6 N_active FLOPs per trained token (forward + backward), attention excluded.
      "train_flops_per_step": 6 * active * tokens,
  }


def format_plan(p: dict, device_memory_gib: Optional[float] = None) -> str:
  """A human-readable table of `plan(...)`."""
  mesh = " x ".join(f"{a}={s}" for a, s in p["mesh"].items())
  rows = [
      ("mesh", f"{mesh} ({p['devices']} devices)"),
      ("parameters", f"{p['params'] / 1e9:,.2f}B ({p['params']:,})"),
      ("active per token", f"{p['active_params'] / 1e9:,.2f}B"),
      ("routed experts", f"{p['routed_expert_params'] / 1e9:,.2f}B"),
      ("parameters per device", f"{p['params_per_device'] / 1e9:,.3f}B"),
      (f"weights ({p['param_dtype']}) per device",
       f"{p['weight_bytes_per_device'] / GIB:,.2f} GiB"),
      ("fp32 master copy per device", f"{p['master_bytes_per_device'] / GIB:,.2f} GiB"),
      ("Adam moments (2 x fp32) per device", f"{p['adam_bytes_per_device'] / GIB:,.2f} GiB"),
      ("training state per device", f"{p['train_bytes_per_device'] / GIB:,.2f} GiB"),
      ("tokens per step", f"{p['tokens_per_step']:,}"),
      ("model FLOPs per step (6 N_active T)", f"{p['train_flops_per_step']:.3e}"),
  ]
  if device_memory_gib is not None:
    left = device_memory_gib - p["train_bytes_per_device"] / GIB
    verdict = (f"fits, {left:,.1f} GiB left for activations and caches" if left > 0
               else f"does not fit: {-left:,.1f} GiB over")
    rows.append((f"on {device_memory_gib:g} GiB devices", verdict))
  width = max(len(k) for k, _ in rows)
  lines = [f"  {k:<{width}}  {v}" for k, v in rows]
  lines.append("  (estimate excludes activations, KV caches, gradients in flight, samplers)")
  return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
  """(flags, gin files, gin bindings); at least one gin file is required."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--device_memory_gib", type=float, default=None,
                 help="memory of one device; the plan then says whether the state fits")
  args, files, bindings = configs.parse_flags(p, argv)
  if not files:
    p.error("give the experiment: --gin_file=tools/configs/experiments/*_plan.gin")
  return args, files, bindings


def main(argv: Optional[Sequence[str]] = None) -> int:
  args, files, bindings = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    cfg = configs.load_experiment(files, bindings, check_devices=False)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"config valid: {', '.join(files)}", flush=True)
  print(format_plan(plan(cfg), args.device_memory_gib))
  return 0


if __name__ == "__main__":
  sys.exit(main())
