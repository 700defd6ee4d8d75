"""Asynchronous versus synchronous RL on the same workload, on this machine.

  bazel run //tools:bench_async                       # ~25 min on 2 cores (with pre-training)
  bazel run //tools:bench_async -- --init_checkpoint=<dir> --steps 6 --prompts 4 \
      --json /tmp/bench_async.json                    # the smaller configuration BENCHMARKS uses

Both modes start from the same pre-trained tiny MoE (pre-trained here for a few minutes unless
--init_checkpoint names one; --save_checkpoint keeps it), draw the same tasks in the same order
with the same seeds and take the same number of learner steps. The synchronous baseline is the
same pipeline with max staleness 0: the rollouts of step s start only once the weights of step s
serve, so generation, grading and training take turns. The asynchronous run lets samplers work up
to k versions ahead. Both run in this one process with the same threads: XLA's CPU pool (one
thread per core it may use) for the sampler and the learner, and `--grade_workers` sandboxes.

Fairness: a persistent XLA compilation cache and a discarded warm-up run of each mode come
first, so neither timed run pays for compilation; then the timed runs interleave in alternating
order (sync, async, async, sync, ...; `--repeats` of each), so drifting machine load hits both.

Workloads (`--envs`, both by default, reported in one table):
  slow:  the built-in single-turn programming tasks with one extra hidden test each that sleeps a
         task-specific lognormal time (median and p99 set by flags, capped at 4 s): an injected
         stand-in for the environment time of a real, slow test suite.
  light: the same tasks with no injected sleep: only their real tests run.

Reported per workload: median wall time to the same number of learner steps and its min-max over
the repeats for each mode, the speedup (median sync / median async, and the range of the per-pair
ratios), learner and sampler idle fractions, slot occupancy, staleness and mean reward. With
--json the file also holds `calibration`: the simulator inputs measured here (decode step time at
several batch sizes through `tools.bench_sampler.bench_engine` on this run's engine, learner step
time, grading time per group, response lengths, weight-sync time), which
`bazel run //tools:sim_pipeline -- --measured FILE` turns into predicted-vs-measured rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

MODES = ("sync", "async")


def slow_suite(tasks, *, median_s: float, p99_s: float, cap_s: float, seed: int):
  """Each task gets a hidden test that sleeps a lognormal, task-specific time (capped)."""
  sigma = math.log(p99_s / median_s) / 2.326 if p99_s > median_s else 0.0
  rng = np.random.default_rng(seed)
  out = []
  for t in tasks:
    s = float(min(cap_s, median_s * math.exp(sigma * rng.standard_normal())))
    slow = f"import time\n\n\ndef test_environment_time():\n    time.sleep({s:.3f})\n"
    out.append(dataclasses.replace(
        t, hidden_tests={**t.hidden_tests, "test_slow_suite.py": slow},
        hidden_test_ids=tuple(t.hidden_test_ids) + ("test_slow_suite.py",)))
  return out


def run_order(repeats: int) -> list:
  """Timed runs in alternating order: sync, async, async, sync, sync, async, ...

  Pair r runs (sync, async) for even r and (async, sync) for odd r, so each mode goes first
  equally often and a load trend over the whole benchmark hits both modes alike.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  order = []
  for r in range(repeats):
    order.extend(MODES if r % 2 == 0 else MODES[::-1])
  return order


def summarize(runs: list) -> dict:
  """Per-mode medians and ranges, and the speedup, of one workload's timed runs.

  `runs` are run_mode results in run order, each with "mode" and "repeat"; pair r is the sync
  and async runs of repeat r, whose wall-time ratio gives one speedup sample.
  """
  out = {}
  for mode in MODES:
    rs = [r for r in runs if r["mode"] == mode]
    if not rs:
      raise ValueError(f"no {mode} runs")
    walls = [r["wall_s"] for r in rs]
    out[mode] = {"wall_s": statistics.median(walls), "wall_min_s": min(walls),
                 "wall_max_s": max(walls), "n": len(rs)}
    for key in ("learner_idle_frac", "sampler_idle_frac", "slot_occupancy", "mean_reward"):
      out[mode][key] = statistics.median(r[key] for r in rs)
    out[mode]["max_lag"] = max(r["max_lag"] for r in rs)
  by_pair = {}
  for r in runs:
    by_pair.setdefault(r["repeat"], {})[r["mode"]] = r["wall_s"]
  ratios = [p["sync"] / p["async"] for _, p in sorted(by_pair.items()) if len(p) == 2]
  out["speedup"] = out["sync"]["wall_s"] / out["async"]["wall_s"]
  out["pair_speedups"] = ratios
  return out


