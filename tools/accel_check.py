r"""Accelerator check (#20): the measurements that need an accelerator, in one prepared run.

  bash scripts/bootstrap.sh --gpu && bazel run //tools:accel_check -- --json=/tmp/accel.json
  .venv/bin/python -m tools.accel_check --tiny_only --json=/tmp/accel.json   # CPU, tiny shapes

Sized to finish within 10 minutes on one H200-class GPU (BENCHMARKS.md has a run on one H200;
`seconds` in the JSON says where the time went; `--sections` reruns a part). Everything is
measured by the project's own benchmark code, imported, not copied:
  1. sampler: `rollout.Engine` tokens/s for batches of 1, 16 and 64 prompts (random tokens,
     greedy, `--new_tokens` each) on the tiny model (moe/configs/tiny.gin) and the ~1B MoE
     (moe/configs/moe_1b.gin), in the sampler dtype (bfloat16 off the CPU): end-to-end and decode
     tokens/s and time to first token (tools/bench_sampler's `bench_engine` / `_timed_decode`),
     best of `--repeats` runs on fresh prompts after a warm-up run that compiles the shapes
     (fresh prompts, so the prefix cache does not skip their prefill).
  2. learner MFU: tools/bench_learner's `bench` on the 1B MoE computing in bfloat16 with float32
     master weights, as rl/learner.py trains. Model FLOPs per token are rl/flops.py's
     6 N_active + 12 L H d_head T (PaLM appendix B; N_active from the config, embedding lookup and
     unused experts excluded); MFU = tokens/s x FLOPs per token / peak FLOP/s of the device. The
     peak comes from `DEVICE_PEAKS` by `jax.devices()[0].device_kind` (datasheet dense bf16,
     each with its source) or `--peak_tflops`; an unknown kind gets none, never a guess. The
     best bf16 matmul rate measured in the same run (bench_learner.matmul_peak) is reported
     beside it, and is the MFU's denominator where no datasheet peak applies (the CPU).
  3. expert dispatch: one MoE block's forward and backward (tools/bench_ep). With 8 or more
     devices, bench_ep's all-to-all against psum rows at 2/4/8 expert shards (step time,
     collective bytes per token from the HLO, temp memory); with fewer (one GPU) there is no
     exchange to measure, and the row is the block's single-device step.
  4. router replay: the sampler's recorded routing against the learner's forward
     (rollout.agreement.measure): completions sampled at temperature 1 by an engine in dtype X,
     scored by the learner's model (float32 weights computing in X) once replaying the recorded
     experts and once routing freely. Reported: the fraction of (MoE layer, token) whose expert
     set the free learner chooses equal to the sampler's (`routing_agreement`), and the max |delta
     logprob| with replay (and without). In float32 on the CPU both paths are the same
     arithmetic: agreement 1.0; bfloat16 (off the CPU) is what the issue asks for.

On the CPU the sampler runs in float32 and replay is measured in float32 only: XLA:CPU in jax
0.10.2 fails the engine's bfloat16 programs ("Unsupported element type for DotThunk::Execute:
BF16 x BF16 = F32"); `--sampler_dtype` / `--replay_dtypes` force a choice. A section that fails
is recorded (`errors`) and the others still run; the exit status is then 1.
`--tiny_only` builds no 1B model: learner, dispatch and replay use the tiny model, so with small
shape flags the whole check runs on a CPU in a minute (tools/accel_check_test.py).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # 8 CPU devices for the dispatch rows on a CPU; a GPU ignores it
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from moe import build  # noqa: E402
from moe.config import ModelConfig  # noqa: E402
from rl import flops  # noqa: E402
from rollout import agreement  # noqa: E402
from rollout import warmup  # noqa: E402
from rollout.engine import Engine, EngineConfig  # noqa: E402
from tools import bench_ep  # noqa: E402
from tools import bench_learner  # noqa: E402
from tools import bench_sampler  # noqa: E402
from tools import configs  # noqa: E402

SECTIONS = ("sampler", "replay", "learner", "dispatch")

# Dense (no sparsity) bf16 peak per chip by `device_kind`, and where the number comes from. A kind
# not listed gets no datasheet MFU (give --peak_tflops); matching is exact so that, e.g., an H100
# PCIe is never credited with the SXM part's peak.
DEVICE_PEAKS = {
    "NVIDIA H200": (flops.PEAK_FLOPS["h200"], "NVIDIA H200 datasheet (SXM): 1,979 TFLOP/s bf16 "
                    "with 2:4 sparsity, so 989 dense"),
    "NVIDIA H100 80GB HBM3": (flops.PEAK_FLOPS["h100"], "NVIDIA H100 datasheet (SXM5): 1,979 "
                              "TFLOP/s bf16 with sparsity, so 989 dense"),
    "NVIDIA H100 PCIe": (756e12, "NVIDIA H100 datasheet (PCIe): 1,513 TFLOP/s bf16 with "
                         "sparsity, so 756 dense"),
    "NVIDIA A100-SXM4-80GB": (flops.PEAK_FLOPS["a100"], "NVIDIA A100 datasheet: 312 TFLOP/s "
                              "bf16 dense"),
    "NVIDIA A100-SXM4-40GB": (flops.PEAK_FLOPS["a100"], "NVIDIA A100 datasheet: 312 TFLOP/s "
                              "bf16 dense"),
    "NVIDIA B200": (flops.PEAK_FLOPS["b200"], "NVIDIA HGX B200 datasheet: 4.5 PFLOP/s bf16 per "
                    "GPU with sparsity, so 2,250 TFLOP/s dense"),
    "TPU v4": (flops.PEAK_FLOPS["tpu_v4"], "Cloud TPU v4 documentation: 275 TFLOP/s bf16 per "
               "chip"),
    "TPU v5 lite": (flops.PEAK_FLOPS["tpu_v5e"], "Cloud TPU v5e documentation: 197 TFLOP/s "
                    "bf16 per chip"),
    "TPU v5": (flops.PEAK_FLOPS["tpu_v5p"], "Cloud TPU v5p documentation: 459 TFLOP/s bf16 per "
               "chip"),
    "TPU v6 lite": (918e12, "Cloud TPU v6e (Trillium) documentation: 918 TFLOP/s bf16 per "
                    "chip"),
}

CPU_BF16_FAILS = ("XLA:CPU in jax 0.10.2 fails the sampler's bfloat16 programs (\"Unsupported "
                  "element type for DotThunk::Execute: BF16 x BF16 = F32\"): float32 only")


def device_peak(device_kind: str, peak_tflops: Optional[float] = None
                ) -> tuple[Optional[float], str]:
  """(peak FLOP/s per device or None, where it comes from): `--peak_tflops` first, then
  `DEVICE_PEAKS` by exact device kind."""
  if peak_tflops is not None:
    if peak_tflops <= 0:
      raise ValueError(f"--peak_tflops must be positive, got {peak_tflops}")
    return peak_tflops * 1e12, f"--peak_tflops {peak_tflops:g}"
  if device_kind in DEVICE_PEAKS:
    return DEVICE_PEAKS[device_kind]
  return None, (f"no datasheet peak for device kind {device_kind!r} in DEVICE_PEAKS "
                "(--peak_tflops gives one)")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


# --- 1. sampler ----------------------------------------------------------------------------------


def sampler_rows(label: str, engine: Engine, vocab: int, *, batches: Sequence[int],
                 prompt_len: int, new_tokens: int, repeats: int, seed: int = 0) -> list[dict]:
  """Tokens/s of `engine` for each batch size: two warm-up runs, then the best of `repeats`
  runs, each on fresh random prompts of the same shape. Two warm-up runs, because the first
  run of a batch size leaves the prefix cache holding blocks, and the next one copies a
  different count of blocks into it in one call (`prefix_programs.save_blocks`, one program per
  padded count): with one warm-up the first timed run compiled that copy. `compiled_while_timed`
  counts the XLA compilations inside the timed runs (0: the figures are warm)."""
  rng = np.random.default_rng(seed)
  rows = []
  for b in batches:
    for _ in range(2):
      bench_sampler.bench_engine(engine, rng.integers(0, vocab, (b, prompt_len)), new_tokens)
    with warmup.CompileCounter() as compiled:
      runs = [bench_sampler._timed_decode(  # pylint: disable=protected-access
          engine, rng.integers(0, vocab, (b, prompt_len)), new_tokens, 0)
              for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tokens_per_s"])
    rows.append({"model": label, "batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens,
                 "compiled_while_timed": compiled.executables,
                 "tokens_per_s": best["tokens_per_s"],
                 "decode_tokens_per_s": max(r["decode_tok_s"] for r in runs),
                 "ttft_s": best["ttft_s"], "latency_s": best["latency_s"],
                 "all_tokens_per_s": [r["tokens_per_s"] for r in runs]})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "all_tokens_per_s"}), flush=True)
  return rows


# --- 2. learner ----------------------------------------------------------------------------------


def learner_row(cfg: ModelConfig, *, dtype: str, seq_len: int, batch_rows: int, steps: int,
                warmup: int, micro_batches: int, objective: str, peak: Optional[float],
                peak_source: str, matmul_sizes: Sequence[int]) -> dict:
  """bench_learner.bench on one device with float32 master weights computing in `dtype`, MFU
  against `peak` (else against the matmul rate measured here), and that measured rate."""
  lcfg = cfg.replace(param_dtype="float32", dtype=dtype,
                     max_seq_len=max(cfg.max_seq_len, seq_len))
  r = bench_learner.bench(lcfg, seq_len=seq_len, batch_rows=batch_rows, steps=steps,
                          warmup=warmup, objective=objective, mesh_shape=(1, 1, 1, 1),
                          micro_batches=micro_batches,
                          peak_tflops=peak / 1e12 if peak else None)
  measured = bench_learner.matmul_peak(dtype, sizes=tuple(matmul_sizes))
  r.update({
      "dtype": dtype, "param_dtype": "float32",
      "train_flops_per_token": flops.train_flops_per_token(lcfg, seq_len),
      "matmul_peak_tflops": measured["flops"] / 1e12, "matmul_peak_n": measured["n"],
      "mfu_vs_matmul_peak": r["model_tflops_per_s"] / (measured["flops"] / 1e12),
  })
  if peak:
    r["peak_source"] = peak_source
  else:
    r.update({"mfu": r["mfu_vs_matmul_peak"], "peak_tflops": measured["flops"] / 1e12,
              "peak_source": f"best measured {dtype} matmul here (n={measured['n']}); "
                             f"{peak_source}"})
  print(json.dumps({k: r[k] for k in ("tokens_per_s", "step_time_s", "mfu", "peak_source")}),
        flush=True)
  return r


# --- 3. expert dispatch --------------------------------------------------------------------------


def dispatch_rows(cfg: ModelConfig, *, batch_rows: int, seq_len: int,
                  expert_shards: Sequence[int], capacity_factors: Sequence[Optional[float]],
                  repeats: int, warmup: int) -> dict:
  """bench_ep's all-to-all vs psum rows on its 8 devices, or one device's block step."""
  if len(jax.devices()) >= bench_ep.DEVICES:
    shards = [e for e in expert_shards if cfg.num_experts % e == 0]
    rows = bench_ep.bench(cfg, expert_shards=shards, capacity_factors=capacity_factors,
                          batch_rows=batch_rows, seq_len=seq_len, repeats=repeats,
                          warmup=warmup)
    return {"devices": bench_ep.DEVICES, "rows": rows}
  compiled, args = bench_ep.block_step(cfg, (1, 1, 1, 1), batch_rows=batch_rows,
                                       seq_len=seq_len)
  times = []
  for i in range(warmup + repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return {"devices": 1, "rows": [], "single_device": {
      "tokens": batch_rows * seq_len, "step_ms": 1e3 * statistics.median(times),
      "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
      "note": f"{len(jax.devices())} device(s): no all-to-all to measure (bench_ep needs "
              f"{bench_ep.DEVICES}); this is one MoE block's forward and backward on one device"}}


# --- 4. router replay ----------------------------------------------------------------------------


def jitted_forward(model):
  """`model`'s forward as one compiled program, called as `model(tokens, routing=...)`.

  rollout.agreement.measure calls the model it is given; a plain nnx module would run op by op,
  compiling every op (~10 s per dtype for the tiny model on a loaded CPU), while the learner
  itself runs its forward compiled, which is what replay is to agree with.
  """
  forward = nnx.jit(lambda m, tokens, routing: m(tokens, routing=routing))
  return lambda tokens, routing=None: forward(model, tokens, routing)


def replay_row(engine: Engine, learner_model, vocab: int, *, dtype: str, batch: int,
               prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
  """rollout.agreement.measure of `batch` completions sampled by `engine` at temperature 1,
  scored by `learner_model`'s compiled forward."""
  prompts = np.random.default_rng(seed + 1).integers(0, vocab, (batch, prompt_len))
  r = bench_sampler.bench_engine(engine, prompts, new_tokens, temperature=1.0, seed=seed)
  out = agreement.measure(jitted_forward(learner_model), prompts.tolist(), r["completions"],
                          temperature=1.0)
  out["dtype"] = dtype
  print("replay", json.dumps(out), flush=True)
  return out


