"""Sampler benchmark: rollout.Engine vs transformers `generate` on the same tiny Mixtral.

Run (about 5 minutes on 2 cores; BENCHMARKS.md "## Sampler (rollout/)" holds the results):
  .venv/bin/python -m tools.bench_sampler --json /tmp/bench_sampler.json
  bazel run //tools:bench_sampler -- --skip_1b

What it measures, all in one run on the same weights and prompts:
  1. A seeded random `MixtralForCausalLM` (vocab 1024, hidden 256, intermediate 512, 4 layers,
     8 heads / 4 kv heads, 8 experts top-2) is saved with transformers and imported through
     `moe.hf`. Greedy decoding of 128 new tokens for batch 1, 16 and 64 prompts of 32 tokens:
     new tokens/s and latency for transformers (torch, CPU) and for the engine (fast mode and
     deterministic mode), best of `--repeats` after a warm-up (compilation) run, interleaved so
     both see the same machine load. Also how often the greedy tokens equal transformers'.
  2. Sampler-vs-learner agreement on sampled completions (temperature 1): max/mean |delta
     logprob|, KL estimates, routing agreement (`rollout.agreement`), fast and deterministic.
  3. Weight swap while serving, for the tiny model and a ~1B-parameter bf16 config: the
     decode-loop pause, the release of the old weights (deferred into the first decode call
     after the swap), that first call against the steady calls of the same shapes just before
     the swap, preparation time, and a plain reload (a fresh engine from the same weights,
     compiled, first token).

  4. The routed-expert matmul shape the batch-64 decode step is made of, [8, m, 256] x
     [8, 256, 1024] (gate and up projections of 8 experts, m tokens each), as GFLOP/s through
     XLA (a jitted einsum, as rollout.forward runs it) and through torch.bmm with 1 and 2
     threads, in the same process and minutes as the rest.

  `--only_shape_buckets` runs instead: "coarse" against "fine" shape buckets
  (`EngineConfig.shape_buckets`) on the same model, prompts and settings (`--length_bucket`),
  both warm: decode tokens/s (the engine's own decode-call count and seconds), end-to-end
  tokens/s, TTFT, and each engine's program count (what a server's warm-up compiles). E.g.
    .venv/bin/python -m tools.bench_sampler --only_shape_buckets --length_bucket=64 \
        --new_tokens=224 --repeats=5 --batches=1,8,16,64 [--logprobs=5]
  (`--logprobs`: every request asks for that many alternatives, so both engines compute the
  top-k, and the ratio is the other buckets' cost alone).

  `--only_replicas` runs instead: one engine against two data-parallel replicas
  (`rollout.replicas`, each replica an engine like the one, on its own device) on the same
  prompts, sent as one request each so that they spread over the replicas, both warm, the order
  alternating: end-to-end tokens/s and the share each replica served. Needs two devices; on the
  CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python -m tools.bench_sampler \
        --only_replicas --batches=16,64 --new_tokens=128 --repeats=3

Threads: transformers runs with 1 and with 2 torch threads (`torch.set_num_threads`) and keeps
its better result; XLA's CPU client sizes its thread pool to the schedulable cores, recorded as
`xla_threads` (this process's CPU affinity).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from moe import build
from moe import hf
from moe import params as moe_params
from moe.config import ModelConfig
from rollout import agreement
from rollout import replicas as replicas_lib
from rollout import warmup
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams

TINY_MIXTRAL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=512, rope_theta=10000.0,
                    rms_norm_eps=1e-5)
QUICK_MIXTRAL = dict(TINY_MIXTRAL, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)


def make_hf_checkpoint(path: str, spec: dict, seed: int = 0):
  """Saves a seeded random transformers Mixtral; returns the torch model (eval, fp32)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  config = transformers.MixtralConfig(**spec)
  model = transformers.MixtralForCausalLM(config).eval()
  model.save_pretrained(path)
  return model


def bench_transformers(model, prompts: np.ndarray, new_tokens: int, threads: int) -> dict:
  import torch
  torch.set_num_threads(threads)
  ids = torch.tensor(prompts, dtype=torch.long)
  t0 = time.perf_counter()
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
  dt = time.perf_counter() - t0
  gen = out[:, prompts.shape[1]:].numpy()
  return {"tokens_per_s": gen.size / dt, "latency_s": dt, "tokens": gen, "threads": threads}