def fit_decode(points: list) -> tuple:
  """Least-squares fit of decode step time = step_s + per_seq_s * batch.

  `points` are (batch, step seconds) pairs; returns (step_s, per_seq_s), both clipped at 0 so the
  simulator's validation accepts them (a negative slope means the per-sequence cost is lost in
  the noise at these batches).
  """
  b = np.asarray([p[0] for p in points], float)
  t = np.asarray([p[1] for p in points], float)
  if len(set(b.tolist())) < 2:
    raise ValueError("need at least two distinct batch sizes to fit the decode step")
  slope, intercept = np.polyfit(b, t, 1)
  slope = max(0.0, float(slope))
  if intercept <= 0:  # noise: take the largest intercept that stays under every point
    intercept = max(float(np.min(t - slope * b)), 1e-9)
  return float(intercept), slope


def _quantiles(xs) -> dict:
  a = np.asarray(list(xs), float)
  return {"median": float(np.median(a)), "p99": float(np.quantile(a, 0.99)),
          "mean": float(np.mean(a)), "n": int(a.size)}


def calibration(runs: list, decode_points: list, *, prompts: int, attempts: int,
                max_new_tokens: int, grade_workers: int, sync_interval_s: float) -> dict:
  """The simulator inputs of one workload, from its timed runs and the decode measurement.

  Learner step time and weight-sync time come from the synchronous runs, where the learner and
  the samplers do not compete for the cores (the simulator adds that contention itself with
  `shared_compute`). Grading time per group, response and prompt lengths pool all runs.
  """
  sync_runs = [r for r in runs if r["mode"] == "sync"]
  if not sync_runs:
    raise ValueError("calibration needs at least one sync run")
  step_s, per_seq_s = fit_decode(decode_points)
  train = statistics.median(r["learner_train_s"] / r["steps"] for r in sync_runs)
  publish = statistics.median(r["learner_publish_s"] / r["steps"] for r in sync_runs)
  swaps = [s for r in sync_runs for s in r["swaps"]]
  if swaps:
    transfer = statistics.median(s["fetch_s"] + s["decode_s"] + s["pause_s"] for s in swaps)
    pause = statistics.median(s["pause_s"] for s in swaps)
  else:
    transfer = pause = 0.0
  grade = _quantiles(g for r in runs for g in r["grade_s"])
  resp = _quantiles(n for r in runs for n in r["response_tokens"])
  return {
      "decode_points": [list(p) for p in decode_points],
      "decode_step_s": step_s, "decode_step_per_seq_s": per_seq_s,
      "train_step_s": train, "publish_s": publish,
      # publish, the subscriber's poll (half its interval on average), fetch + decode + swap
      "sync_s": publish + sync_interval_s / 2 + transfer, "sync_pause_s": pause,
      "group_grade_s": grade, "response_tokens": resp,
      "prompt_tokens": statistics.median(n for r in runs for n in r["prompt_tokens"]),
      "prompts": prompts, "attempts": attempts, "max_new_tokens": max_new_tokens,
      "grade_workers": grade_workers, "slots": prompts * attempts,
  }


class OccupancyMonitor:
  """Samples the engines' active decode slots every `interval_s`."""

  def __init__(self, interval_s: float = 0.05):
    self.interval_s = interval_s
    self.samples: list = []
    self._stop = threading.Event()
    self._thread = None

  def start(self, engines):
    def loop():
      while not self._stop.is_set():
        m = [e.metrics() for e in engines]
        self.samples.append(sum(x["active_slots"] for x in m) / sum(x["max_slots"] for x in m))
        self._stop.wait(self.interval_s)
    self._thread = threading.Thread(target=loop, daemon=True)
    self._thread.start()

  def stop(self) -> dict:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    s = np.asarray(self.samples or [0.0])
    return {"sampler_idle_frac": float(np.mean(s == 0)), "slot_occupancy": float(np.mean(s))}


