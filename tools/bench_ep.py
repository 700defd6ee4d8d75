r"""Expert-parallel dispatch: the all-to-all exchange against the psum baseline (#20).

One MoE block of a model size (default moe/configs/tiny.gin) on 8 CPU devices, forward and
backward (gradients of a scalar loss with respect to the block's parameters and its input), for
2, 4 and 8 expert shards. Every row uses all 8 devices, the mesh (8 / expert, 1, expert, 1): the
same global tokens, split over data and expert. For each row and capacity factor both forms
(`ModelConfig.expert_dispatch` "all_to_all" and "psum") are compiled, then timed alternately in
the same process on the same inputs. Reported per form:
  * step_ms: median wall time of one compiled step;
  * collective bytes per token, from the compiled HLO: for every all-to-all, all-reduce,
    all-gather, reduce-scatter and collective-permute, the bytes of its operands (`operand`), and
    the bytes a device sends under the usual ring/pairwise algorithms (`sent`: all-to-all
    B (g-1)/g, all-reduce 2 B (g-1)/g, all-gather and reduce-scatter (g-1)/g of the gathered /
    scattered array, collective-permute B, for a group of g devices); summed over the program,
    times the devices, over the global tokens; and the sent bytes that are not parameter-gradient
    reductions (all-reduce operands shaped like a parameter or its shard are left out), i.e.
    the token activations and router values each form moves;
  * temp_bytes: XLA's per-device temporary memory (memory_analysis().temp_size_in_bytes).

  bazel run //tools:bench_ep
  .venv/bin/python -m tools.bench_ep --batch_rows 8 --seq_len 256 --capacity_factors none,1.25
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # 8 CPU devices, before JAX starts (tests set their own flags)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from moe import moe_block, sharding  # noqa: E402
from moe.config import ModelConfig  # noqa: E402
from tools import configs  # noqa: E402

DEVICES = 8
DISPATCHES = ("all_to_all", "psum")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-to-all|all-reduce|all-gather|"
                         r"reduce-scatter|collective-permute)(-start)?\(")
_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def group_size(line: str) -> int:
  """Devices per replica group of one collective in XLA's HLO text (explicit, iota or mesh
  form; collective-permute, which has none, counts as a pair)."""
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len([d for d in m.group(1).split(",") if d])
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    sizes = dict((a, int(s)) for a, s in re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return int(np.prod([sizes[a] for a in re.findall(r"'(\w+)'", m.group(2))]))
  if "collective-permute" in line:
    return 2
  raise ValueError(f"no replica groups understood in: {line[:300]}")


def collective_bytes(hlo_text: str, param_shapes=frozenset()) -> dict:
  """Per device, over one compiled HLO module's text: {"operand": bytes handed to collectives,
  "sent": bytes sent (see module doc), "grad_sent": the part of "sent" that reduces parameter
  gradients (operands of all-reduces and reduce-scatters whose shape, in any order of dims, is
  in `param_shapes`), "by_op": {op: (count, operand bytes)}}. XLA:CPU's collectives are
  synchronous; an asynchronous -start is refused rather than miscounted."""
  operand = sent = grad_sent = 0.0
  by_op: dict = {}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.match(line)
    if not m:
      continue
    result, op, start = m.groups()
    if start:
      raise ValueError(f"asynchronous collective not counted: {line[:200]}")
    arrays = [(t, [int(v) for v in dims.split(",") if v])
              for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result)]
    b = float(sum(_ITEMSIZE[t] * int(np.prod(d)) for t, d in arrays))
    g = group_size(line)
    if op == "all-gather":  # the result is the gathered array
      opnd, out = b / g, b * (g - 1) / g
    elif op == "reduce-scatter":  # the result is one device's part
      opnd, out = b * g, b * (g - 1)
    elif op == "all-reduce":
      opnd, out = b, 2 * b * (g - 1) / g
    elif op == "all-to-all":
      opnd, out = b, b * (g - 1) / g
    else:  # collective-permute
      opnd, out = b, b
    operand += opnd
    sent += out
    if op in ("all-reduce", "reduce-scatter") and b:  # XLA combines several into one tuple
      grad = sum(_ITEMSIZE[t] * int(np.prod(d)) for t, d in arrays
                 if tuple(sorted(d)) in param_shapes)
      grad_sent += out * grad / b
    count, total = by_op.get(op, (0, 0.0))
    by_op[op] = (count + 1, total + opnd)
  return {"operand": operand, "sent": sent, "grad_sent": grad_sent, "by_op": by_op}


def block_step(cfg: ModelConfig, mesh_shape: Sequence[int], *, batch_rows: int, seq_len: int,
               seed: int = 0):
  """(compiled step, its arguments): value and gradients of mean(y^2) + the router's losses of one
  MoE block, wrt its parameters and input, sharded on `mesh_shape`."""
  graphdef, state = nnx.split(moe_block.MoEBlock(cfg, rngs=nnx.Rngs(seed)))
  x = jax.random.normal(jax.random.key(seed + 1), (batch_rows, seq_len, cfg.hidden_size),
                        cfg.jnp_dtype)

  def step(state, x):
    def loss(state, x):
      y, _, aux = nnx.merge(graphdef, state)(x)
      return (jnp.mean(jnp.square(y.astype(jnp.float32))) + aux["load_balance_loss"]
              + aux["router_z_loss"])
    return jax.value_and_grad(loss, argnums=(0, 1))(state, x)

  mesh = sharding.make_mesh(mesh_shape)
  with jax.set_mesh(mesh):
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    x = jax.device_put(x, NamedSharding(mesh, sharding.batch_spec(3)))
    compiled = jax.jit(step).lower(state, x).compile()
  return compiled, (state, x)


def param_shapes(state) -> frozenset:
  """Every parameter's whole and per-device shape, dims sorted (to match any transposition)."""
  out = set()
  for leaf in jax.tree.leaves(state):
    out.add(tuple(sorted(leaf.shape)))
    out.add(tuple(sorted(leaf.sharding.shard_shape(leaf.shape))))
  return frozenset(out)