def bench_engine(engine: Engine, prompts: np.ndarray, new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, logprobs: int = 0) -> dict:
  first = {}
  lock = threading.Lock()
  t0 = time.perf_counter()

  def on_tokens(h, i, toks, lps, reason):
    if toks:
      with lock:
        first.setdefault(h.id, time.perf_counter() - t0)

  params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=seed,
                          ignore_eos=True, logprobs=logprobs)
  handles = engine.submit_batch(prompts.tolist(), params, on_tokens=on_tokens)
  done = []
  for h in handles:
    h.result()
    done.append(time.perf_counter() - t0)
  dt = time.perf_counter() - t0
  comps = [h.result()[0] for h in handles]
  n = sum(len(c.token_ids) for c in comps)
  return {"tokens_per_s": n / dt, "latency_s": dt,
          "ttft_s": statistics.mean(first.values()), "request_p50_s": statistics.median(done),
          "tokens": np.asarray([c.token_ids for c in comps]), "completions": comps}


def _best(runs):
  return max(runs, key=lambda r: r["tokens_per_s"])


def throughput(torch_model, engines: dict, rng, batches, prompt_len, new_tokens, repeats,
               vocab, torch_threads=(1, 2)) -> list:
  rows = []
  for b in batches:
    prompts = rng.integers(0, vocab, (b, prompt_len))
    for eng in engines.values():  # warm-up: compiles every shape this workload uses
      bench_engine(eng, prompts, new_tokens)
    bench_transformers(torch_model, prompts, 4, torch_threads[0])
    runs = {"transformers": []}
    runs.update({name: [] for name in engines})
    for _ in range(repeats):
      for t in torch_threads:  # torch's best thread count on this (shared) machine
        runs["transformers"].append(bench_transformers(torch_model, prompts, new_tokens, t))
      for name, eng in engines.items():
        runs[name].append(bench_engine(eng, prompts, new_tokens))
    best = {k: _best(v) for k, v in runs.items()}
    ref = best["transformers"]
    row = {"batch": b, "transformers_tok_s": ref["tokens_per_s"],
           "transformers_latency_s": ref["latency_s"], "transformers_threads": ref["threads"],
           "xla_threads": len(os.sched_getaffinity(0)), "loadavg_1m": os.getloadavg()[0]}
    for name in engines:
      r = best[name]
      same = r["tokens"] == ref["tokens"]
      prefix = [int(np.argmin(s)) if not s.all() else s.size for s in same]
      row.update({f"{name}_tok_s": r["tokens_per_s"], f"{name}_latency_s": r["latency_s"],
                  f"{name}_ttft_s": r["ttft_s"],
                  f"{name}_speedup": r["tokens_per_s"] / ref["tokens_per_s"],
                  f"{name}_greedy_match_seqs": float(np.mean(same.all(axis=1))),
                  f"{name}_greedy_match_prefix": float(np.mean(prefix))})
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
          flush=True)
  return rows


def _timed_decode(engine: Engine, prompts: np.ndarray, new_tokens: int, logprobs: int) -> dict:
  """`bench_engine`, plus decode tokens/s: tokens of the run's decode calls over their seconds
  (the engine's counters; the first token of each completion comes from its prefill)."""
  before = dict(engine.stats)
  r = bench_engine(engine, prompts, new_tokens, logprobs=logprobs)
  tokens = engine.stats["generated_tokens_total"] - before.get("generated_tokens_total", 0)
  seconds = engine.stats["decode_seconds_total"] - before.get("decode_seconds_total", 0.0)
  r["decode_tok_s"] = tokens / seconds if seconds else 0.0
  return r