# --- the run -------------------------------------------------------------------------------------


def _engine_config(args, dtype: str) -> EngineConfig:
  return EngineConfig(max_slots=max(args.batches + [args.replay_batch]),
                      max_len=_round_up(args.prompt_len + args.new_tokens, args.length_bucket),
                      decode_steps=args.decode_steps, length_bucket=args.length_bucket,
                      dtype=dtype)


def run(args, tiny: ModelConfig, big: Optional[ModelConfig]) -> dict:
  """Every section of `args.sections`; one failing is recorded in `errors`, the others run."""
  report = {"machine": machine_info(), "settings": vars(args).copy(), "seconds": {},
            "errors": {}, "models": {"tiny": _model_info(tiny)}}
  if jax.default_backend() == "cpu":
    report["note"] = CPU_BF16_FAILS
  if big is not None:
    report["models"]["1b"] = _model_info(big)
  main_label, main_cfg = ("1b", big) if big is not None else ("tiny", tiny)
  report["main_model"] = main_label
  models = {"tiny": tiny, **({"1b": big} if big is not None else {})}
  engines: dict = {}  # (model, dtype) -> Engine, shared by the sampler and replay sections

  def engine(label: str, dtype: str) -> Engine:
    if (label, dtype) not in engines:
      cfg = models[label]
      # The learner's float32 master weights, as weight sync hands them to a sampler.
      model = build.create(cfg.replace(param_dtype="float32"), seed=args.seed)
      engines[label, dtype] = Engine(model, config=_engine_config(args, dtype))
    return engines[label, dtype]

  def attempt(name, fn):
    """fn(), or None with the failure recorded under `name`, so one part failing (a model
    that does not fit, a dtype the backend lacks) costs only its own figures."""
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      report["errors"][name] = f"{type(e).__name__}: {e}"
      traceback.print_exc()
      return None

  def section(name, fn):
    if name not in args.sections:
      return
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    result = attempt(name, fn)
    if result is not None:
      report[name] = result
    report["seconds"][name] = time.perf_counter() - t0

  def sampler():
    rows = []
    for label, cfg in models.items():
      rows += attempt(f"sampler {label}", lambda: sampler_rows(
          label, engine(label, args.sampler_dtype), cfg.vocab_size, batches=args.batches,
          prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
          seed=args.seed)) or []
    return {"dtype": args.sampler_dtype, "rows": rows}

  def replay_one(dtype):
    learner_model = build.create(main_cfg.replace(param_dtype="float32", dtype=dtype),
                                 seed=args.seed)
    return replay_row(engine(main_label, dtype), learner_model, main_cfg.vocab_size,
                      dtype=dtype, batch=args.replay_batch, prompt_len=args.prompt_len,
                      new_tokens=args.replay_new_tokens, seed=args.seed)

  def replay():
    out = {"model": main_label}
    for dtype in args.replay_dtypes:
      r = attempt(f"replay {dtype}", lambda: replay_one(dtype))
      if r is not None:
        out[dtype] = r
    return out

  section("sampler", sampler)
  section("replay", replay)
  for e in engines.values():  # free the samplers' memory before the learner's
    e.stop()
  engines.clear()
  gc.collect()

  peak, peak_source = device_peak(jax.devices()[0].device_kind, args.peak_tflops)
  section("learner", lambda: {"model": main_label, **learner_row(
      main_cfg, dtype=args.learner_dtype, seq_len=args.seq_len, batch_rows=args.batch_rows,
      steps=args.steps, warmup=args.warmup, micro_batches=args.micro_batches,
      objective=args.objective, peak=peak, peak_source=peak_source,
      matmul_sizes=args.matmul_sizes)})
  gc.collect()
  section("dispatch", lambda: {"model": main_label, **dispatch_rows(
      main_cfg, batch_rows=args.ep_batch_rows, seq_len=args.ep_seq_len,
      expert_shards=args.expert_shards, capacity_factors=args.capacity_factors,
      repeats=args.ep_repeats, warmup=args.ep_warmup)})
  report["machine"]["loadavg_end"] = list(os.getloadavg())
  report["machine"]["end_utc"] = _now()
  return report