def engine_config(args):
  from rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  return EngineConfig(max_slots=args.prompts * args.attempts, max_len=args.seq_len,
                      decode_steps=16)


def run_mode(name, k, model, tasks, pool, args, workdir, steps=None, quiet=False):
  """One pipeline run of `steps` learner steps at max staleness k; returns its figures."""
  from pipeline import local  # pylint: disable=g-import-not-at-top
  from pipeline.config import PipelineConfig  # pylint: disable=g-import-not-at-top
  from rl import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from rl.train_state import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from rl.train_step import LossConfig  # pylint: disable=g-import-not-at-top
  from moe import sharding  # pylint: disable=g-import-not-at-top
  steps = steps or args.steps
  cfg = PipelineConfig(max_staleness=k, prompts_per_step=args.prompts, attempts=args.attempts,
                       max_new_tokens=args.max_new_tokens, seq_len=args.seq_len,
                       batch_rows=args.batch_rows or max(1, args.prompts * args.attempts // 2),
                       grade_workers=args.grade_workers, seed=args.seed)
  learner = learner_lib.build_learner(
      learner_lib.LearnerConfig(optimizer=OptimizerConfig(learning_rate=args.lr),
                                loss=LossConfig(objective="policy"), sampler_dtype="float32"),
      model.config, mesh=sharding.make_mesh((1, 1, 1, 1)), init_model=model, max_staleness=k)
  rewards, lags, grade_s, resp, prompt = {}, [], [], [], []
  mon = OccupancyMonitor()

  def on_group(g):
    rewards.setdefault(g.step, []).extend(r for r in g.rewards if r is not None)
    grade_s.append(g.grade_s)
    for ep in g.episodes:
      if not ep.infra_failure:
        n = int(np.sum(ep.loss_mask))
        resp.append(n)
        prompt.append(len(ep.tokens) - n)

  learner_steps = []

  def on_step(step, metrics, info):
    lags.append(info["max_lag"])
    # What shows the step trained (rl.testing checks these in the tests).
    learner_steps.append({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                          "tokens": float(metrics["tokens"]),
                          "trained_episodes": int(info["trained_episodes"]),
                          "policy_version": int(metrics["policy_version"])})
    if not quiet:
      r = np.mean(rewards.get(step - 1, [0.0]))
      print(f"  [{name}] step {step:3d}  reward {r:.3f}  max lag {info['max_lag']}  "
            f"learner waited {info['wait_s']:.2f}s", flush=True)

  res = local.run(learner=learner, tasks=tasks, pool=pool, workdir=workdir, config=cfg,
                  num_steps=steps, engine_config=engine_config(args),
                  on_step=on_step, on_group=on_group, sync_interval_s=args.sync_interval_s,
                  after_start=lambda parts: mon.start(parts["engines"]))
  occ = mon.stop()
  curve = [float(np.mean(rewards.get(s, [0.0]))) for s in range(steps)]
  return {"mode": name, "max_staleness": k, "wall_s": res.wall_s, "steps": res.steps,
          "learner_idle_frac": res.learner_wait_s / res.wall_s,
          "learner_train_s": res.learner_train_s, "learner_publish_s": res.learner_publish_s,
          "max_lag": max(lags) if lags else 0, "learner_steps": learner_steps,
          "reward_curve": curve,
          "mean_reward": float(np.mean(curve)), "grade_s": grade_s,
          "response_tokens": resp, "prompt_tokens": prompt,
          "swaps": [{key: s[key] for key in ("fetch_s", "decode_s", "pause_s")}
                    for s in res.swaps], "loadavg_1m": os.getloadavg()[0], **occ}


def measure_decode(model, args, prompt_len: int) -> list:
  """(batch, decode step seconds) of this run's engine at batch 1, one group and full slots.

  Uses `tools.bench_sampler.bench_engine` (greedy, every sequence to `max_new_tokens`); a warm-up
  call per batch compiles first. Step time = latency / new tokens, so prefill is amortised in.
  """
  from rollout.engine import Engine  # pylint: disable=g-import-not-at-top
  from tools import bench_sampler  # pylint: disable=g-import-not-at-top
  eng = Engine(model, config=engine_config(args))
  rng = np.random.default_rng(args.seed)
  points = []
  try:
    for b in sorted({1, args.attempts, args.prompts * args.attempts}):
      prompts = rng.integers(1, model.config.vocab_size, (b, prompt_len))
      bench_sampler.bench_engine(eng, prompts, args.max_new_tokens)
      best = min(bench_sampler.bench_engine(eng, prompts, args.max_new_tokens)["latency_s"]
                 for _ in range(2))
      points.append((b, best / args.max_new_tokens))
  finally:
    eng.stop()
  return points


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores_usable": len(os.sched_getaffinity(0)),
          "xla_cpu_threads": len(os.sched_getaffinity(0)), "loadavg": list(os.getloadavg())}