def shape_bucket_rows(model, base: dict, rng, batches, prompt_len, new_tokens, repeats,
                      vocab, logprobs: int = 0) -> list:
  """"coarse" against "fine" shape buckets on the same prompts: each engine runs the workload
  twice untimed (compiling the shapes it uses: the first run misses the prefix cache, the
  later ones find the prompts' blocks cached), then `repeats` timed runs each, the order
  alternating; the best run (decode tokens/s) of each is kept. Requests ask for `logprobs`
  alternatives per token: with 0, "fine" calls skip the top-k that "coarse" ones compute; with
  some, both compute it, and what is left is the other buckets' cost."""
  names = ("coarse", "fine")
  engines = {b: Engine(model, config=EngineConfig(shape_buckets=b, **base)) for b in names}
  rows = []
  try:
    programs = {b: len(e.programs()) for b, e in engines.items()}
    for b in batches:
      prompts = rng.integers(0, vocab, (b, prompt_len))
      for eng in engines.values():
        for _ in range(2):
          bench_engine(eng, prompts, new_tokens, logprobs=logprobs)
      runs = {name: [] for name in names}
      with warmup.CompileCounter() as counter:  # the timed runs must compile nothing
        for i in range(repeats):
          for name in (names if i % 2 == 0 else names[::-1]):
            runs[name].append(_timed_decode(engines[name], prompts, new_tokens, logprobs))
      best = {k: max(v, key=lambda r: r["decode_tok_s"]) for k, v in runs.items()}
      c, f = best["coarse"], best["fine"]
      row = {"batch": b, "logprobs": logprobs, "compiled_while_timed": counter.executables,
             "loadavg_1m": os.getloadavg()[0], "xla_threads":
             len(os.sched_getaffinity(0)), "same_greedy_tokens": float(np.mean(
                 (c["tokens"] == f["tokens"]).all(axis=1))),
             "decode_ratio": c["decode_tok_s"] / f["decode_tok_s"],
             "end_to_end_ratio": c["tokens_per_s"] / f["tokens_per_s"]}
      for name, r in best.items():
        row.update({f"{name}_programs": programs[name], f"{name}_decode_tok_s": r["decode_tok_s"],
                    f"{name}_tok_s": r["tokens_per_s"], f"{name}_ttft_s": r["ttft_s"],
                    f"{name}_all_decode_tok_s": [x["decode_tok_s"] for x in runs[name]]})
      rows.append(row)
      print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
            flush=True)
  finally:
    for e in engines.values():
      e.stop()
  return rows


def shape_bucket_markdown(rows: list) -> str:
  """`shape_bucket_rows` as the table of BENCHMARKS.md ("Shape buckets")."""
  lines = ["| batch | logprobs asked | decode tok/s: coarse / fine | ratio | end-to-end tok/s: "
           "coarse / fine | ratio | TTFT s: coarse / fine | programs: coarse / fine | same "
           "greedy tokens | load avg |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- "
           "| --- |"]
  for r in rows:
    lines.append(
        f"| {r['batch']} | {r['logprobs']} | "
        f"{r['coarse_decode_tok_s']:,.0f} / {r['fine_decode_tok_s']:,.0f} | "
        f"{r['decode_ratio']:.3f} | {r['coarse_tok_s']:,.0f} / {r['fine_tok_s']:,.0f} | "
        f"{r['end_to_end_ratio']:.3f} | {r['coarse_ttft_s']:.3f} / {r['fine_ttft_s']:.3f} | "
        f"{r['coarse_programs']} / {r['fine_programs']} | {r['same_greedy_tokens']:.0%} | "
        f"{r['loadavg_1m']:.1f} |")
  return "\n".join(lines)


def _spread_run(engine, prompts: np.ndarray, new_tokens: int) -> dict:
  """Greedy completions of `prompts`, each its own request (`submit`, so a replica set spreads
  them): end-to-end tokens/s, and the tokens."""
  params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
  t0 = time.perf_counter()
  handles = [engine.submit(p, params) for p in prompts.tolist()]
  comps = [h.result()[0] for h in handles]
  dt = time.perf_counter() - t0
  return {"tokens_per_s": sum(len(c.token_ids) for c in comps) / dt, "latency_s": dt,
          "tokens": np.asarray([c.token_ids for c in comps])}


