"""Validates a real-size experiment and prints its resource plan, without allocating anything.

  bazel run //tools:plan -- --gin_file=tools/configs/experiments/qwen3_30b_a3b_plan.gin
  bazel run //tools:plan -- --gin_file=tools/configs/experiments/mixtral_8x7b_plan.gin \
      --gin.ExperimentConfig.mesh_shape="(1, 16, 4, 1)" --device_memory_gib=80
  bazel run //tools:plan -- --gin_file=tools/configs/experiments/moe_1b_plan.gin \
      --device_memory_gib=140

The model is built with `jax.eval_shape` (moe.build.abstract) and its shardings come from the
logical-axis table on a `jax.sharding.AbstractMesh`, so a 671B-parameter model on a 1024-device
mesh is planned on a laptop CPU. The mesh is checked against the model and the batches, not
against this machine's devices.

Training memory per device is estimated for AdamW with float32 optimizer state: the weights in
their `param_dtype`, a float32 master copy when the weights are narrower, and two float32
moments, each sharded like its parameter; float32 gradients (the accumulator, plus one
micro-batch's gradients when there are several); and the activations of one training step
(`activation_plan`), with and without rematerialisation, so the plan says whether a step fits.
KV caches and sampler copies are not included.

Activation memory (`activation_plan`) is derived from the model config, the run's batch and
sequence length and the mesh. Per device, one micro-batch holds
    r = ceil(batch_rows / minibatches / micro_batches / (data * fsdp)) rows of T tokens, n = r T,
and the backward pass needs what the forward saved. Per token, with D hidden, H / KV heads of
width d_h, E experts of which k are used, expert width I, dense width F, shared width S,
vocabulary V, a bytes per element of the compute dtype (`ModelConfig.dtype`), f = 4 (float32),
tensor axis t and expert axis e:
    attention layer  2fD + aD + [2a(H + 2KV)d_h + (9 + a)HK + aHd_h] / t
    MoE layer        2fD + aD + 2fE + (k c / e)(3aD + fD + 6aI / t) + 6aS / t
    dense layer      2fD + aD + 6aF / t
    head             4fD + fV / t
where c is the capacity factor when buffers are sized by it (`expert_impl="dispatch"`, or an
expert axis e > 1 with a capacity factor) and 1 otherwise (dropless: each token's k rows).
The terms are the residuals JAX's autodiff saves for this code (jax.ad_checkpoint.
print_saved_residuals): each RMSNorm's float32 input and output and its compute-dtype copy; the
projections' outputs before and after RoPE; the attention scores after the mask (float32), their
exponentials (float32), the mask (one byte) and the probabilities in the compute dtype, all
[H, K] per token, K the keys a query is scored against on average: T for the whole T x T
square, (T + C) / 2 for causal chunks of C query rows (ModelConfig.attention_query_chunk; no
flash attention: each chunk's scores are materialised, the blocks above the diagonal are not); the
routed rows gathered into expert buffers, the SwiGLU's intermediates and each row's float32
output for the combine; the router's float32 logits and probabilities; the final norm, the
float32 LM-head input and the float32 log-probabilities. Tokens are replicated over the expert
axis outside the experts, and the routed rows split over it (all-to-all or psum alike).
Without rematerialisation the step holds n (sum over layers + head). With per-layer
rematerialisation (each decoder layer under `jax.checkpoint`) it holds n (L aD + head) saved,
plus one layer's activations while that layer is recomputed: n (L aD + head + max layer).
The learner does not rematerialise today (moe/model.py has no remat option): the remat figures
say what adding it would buy.
The RL policy objective's preparation pass (a no-grad forward over the device's whole batch,
R = batch_rows / (data * fsdp) rows) holds about one layer and the head at a time:
R T (max layer + head). A step's activation memory is the larger of the two passes.
Assumptions: no sequence packing waste, balanced routing, XLA frees forward temporaries it does
not save (tools/plan_test checks the formula against JAX's saved residuals and against the
compiled temp memory of a tiny model on the CPU).
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
from moe.config import ModelConfig
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


def _routed_rows_factor(cfg: ModelConfig, expert_axis: int) -> float:
  """c of the module docstring: rows per routed assignment in the expert buffers."""
  sized = cfg.capacity_factor is not None and (cfg.expert_impl == "dispatch" or expert_axis > 1)
  return float(cfg.capacity_factor) if sized else 1.0


def activation_bytes_per_token(cfg: ModelConfig, seq_len: int,
                               mesh_shape: Sequence[int]) -> dict:
  """Bytes the backward pass needs per token on one device (the module docstring's terms).

  Returns:
    {"layers": [bytes of each decoder layer], "head": bytes of the final norm and LM head,
     "layer_input": bytes of one layer's input (what a rematerialised layer saves)}.
  """
  axes = dict(zip(sharding.MESH_AXES, (int(s) for s in mesh_shape)))
  t, e = axes["tensor"], axes["expert"]
  a, f = np.dtype(cfg.dtype).itemsize, 4
  d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  norm = 2 * f * d + a * d
  keys = scored_keys_per_query(cfg.attention_query_chunk, seq_len)
  attention = norm + (2 * a * (h + 2 * kv) * hd + (9 + a) * h * keys + a * h * hd) / t
  c = _routed_rows_factor(cfg, e)
  moe = (norm + 2 * f * cfg.num_experts
         + cfg.num_experts_per_tok * c / e * (3 * a * d + f * d
                                              + 6 * a * cfg.moe_intermediate_size / t)
         + 6 * a * cfg.resolved_shared_intermediate_size / t)
  dense = norm + 6 * a * cfg.intermediate_size / t
  layers = [attention + (dense if i < cfg.first_k_dense else moe) for i in range(cfg.num_layers)]
  return {"layers": layers, "head": 4 * f * d + f * cfg.vocab_size / t, "layer_input": a * d}


def scored_keys_per_query(chunk: int, seq_len: int) -> float:
  """The keys a query is scored against, averaged over a row of `seq_len` (moe/attention.py):
  chunk i of `chunk` query rows scores the keys up to its end; 0 (or one chunk) the whole row."""
  if not chunk or chunk >= seq_len:
    return float(seq_len)
  return sum(min(chunk, seq_len - s) * min(seq_len, s + chunk)
             for s in range(0, seq_len, chunk)) / seq_len


def activation_plan(cfg: ModelConfig, *, batch_rows: int, seq_len: int,
                    mesh_shape: Sequence[int], micro_batches: int = 1, minibatches: int = 1,
                    preparation_pass: bool = False) -> dict:
  """Activation memory of one training step on the busiest device (module docstring).

  Args:
    cfg: the model (its compute dtype sizes the activations).
    batch_rows / seq_len: the step's global batch.
    mesh_shape: (data, fsdp, expert, tensor) sizes.
    micro_batches / minibatches: the learner's split of the batch (rl.learner.LearnerConfig);
      one micro-batch's activations are live at a time.
    preparation_pass: the RL policy objective's no-grad forward over the whole batch.

  Returns:
    A dict of bytes: `saved` (no rematerialisation), `saved_remat` (layer inputs and head
    only), `remat` (saved_remat plus one recomputed layer), `preparation` (0 without that
    pass), and the step's `activation_bytes` / `activation_bytes_remat` (the larger pass), with
    the rows and tokens they were computed for.
  """
  if min(batch_rows, seq_len, micro_batches, minibatches) < 1:
    raise ValueError("batch_rows, seq_len, micro_batches and minibatches must be >= 1")
  axes = dict(zip(sharding.MESH_AXES, (int(s) for s in mesh_shape)))
  split = axes["data"] * axes["fsdp"]
  rows = math.ceil(batch_rows / (minibatches * micro_batches * split))
  per = activation_bytes_per_token(cfg, seq_len, mesh_shape)
  n = rows * seq_len
  largest = max(per["layers"]) if per["layers"] else 0.0
  saved = n * (sum(per["layers"]) + per["head"])
  saved_remat = n * (cfg.num_layers * per["layer_input"] + per["head"])
  remat = saved_remat + n * largest
  prep_rows = math.ceil(batch_rows / split)
  prep = prep_rows * seq_len * (largest + per["head"]) if preparation_pass else 0.0
  return {
      "rows_per_micro_batch": rows, "seq_len": seq_len, "tokens_per_micro_batch": n,
      "preparation_rows": prep_rows if preparation_pass else 0,
      "saved": int(saved), "saved_remat": int(saved_remat), "remat": int(remat),
      "preparation": int(prep),
      "activation_bytes": int(max(saved, prep)),
      "activation_bytes_remat": int(max(remat, prep)),
  }


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
  if cfg.rl.steps:
    lc = cfg.rl.learner
    acts = activation_plan(mcfg, batch_rows=pipe.batch_rows, seq_len=pipe.seq_len,
                           mesh_shape=cfg.mesh_shape, micro_batches=lc.micro_batches,
                           minibatches=lc.minibatches,
                           preparation_pass=lc.loss.objective == "policy")
    micro = lc.micro_batches
  else:
    acts = activation_plan(mcfg.replace(capacity_factor=cfg.pretrain.capacity_factor),
                           batch_rows=cfg.pretrain.batch_rows, seq_len=cfg.pretrain.seq_len,
                           mesh_shape=cfg.mesh_shape)
    micro = 1
  # float32 gradients: the accumulator, and one micro-batch's besides when there are several.
  grads = 4 * per_device * (2 if micro > 1 else 1)
  train = weight_bytes + master + moments
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
      "train_bytes_per_device": train,
      "grad_bytes_per_device": grads,
      "activations": acts,
      "activation_bytes_per_device": acts["activation_bytes"],
      "activation_bytes_per_device_remat": acts["activation_bytes_remat"],
      "step_bytes_per_device": train + grads + acts["activation_bytes"],
      "step_bytes_per_device_remat": train + grads + acts["activation_bytes_remat"],
      "tokens_per_step": tokens,
      # 6 N_active FLOPs per trained token (forward + backward), attention excluded.
      "train_flops_per_step": 6 * active * tokens,
  }


def format_plan(p: dict, device_memory_gib: Optional[float] = None) -> str:
  """A human-readable table of `plan(...)`."""
  mesh = " x ".join(f"{ax}={n}" for ax, n in p["mesh"].items())
  a = p["activations"]
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
      ("fp32 gradients per device", f"{p['grad_bytes_per_device'] / GIB:,.2f} GiB"),
      ("rows x tokens per micro-batch and device",
       f"{a['rows_per_micro_batch']:,} x {a['seq_len']:,}"),
      ("activations per device: backward, no remat", _gib(a["saved"])),
      ("activations per device: backward, layer remat", _gib(a["remat"])),
  ]
  if a["preparation"]:
    rows.append(("activations per device: no-grad prep. pass",
                 f"{_gib(a['preparation'])} ({a['preparation_rows']:,} rows)"))
  rows += [
      ("step per device (larger pass), no remat / remat",
       f"{_gib(p['step_bytes_per_device'])} / {_gib(p['step_bytes_per_device_remat'])}"),
      ("tokens per step", f"{p['tokens_per_step']:,}"),
      ("model FLOPs per step (6 N_active T)", f"{p['train_flops_per_step']:.3e}"),
  ]
  if device_memory_gib is not None:
    for what, key in (("training state", "train_bytes_per_device"),
                      ("a step, no remat", "step_bytes_per_device"),
                      ("a step, per-layer remat", "step_bytes_per_device_remat")):
      left = device_memory_gib - p[key] / GIB
      verdict = (f"fits, {left:,.1f} GiB left" if left > 0
                 else f"does not fit: {-left:,.1f} GiB over")
      rows.append((f"on {device_memory_gib:g} GiB devices: {what}", verdict))
  width = max(len(k) for k, _ in rows)
  lines = [f"  {k:<{width}}  {v}" for k, v in rows]
  lines.append("  (estimates from shapes; KV caches and sampler copies excluded; the learner does "
               "not rematerialise yet: the remat rows say what per-layer jax.checkpoint would "
               "give; the activation formula and its assumptions: tools/plan.py's docstring)")
  return "\n".join(lines)


def _gib(n: float) -> str:
  return f"{n / GIB:,.2f} GiB"


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