def markdown(report: dict) -> str:
  """The BENCHMARKS.md table: one row per workload, both modes, spread over the repeats."""
  a = report["args"]
  lines = ["| workload | sync wall s, median (min-max) | async k=%d wall s, median (min-max) | "
           "speedup (per-pair range) | learner idle sync / async | sampler idle sync / async | "
           "slot occupancy sync / async | mean reward sync / async |" % a["staleness"],
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for env, s in report["summary"].items():
    sy, asy = s["sync"], s["async"]
    pr = s["pair_speedups"]
    lines.append(
        f"| {env} | {sy['wall_s']:.1f} ({sy['wall_min_s']:.1f}-{sy['wall_max_s']:.1f}) | "
        f"{asy['wall_s']:.1f} ({asy['wall_min_s']:.1f}-{asy['wall_max_s']:.1f}) | "
        f"{s['speedup']:.2f}x ({min(pr):.2f}-{max(pr):.2f}) | "
        f"{sy['learner_idle_frac']:.2f} / {asy['learner_idle_frac']:.2f} | "
        f"{sy['sampler_idle_frac']:.2f} / {asy['sampler_idle_frac']:.2f} | "
        f"{sy['slot_occupancy']:.3f} / {asy['slot_occupancy']:.3f} | "
        f"{sy['mean_reward']:.3f} / {asy['mean_reward']:.3f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=10, help="learner steps per timed run")
  p.add_argument("--warmup_steps", type=int, default=2,
                 help="learner steps of the discarded warm-up run of each mode (0: none)")
  p.add_argument("--repeats", type=int, default=2, help="timed runs of each mode per workload")
  p.add_argument("--envs", default="slow,light", help="workloads: slow and/or light")
  p.add_argument("--staleness", type=int, default=4, help="max staleness k of the async run")
  p.add_argument("--prompts", type=int, default=8, help="prompts per step")
  p.add_argument("--attempts", type=int, default=8, help="attempts per prompt")
  p.add_argument("--max_new_tokens", type=int, default=40)
  p.add_argument("--seq_len", type=int, default=256, help="learner row and engine length")
  p.add_argument("--batch_rows", type=int, default=0,
                 help="learner rows per step (0: prompts x attempts / 2)")
  p.add_argument("--grade_workers", type=int, default=32, help="groups graded at once")
  p.add_argument("--env_median_s", type=float, default=1.0,
                 help="slow workload: median injected test time per task")
  p.add_argument("--env_p99_s", type=float, default=4.0, help="its 99th percentile")
  p.add_argument("--sync_interval_s", type=float, default=0.02,
                 help="how often samplers poll for new weights")
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--pretrain_steps", type=int, default=300)
  p.add_argument("--init_checkpoint", default=None, help="start from this params checkpoint")
  p.add_argument("--save_checkpoint", default=None, help="save the pre-trained model here")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="write the results and calibration here")
  args = p.parse_args(argv)
  envs = [e for e in args.envs.split(",") if e]
  if not envs or set(envs) - {"slow", "light"}:
    p.error(f"--envs takes slow and/or light, got {args.envs!r}")

  import logging  # pylint: disable=g-import-not-at-top
  logging.basicConfig(level=logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  from envs.sandbox import pool as pool_lib  # pylint: disable=g-import-not-at-top
  from envs.tasks import suite_pyfunc  # pylint: disable=g-import-not-at-top
  from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top

  work = tempfile.mkdtemp(prefix="bench_async-")
  # Every learner and engine instance re-jits; the cache turns later compilations into loads.
  jax.config.update("jax_compilation_cache_dir", os.path.join(work, "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  before = machine()
  all_tasks = suite_pyfunc.generate()
  t0 = time.time()
  if args.init_checkpoint:
    model = moe_checkpoint.load_model(args.init_checkpoint)
  else:
    from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
    from experiment.config import ExperimentConfig, PretrainConfig  # pylint: disable=g-import-not-at-top
    from moe import sharding  # pylint: disable=g-import-not-at-top
    from tools import configs  # pylint: disable=g-import-not-at-top
    configs.parse(["moe/configs/tiny.gin"])
    cfg = ExperimentConfig(model=configs.model_config(), seed=args.seed,
                           pretrain=PretrainConfig(steps=args.pretrain_steps))
    model = run_lib.pretrain(cfg, work, all_tasks, sharding.make_mesh((1, 1, 1, 1)))
    if args.save_checkpoint:
      moe_checkpoint.save_params(model, args.save_checkpoint)
  print(f"starting model ready in {time.time() - t0:.0f}s", flush=True)
  train = suite_pyfunc.split(all_tasks, "train")
  workloads = {"slow": slow_suite(train, median_s=args.env_median_s, p99_s=args.env_p99_s,
                                  cap_s=4.0, seed=args.seed),
               "light": train}
  staleness = {"sync": 0, "async": args.staleness}
  pool = pool_lib.WarmPool(size=args.grade_workers, max_live=2 * args.grade_workers)
  runs, n = {}, 0
  try:
    for env in envs:
      if args.warmup_steps:
        for mode in MODES:
          print(f"[{env}] warm-up {mode} run ({args.warmup_steps} steps, discarded)", flush=True)
          n += 1
          run_mode(mode, staleness[mode], model, workloads[env], pool, args,
                   os.path.join(work, f"{n:02d}-warmup-{env}-{mode}"),
                   steps=args.warmup_steps, quiet=True)
      runs[env] = []
      for i, mode in enumerate(run_order(args.repeats)):
        print(f"[{env}] {mode} run, repeat {i // 2} (max staleness {staleness[mode]}):",
              flush=True)
        n += 1
        r = run_mode(mode, staleness[mode], model, workloads[env], pool, args,
                     os.path.join(work, f"{n:02d}-{env}-{mode}"))
        r["repeat"] = i // 2
        runs[env].append(r)
        print(f"  [{env}] {mode}: {r['wall_s']:.1f} s", flush=True)
    decode = measure_decode(model, args, prompt_len=int(statistics.median(
        n for rs in runs.values() for r in rs for n in r["prompt_tokens"])))
  finally:
    pool.close()
  summary = {env: summarize(rs) for env, rs in runs.items()}
  report = {
      "args": vars(args), "machine_before": before, "machine_after": machine(),
      "runs": runs, "summary": summary,
      "calibration": {env: calibration(rs, decode, prompts=args.prompts, attempts=args.attempts,
                                       max_new_tokens=args.max_new_tokens,
                                       grade_workers=args.grade_workers,
                                       sync_interval_s=args.sync_interval_s)
                      for env, rs in runs.items()}}
  print()
  print(markdown(report))
  for env, s in summary.items():
    print(f"[{env}] async speedup: {s['speedup']:.2f}x at max staleness {args.staleness} "
          f"(pairs: {', '.join(f'{x:.2f}' for x in s['pair_speedups'])}); mean reward sync "
          f"{s['sync']['mean_reward']:.3f}, async {s['async']['mean_reward']:.3f}")
  print("decode step (batch, s): " + ", ".join(f"({b}, {t * 1e3:.2f} ms)" for b, t in decode))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