def replica_rows(model, base: dict, rng, batches, prompt_len, new_tokens, repeats,
                 vocab) -> list:
  """One engine against a set of two replicas (`rollout.replicas`), each replica configured as
  the one engine and placed on its own device, on the same prompts: each runs the workload
  twice untimed (compiling its shapes), then `repeats` timed runs each, the order alternating;
  the best end-to-end tokens/s of each is kept, with the share of the requests each replica
  served in the timed runs."""
  devices = jax.devices()
  if len(devices) < 2:
    raise SystemExit("--only_replicas needs 2 devices; on the CPU run with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=2")
  flat = moe_params.flatten(model)
  ec = EngineConfig(**base)
  engines = {"one": Engine.from_flat(flat, model.config, config=ec, device=devices[0]),
             "two": replicas_lib.build(flat, model.config, replicas=2, config=ec,
                                       devices=devices[:2])}
  rows = []
  try:
    for b in batches:
      prompts = rng.integers(0, vocab, (b, prompt_len))
      for eng in engines.values():
        for _ in range(2):
          _spread_run(eng, prompts, new_tokens)
      runs = {name: [] for name in engines}
      before = [e.stats["requests_total"] for e in engines["two"].engines]
      with warmup.CompileCounter() as counter:  # the timed runs must compile nothing
        for i in range(repeats):
          for name in (("one", "two") if i % 2 == 0 else ("two", "one")):
            runs[name].append(_spread_run(engines[name], prompts, new_tokens))
      served = [e.stats["requests_total"] - n for e, n in zip(engines["two"].engines, before)]
      best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
      row = {"batch": b, "one_tok_s": best["one"]["tokens_per_s"],
             "two_tok_s": best["two"]["tokens_per_s"],
             "ratio": best["two"]["tokens_per_s"] / best["one"]["tokens_per_s"],
             "one_all_tok_s": [r["tokens_per_s"] for r in runs["one"]],
             "two_all_tok_s": [r["tokens_per_s"] for r in runs["two"]],
             "replica_share": [n / sum(served) for n in served],
             "same_greedy_tokens": float(np.mean(
                 (best["one"]["tokens"] == best["two"]["tokens"]).all(axis=1))),
             "compiled_while_timed": counter.compiled, "loadavg_1m": os.getloadavg()[0],
             "xla_threads": len(os.sched_getaffinity(0))}
      rows.append(row)
      print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
            flush=True)
  finally:
    for e in engines.values():
      e.stop()
  return rows


def replica_markdown(rows: list) -> str:
  """`replica_rows` as the table of BENCHMARKS.md ("Sampler replicas")."""
  lines = ["| batch (requests) | 1 engine tok/s | 2 replicas tok/s | ratio | requests per "
           "replica | same greedy tokens | load avg |", "| --- | --- | --- | --- | --- | --- "
           "| --- |"]
  for r in rows:
    share = " / ".join(f"{x:.0%}" for x in r["replica_share"])
    lines.append(f"| {r['batch']} | {r['one_tok_s']:,.0f} | {r['two_tok_s']:,.0f} | "
                 f"{r['ratio']:.2f}x | {share} | {r['same_greedy_tokens']:.0%} | "
                 f"{r['loadavg_1m']:.1f} |")
  return "\n".join(lines)


def agreement_rows(model, engines: dict, rng, batch, prompt_len, new_tokens, vocab) -> dict:
  out = {}
  prompts = rng.integers(0, vocab, (batch, prompt_len))
  for name, eng in engines.items():
    r = bench_engine(eng, prompts, new_tokens, temperature=1.0, seed=123)
    out[name] = agreement.measure(model, prompts.tolist(), r["completions"], temperature=1.0)
    print(name, "agreement", json.dumps(out[name]), flush=True)
  return out


def _best_time(fn, calls: int = 20, repeats: int = 5) -> float:
  """The best per-call time of `fn` over `repeats` timings of `calls` calls (after a warm-up)."""
  fn()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      fn()
    best = min(best, (time.perf_counter() - t0) / calls)
  return best