def _model_info(cfg: ModelConfig) -> dict:
  return {"params": build.param_count(build.abstract(cfg)),
          "active_params": build.active_param_count(cfg),
          "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
          "num_experts": cfg.num_experts, "k": cfg.num_experts_per_tok,
          "vocab_size": cfg.vocab_size}


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict:
  """What ran the check: backend, device kind and count, jax, host CPU, load, start time."""
  d = jax.devices()
  cpu = bench_sampler._cpu_model()  # pylint: disable=protected-access
  return {"backend": jax.default_backend(), "device_kind": d[0].device_kind, "devices": len(d),
          "jax": jax.__version__, "cpu": cpu, "cores": os.cpu_count(),
          "loadavg_start": list(os.getloadavg()), "start_utc": _now()}


def markdown(report: dict) -> str:
  """The report as the tables BENCHMARKS.md quotes."""
  m = report["machine"]
  out = [f"{m['backend']} ({m['device_kind']}, {m['devices']} device(s)), jax {m['jax']}, "
         f"{m['start_utc']}, load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}", ""]
  if "sampler" in report:
    out += [f"Sampler ({report['sampler']['dtype']}): tokens/s",
            "| model | batch | prompt + new tokens | end-to-end tok/s | decode tok/s | TTFT s | "
            "compiled while timed |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["sampler"]["rows"]:
      out.append(f"| {r['model']} | {r['batch']} | {r['prompt_len']} + {r['new_tokens']} | "
                 f"{r['tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
                 f"{r['ttft_s']:.3f} | {r['compiled_while_timed']} |")
    out.append("")
  if "learner" in report:
    r = report["learner"]
    out += ["Learner (one device)",
            "| model | compute / weights | rows x T | step s | tokens/s | model TFLOP/s | MFU | "
            "peak TFLOP/s (source) | vs measured matmul peak |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {r['model']} | {r['dtype']} / {r['param_dtype']} | {r['batch_rows']} x "
            f"{r['seq_len']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['model_tflops_per_s']:.3g} | {r['mfu']:.1%} | {r['peak_tflops']:.3g} "
            f"({r['peak_source']}) | {r['mfu_vs_matmul_peak']:.1%} of "
            f"{r['matmul_peak_tflops']:.3g} |", ""]
  if "dispatch" in report:
    d = report["dispatch"]
    out.append(f"Expert dispatch, one MoE block of {d['model']}, forward + backward")
    if d["rows"]:
      out.append(bench_ep.markdown(d["rows"]))
    else:
      s = d["single_device"]
      out += [f"{s['tokens']} tokens: {s['step_ms']:.2f} ms, temp "
              f"{s['temp_bytes'] / 2**20:.1f} MiB ({s['note']})"]
    out.append("")
  if "replay" in report:
    rep = report["replay"]
    out += [f"Router replay ({rep['model']}): sampler vs learner forward",
            "| dtype | tokens | same experts (free routing) | max abs dlogprob, replayed | "
            "mean abs dlogprob | max abs dlogprob, free routing |",
            "| --- | --- | --- | --- | --- | --- |"]
    for k, r in rep.items():
      if isinstance(r, dict):
        out.append(f"| {k} | {r['tokens']} | {r['routing_agreement']:.2%} | "
                   f"{r['max_abs_dlogprob']:.2e} | {r['mean_abs_dlogprob']:.2e} | "
                   f"{r['max_abs_dlogprob_free_routing']:.2e} |")
    out.append("")
  for name, err in report["errors"].items():
    out.append(f"**{name} failed**: {err}")
  out.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()))
  return "\n".join(out)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
  """(flags with backend-dependent defaults filled in, gin files, gin bindings)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--json", default="/tmp/accel_check.json", help="where the report goes")
  p.add_argument("--tiny_gin", default="moe/configs/tiny.gin")
  p.add_argument("--big_gin", default="moe/configs/moe_1b.gin")
  p.add_argument("--tiny_only", action="store_true",
                 help="no 1B model: learner, dispatch and replay use the tiny one (CPU runs)")
  p.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {SECTIONS}")
  p.add_argument("--seed", type=int, default=0)
  g = p.add_argument_group("sampler")
  g.add_argument("--batches", default="1,16,64")
  g.add_argument("--prompt_len", type=int, default=128)
  g.add_argument("--new_tokens", type=int, default=128)
  g.add_argument("--repeats", type=int, default=2)
  g.add_argument("--decode_steps", type=int, default=16)
  g.add_argument("--length_bucket", type=int, default=64)
  g.add_argument("--sampler_dtype", default=None,
                 help="default bfloat16, float32 on the CPU (see the module docstring)")
  g = p.add_argument_group("learner")
  g.add_argument("--seq_len", type=int, default=1024)
  g.add_argument("--batch_rows", type=int, default=16)
  g.add_argument("--steps", type=int, default=5)
  g.add_argument("--warmup", type=int, default=2)
  g.add_argument("--micro_batches", type=int, default=1)
  g.add_argument("--objective", choices=("next_token", "policy"), default="next_token")
  g.add_argument("--learner_dtype", default="bfloat16")
  g.add_argument("--peak_tflops", type=float, default=None,
                 help="peak bf16 TFLOP/s of one device (default: DEVICE_PEAKS by device kind)")
  g.add_argument("--matmul_sizes", default=None,
                 help="square matmul sizes of the measured peak (default 1024..8192; CPU "
                      "256..1024)")
  g = p.add_argument_group("expert dispatch")
  g.add_argument("--ep_batch_rows", type=int, default=8)
  g.add_argument("--ep_seq_len", type=int, default=1024)
  g.add_argument("--expert_shards", default="2,4,8")
  g.add_argument("--capacity_factors", default="none,1.25")
  g.add_argument("--ep_repeats", type=int, default=5)
  g.add_argument("--ep_warmup", type=int, default=2)
  g = p.add_argument_group("router replay")
  g.add_argument("--replay_dtypes", default=None,
                 help="default bfloat16,float32; float32 on the CPU (see the module docstring)")
  g.add_argument("--replay_batch", type=int, default=16)
  g.add_argument("--replay_new_tokens", type=int, default=64)
  args, files, bindings = configs.parse_flags(p, argv)
  if files:
    p.error("give model sizes with --tiny_gin / --big_gin (--gin.ModelConfig.X=V binds both)")
  cpu = jax.default_backend() == "cpu"
  args.batches = _ints(args.batches)
  args.expert_shards = _ints(args.expert_shards)
  factors = bench_ep._factors  # pylint: disable=protected-access
  args.capacity_factors = factors(args.capacity_factors)
  args.sections = [s for s in args.sections.split(",") if s]
  args.sampler_dtype = args.sampler_dtype or ("float32" if cpu else "bfloat16")
  args.replay_dtypes = [d for d in (args.replay_dtypes
                                    or ("float32" if cpu else "bfloat16,float32")).split(",") if d]
  args.matmul_sizes = _ints(args.matmul_sizes or ("256,512,1024" if cpu else
                                                  "1024,2048,4096,8192"))
  unknown = sorted(set(args.sections) - set(SECTIONS))
  if unknown:
    p.error(f"unknown --sections {unknown}; known: {SECTIONS}")
  for d in [args.sampler_dtype, args.learner_dtype, *args.replay_dtypes]:
    if d not in ("float32", "bfloat16"):
      p.error(f"dtype must be float32 or bfloat16, got {d!r}")
  if args.replay_new_tokens > args.new_tokens:
    p.error("--replay_new_tokens must be <= --new_tokens (one engine shape serves both)")
  if not args.batches or min(args.batches) < 1 or args.repeats < 1 or args.steps < 1:
    p.error("--batches, --repeats and --steps must be positive")
  if args.peak_tflops is not None and args.peak_tflops <= 0:
    p.error(f"--peak_tflops must be positive, got {args.peak_tflops}")
  return args, [args.tiny_gin] + ([] if args.tiny_only else [args.big_gin]), bindings


def load_model(gin_file: str, bindings: Sequence[str]) -> ModelConfig:
  configs.parse([gin_file], bindings)
  return configs.model_config()


def main(argv: Optional[Sequence[str]] = None) -> int:
  args, files, bindings = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    tiny = load_model(files[0], bindings)
    big = None if args.tiny_only else load_model(files[1], bindings)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report = run(args, tiny, big)
  path = configs.workspace_path(args.json)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist")
              else str(o))
  print(markdown(report), flush=True)
  print(f"wrote {path}", flush=True)
  return 1 if report["errors"] else 0


if __name__ == "__main__":
  sys.exit(main())