def bench(cfg: ModelConfig, *, expert_shards: Sequence[int] = (2, 4, 8),
          capacity_factors: Sequence[Optional[float]] = (None, 1.25), batch_rows: int = 8,
          seq_len: int = 256, repeats: int = 7, warmup: int = 2) -> list[dict]:
  """One row per (capacity factor, expert shards): both forms' figures and their ratios."""
  tokens = batch_rows * seq_len
  rows = []
  for cf in capacity_factors:
    for ep in expert_shards:
      shape = (DEVICES // ep, 1, ep, 1)
      runs = {}
      for d in DISPATCHES:
        compiled, args = block_step(cfg.replace(capacity_factor=cf, expert_dispatch=d), shape,
                                    batch_rows=batch_rows, seq_len=seq_len)
        coll = collective_bytes(compiled.as_text(), param_shapes(args[0]))
        runs[d] = {"compiled": compiled, "args": args, "times": [],
                   "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                   "operand_bytes_per_token": coll["operand"] * DEVICES / tokens,
                   "sent_bytes_per_token": coll["sent"] * DEVICES / tokens,
                   "activation_sent_bytes_per_token":
                       (coll["sent"] - coll["grad_sent"]) * DEVICES / tokens,
                   "collectives": {op: {"count": c, "operand_bytes_per_device": b}
                                   for op, (c, b) in sorted(coll["by_op"].items())}}
      for i in range(warmup + repeats):  # alternate, so load falls on both alike
        for d in DISPATCHES:
          r = runs[d]
          t0 = time.perf_counter()
          out = jax.block_until_ready(r["compiled"](*r["args"]))
          if i >= warmup:
            r["times"].append(time.perf_counter() - t0)
          r["loss"] = float(out[0])
      row = {"capacity_factor": cf, "expert_shards": ep, "mesh": list(shape), "tokens": tokens}
      for d in DISPATCHES:
        r = runs[d]
        row[d] = {"step_ms": 1e3 * statistics.median(r["times"]), "loss": r["loss"],
                  **{k: r[k] for k in ("temp_bytes", "operand_bytes_per_token",
                                       "sent_bytes_per_token", "activation_sent_bytes_per_token",
                                       "collectives")}}
      a, p = row["all_to_all"], row["psum"]
      row["all_to_all_over_psum"] = {
          k: (a[k] / p[k] if p[k] else None)
          for k in ("step_ms", "sent_bytes_per_token", "activation_sent_bytes_per_token",
                    "operand_bytes_per_token", "temp_bytes")}
      rows.append(row)
  return rows


def markdown(rows: list[dict]) -> str:
  """The table BENCHMARKS.md quotes: each cell all-to-all / psum (all-to-all over psum)."""
  cols = (("step_ms", "step ms", 1, "{:.1f}"),
          ("sent_bytes_per_token", "bytes sent per token, all collectives", 1, "{:.0f}"),
          ("activation_sent_bytes_per_token", "... of them not parameter gradients", 1,
           "{:.0f}"),
          ("temp_bytes", "temp MiB per device", 2**20, "{:.2f}"))
  out = ["| capacity factor | expert shards (mesh) | "
         + " | ".join(f"{name}: a2a / psum (ratio)" for _, name, _, _ in cols) + " |",
         "| --- | --- |" + " --- |" * len(cols)]
  for r in rows:
    a, p, q = r["all_to_all"], r["psum"], r["all_to_all_over_psum"]
    cf = "none (dropless)" if r["capacity_factor"] is None else f"{r['capacity_factor']:g}"
    cells = []
    for key, _, unit, fmt in cols:
      ratio = "n/a" if q[key] is None else f"{q[key]:.2f}x"
      cells.append(f"{fmt.format(a[key] / unit)} / {fmt.format(p[key] / unit)} ({ratio})")
    out.append(f"| {cf} | {r['expert_shards']} ({','.join(map(str, r['mesh']))}) | "
               + " | ".join(cells) + " |")
  return "\n".join(out)


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    return ""


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _factors(text: str) -> list[Optional[float]]:
  return [None if v.strip().lower() == "none" else float(v) for v in text.split(",") if v]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch_rows", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--expert_shards", default="2,4,8")
  p.add_argument("--capacity_factors", default="none,1.25",
                 help="comma-separated; none is dropless (the padded exchange on the CPU)")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--warmup", type=int, default=2)
  args, files, bindings = configs.parse_flags(p, sys.argv[1:] if argv is None else argv)
  configs.parse(files or ["moe/configs/tiny.gin"], bindings)
  cfg = configs.model_config()
  if len(jax.devices()) < DEVICES:
    raise SystemExit(f"needs {DEVICES} devices, has {len(jax.devices())}: run it as a program "
                     "(it sets --xla_force_host_platform_device_count=8 itself)")
  machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "backend": jax.default_backend(),
             "loadavg_before": list(os.getloadavg()), "start_utc": _now()}
  rows = bench(cfg, expert_shards=[int(e) for e in args.expert_shards.split(",")],
               capacity_factors=_factors(args.capacity_factors), batch_rows=args.batch_rows,
               seq_len=args.seq_len, repeats=args.repeats, warmup=args.warmup)
  machine["loadavg_after"] = list(os.getloadavg())
  machine["end_utc"] = _now()
  print(json.dumps({"machine": machine, "model": {
      "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
      "num_experts": cfg.num_experts, "k": cfg.num_experts_per_tok, "dtype": cfg.dtype,
      "expert_impl": cfg.expert_impl}, "rows": rows}, indent=1))
  print(markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