def matmul_rates(ms=(16, 32, 64), torch_threads=(1, 2), experts: int = 8, hidden: int = 256,
                 out: int = 1024) -> list:
  """GFLOP/s of the expert matmul [E, m, hidden] x [E, hidden, out]: XLA einsum vs torch.bmm."""
  import jax.numpy as jnp
  import torch
  einsum = jax.jit(lambda a, b: jnp.einsum("emh,ehf->emf", a, b))
  rng = np.random.default_rng(0)
  w = rng.standard_normal((experts, hidden, out), np.float32)
  rows = []
  for m in ms:
    x = rng.standard_normal((experts, m, hidden), np.float32)
    flop = 2.0 * experts * m * hidden * out
    xj, wj = jax.device_put(x), jax.device_put(w)
    row = {"m": m, "xla_threads": len(os.sched_getaffinity(0)),
           "xla_gflops": flop / _best_time(lambda: einsum(xj, wj).block_until_ready()) / 1e9}
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    for t in torch_threads:
      torch.set_num_threads(t)
      with torch.no_grad():
        row[f"torch_{t}_gflops"] = flop / _best_time(lambda: torch.bmm(xt, wt)) / 1e9
    row["loadavg_1m"] = os.getloadavg()[0]
    rows.append(row)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
          flush=True)
  return rows


def swap_row(label: str, flat: dict, cfg: ModelConfig, ec: EngineConfig, prompt_len: int,
             new_tokens: int, batch: int) -> dict:
  """What a swap while decoding costs (pause, deferred free, first decode call after it vs the
  steady calls before it) against a plain reload (fresh engine, compile, first token)."""
  # One cache length bucket: every decode call of the run has the same shapes, so the calls
  # before the swap are the steady reference for the first call after it.
  ec = dataclasses.replace(ec, length_bucket=ec.max_len)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
  jax.clear_caches()  # a reload is a fresh process: nothing compiled yet
  t0 = time.perf_counter()
  eng = Engine.from_flat(flat, cfg, config=ec)
  built = time.perf_counter()
  eng.generate(prompts[0], max_tokens=1, temperature=0.0)
  reload_s = time.perf_counter() - t0
  row = {"model": label, "params": int(sum(v.size for v in flat.values())),
         "reload_s": reload_s, "reload_pack_s": built - t0,
         "reload_compile_first_token_s": reload_s - (built - t0)}
  # Warm the shapes of the workload (compilation), then swap while the same batch is decoding.
  params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
  for h in eng.submit_batch(prompts, params):
    h.result()
  new_flat = {k: (v * np.asarray(1.01, v.dtype)).astype(v.dtype) if i % 2 == 0 else v
              for i, (k, v) in enumerate(flat.items())}
  prepared = eng.prepare_weights(new_flat)  # off the serving path (decoding may continue)
  # The swap must land mid-request, after steady decode calls: the batch runs at least 6 decode
  # calls (when the context allows), and the engine thread holds after its third decode call
  # (the fourth token delivery, prefill's first) until the swap call is under way.
  swap_tokens = max(new_tokens, min(ec.max_len - prompt_len, 6 * ec.decode_steps))
  started, go = threading.Event(), threading.Event()
  watched, deliveries = [], []

  def on_tokens(h, i, t, l, r):
    if not watched:
      watched.append(h)
    if h is watched[0] and i == 0 and not started.is_set():
      deliveries.append(len(t))
      if len(deliveries) == min(4, swap_tokens // ec.decode_steps):
        started.set()
        go.wait(10.0)

  hs = eng.submit_batch(prompts, dataclasses.replace(params, max_tokens=swap_tokens),
                        on_tokens=on_tokens)
  if not started.wait(600.0):
    raise RuntimeError("the swap benchmark's batch never reached its third decode call")
  go.set()
  res = eng.swap_weights(prepared, 1, wait_first_call=True, timeout=600.0)
  comps = [h.result()[0] for h in hs]
  vers = comps[0].policy_versions
  eng.stop()
  first, steady = res.get("first_call_s"), res.get("steady_call_s")
  row.update({"swap_pause_s": res["pause_s"], "swap_prepare_s": res["prepare_s"],
              "swap_total_s": res["total_s"], "in_flight": res["in_flight"],
              "swap_free_s": res.get("free_s"), "first_call_s": first,
              "steady_call_s": steady, "decode_steps": ec.decode_steps,
              "first_call_extra_s": (first - steady) if first is not None and steady else None,
              "pause_over_reload": res["pause_s"] / reload_s,
              "versions_seen": sorted(set(vers))})
  print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}),
        flush=True)
  return row


def _cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), for the report: results differ by machine kind."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "unknown"


def one_billion_config() -> ModelConfig:
  return ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=11, num_heads=16,
                     num_kv_heads=8, intermediate_size=5632, moe_intermediate_size=1408,
                     num_experts=8, num_experts_per_tok=2, max_seq_len=128,
                     param_dtype="bfloat16", dtype="bfloat16")


def markdown(report: dict) -> str:
  """The report as the tables of BENCHMARKS.md."""
  lines = ["| batch | transformers tok/s (torch threads) | ours tok/s (XLA threads) | speedup | "
           "ours deterministic tok/s | speedup | batch latency s: transformers / ours / det. | "
           "ours TTFT s | greedy = transformers | load avg |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in report["throughput"]:
    lines.append(
        f"| {r['batch']} | {r['transformers_tok_s']:,.0f} ({r['transformers_threads']}) | "
        f"{r['ours_tok_s']:,.0f} ({r['xla_threads']}) | {r['ours_speedup']:.2f}x | "
        f"{r['ours_deterministic_tok_s']:,.0f} | {r['ours_deterministic_speedup']:.2f}x | "
        f"{r['transformers_latency_s']:.2f} / {r['ours_latency_s']:.2f} / "
        f"{r['ours_deterministic_latency_s']:.2f} | {r['ours_ttft_s']:.3f} | "
        f"{r['ours_greedy_match_seqs']:.0%} of sequences | {r['loadavg_1m']:.1f} |")
  lines += ["", "| sampler | tokens | max abs dlogprob | mean abs dlogprob | bit-identical | "
            "KL k1 | KL k3 | routing agreement | max abs dlogprob, free routing |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, a in report["agreement"].items():
    lines.append(f"| {name} | {a['tokens']} | {a['max_abs_dlogprob']:.2e} | "
                 f"{a['mean_abs_dlogprob']:.2e} | {a['bit_identical_fraction']:.1%} | "
                 f"{a['kl_k1']:.1e} | {a['kl_k3']:.1e} | {a['routing_agreement']:.2%} | "
                 f"{a['max_abs_dlogprob_free_routing']:.2e} |")
  if report.get("matmul"):
    ts = [k.split("_")[1] for k in report["matmul"][0] if k.startswith("torch_")]
    lines += ["", "| expert matmul [8, m, 256] x [8, 256, 1024], m = | XLA einsum GFLOP/s "
              "(threads) | " + " | ".join(f"torch.bmm GFLOP/s, {t} thread(s)" for t in ts) +
              " | load avg |", "| --- | --- | " + "--- | " * len(ts) + "--- |"]
    for r in report["matmul"]:
      lines.append(f"| {r['m']} | {r['xla_gflops']:.0f} ({r['xla_threads']}) | " +
                   " | ".join(f"{r[f'torch_{t}_gflops']:.0f}" for t in ts) +
                   f" | {r['loadavg_1m']:.1f} |")
  lines += ["", "| model | params | in flight | swap pause | free old weights (in the first "
            "call) | first decode call after the swap / steady call (steps per call) | extra "
            "cost of the first call | prepare (pack) | plain reload (pack + compile + first "
            "token) | (pause + extra) / reload |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

  def ms(x):
    return "n/a" if x is None else f"{x * 1e3:,.1f} ms"

  for r in report["swap"]:
    extra = r["first_call_extra_s"]
    cost = r["swap_pause_s"] + max(extra or 0.0, 0.0)
    lines.append(f"| {r['model']} | {r['params'] / 1e6:,.1f}M | {r['in_flight']} | "
                 f"{r['swap_pause_s'] * 1e3:.2f} ms | {ms(r['swap_free_s'])} | "
                 f"{ms(r['first_call_s'])} / {ms(r['steady_call_s'])} ({r['decode_steps']}) | "
                 f"{ms(extra)} | {r['swap_prepare_s']:.2f} s | "
                 f"{r['reload_s']:.2f} s ({r['reload_pack_s']:.2f} + "
                 f"{r['reload_compile_first_token_s']:.2f}) | {cost / r['reload_s']:.1e} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="1,16,64")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--decode_steps", type=int, default=16)
  p.add_argument("--quick", action="store_true", help="a tiny smoke run (tests)")
  p.add_argument("--skip_1b", action="store_true")
  p.add_argument("--only_swap", action="store_true", help="skip throughput and agreement")
  p.add_argument("--only_shape_buckets", action="store_true",
                 help="only \"coarse\" against \"fine\" shape buckets (EngineConfig."
                      "shape_buckets): decode tokens/s, warm against warm")
  p.add_argument("--only_replicas", action="store_true",
                 help="only one engine against two data-parallel replicas (rollout.replicas): "
                      "end-to-end tokens/s, warm against warm; needs 2 devices")
  p.add_argument("--logprobs", type=int, default=0,
                 help="with --only_shape_buckets: top logprobs each request asks for")
  p.add_argument("--length_bucket", type=int, default=32,
                 help="EngineConfig.length_bucket of the engines (the context is rounded up to "
                      "a multiple of it)")
  p.add_argument("--json", help="write all results here")
  args = p.parse_args(argv)
  batches = [int(b) for b in args.batches.split(",")]
  spec = QUICK_MIXTRAL if args.quick else TINY_MIXTRAL
  report = {"argv": sys.argv[1:] if argv is None else list(argv), "cpu": _cpu_model(),
            "loadavg_start": os.getloadavg()}
  with tempfile.TemporaryDirectory() as d:
    torch_model = make_hf_checkpoint(d, spec)
    model = hf.load_pretrained(d)
  cfg = model.config
  lb = args.length_bucket
  max_len = -(-(args.prompt_len + args.new_tokens) // lb) * lb
  base = dict(max_slots=max(batches), max_len=max_len, decode_steps=args.decode_steps,
              length_bucket=lb)
  report["engine"] = base
  if args.only_replicas:
    del torch_model
    report["replicas"] = replica_rows(model, base, np.random.default_rng(0), batches,
                                      args.prompt_len, args.new_tokens, args.repeats,
                                      cfg.vocab_size)
    report["loadavg_end"] = os.getloadavg()
    print(replica_markdown(report["replicas"]), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist")
                  else str(o))
    return 0
  if args.only_shape_buckets:
    del torch_model
    report["shape_buckets"] = shape_bucket_rows(model, base, np.random.default_rng(0), batches,
                                                args.prompt_len, args.new_tokens, args.repeats,
                                                cfg.vocab_size, args.logprobs)
    report["loadavg_end"] = os.getloadavg()
    print(shape_bucket_markdown(report["shape_buckets"]), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0
  report["throughput"], report["agreement"], report["matmul"] = [], {}, []
  if not args.only_swap:
    report["matmul"] = matmul_rates(ms=(4, 8) if args.quick else (16, 32, 64))
    engines = {"ours": Engine(model, config=EngineConfig(**base)),
               "ours_deterministic": Engine(model,
                                            config=EngineConfig(deterministic=True, **base))}
    rng = np.random.default_rng(0)
    report["throughput"] = throughput(torch_model, engines, rng, batches, args.prompt_len,
                                      args.new_tokens, args.repeats, cfg.vocab_size)
    report["agreement"] = agreement_rows(model, engines, rng, min(16, max(batches)),
                                         args.prompt_len, args.new_tokens, cfg.vocab_size)
    for e in engines.values():
      e.stop()
    del engines
  del torch_model
  gc.collect()
  flat = moe_params.flatten(model)
  report["swap"] = [swap_row("tiny Mixtral (fp32)", flat, cfg, EngineConfig(**base),
                             args.prompt_len, args.new_tokens, min(16, max(batches)))]
  if not args.skip_1b and not args.quick:
    big_cfg = one_billion_config()
    big = build.create(big_cfg, seed=0)
    big_flat = moe_params.flatten(big)
    del big
    gc.collect()
    report["swap"].append(swap_row(
        "~1B MoE (bf16)", big_flat, big_cfg,
        EngineConfig(max_slots=1, max_len=64, decode_steps=1, dtype=None, length_bucket=64),
        prompt_len=8, new_tokens=48, batch=1))
  print(markdown(report), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist")
                else str(o))
  return 0


if __name__ == "__main__":
  sys.exit(main())
