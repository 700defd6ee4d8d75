"""Asynchronous versus synchronous RL on the same workload, on this machine.

  bazel run //tools:bench_async                       # ~10 min on 2 cores (with pre-training)
  bazel run //tools:bench_async -- --init_checkpoint=runs/<run>/pretrained_model

Both runs start from the same pre-trained tiny MoE (pre-trained here for a few minutes unless
--init_checkpoint names one), draw the same tasks in the same order with the same seeds and take
the same number of learner steps. The synchronous baseline is the same pipeline with max staleness
0: the rollouts of step s start only once the weights of step s serve, so generation, grading and
training take turns. The asynchronous run lets samplers work up to k versions ahead.

Workload: the built-in single-turn programming tasks, whose hidden test suites include one slow
test each (the environment time of running a real test suite): its duration is drawn per task from
a long-tailed lognormal (median and p99 set by flags), so some groups take far longer than others.

Reported: wall time to the same number of learner steps, learner idle fraction (waiting for data),
sampler idle fraction and mean decode-slot occupancy (sampled every 50 ms), staleness, and the
reward per step of both runs. The last line reads
`async speedup: 2.71x at max staleness 4; reward gap 0.01 (sync 0.43, async 0.44)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time

import numpy as np


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


def run_mode(name, k, model, tasks, pool, args, workdir):
  from pipeline import local  # pylint: disable=g-import-not-at-top
  from pipeline.config import PipelineConfig  # pylint: disable=g-import-not-at-top
  from rl.learner import Learner  # pylint: disable=g-import-not-at-top
  from rl.train_state import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from rl.train_step import LossConfig  # pylint: disable=g-import-not-at-top
  from moe import sharding  # pylint: disable=g-import-not-at-top
  from rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  cfg = PipelineConfig(max_staleness=k, prompts_per_step=args.prompts, attempts=args.attempts,
                       max_new_tokens=args.max_new_tokens, seq_len=256,
                       batch_rows=args.prompts * args.attempts // 2,
                       grade_workers=args.grade_workers, seed=args.seed)
  learner = Learner(model.config, mesh=sharding.make_mesh((1, 1, 1, 1)), init_model=model,
                    opt_cfg=OptimizerConfig(learning_rate=args.lr), sampler_dtype="float32",
                    loss_cfg=LossConfig(objective="policy", max_staleness=k))
  rewards, lags = {}, []
  mon = OccupancyMonitor()

  def on_group(g):
    rewards.setdefault(g.step, []).extend(r for r in g.rewards if r is not None)

  def on_step(step, metrics, info):
    lags.append(info["max_lag"])
    r = np.mean(rewards.get(step - 1, [0.0]))
    print(f"  [{name}] step {step:3d}  reward {r:.3f}  max lag {info['max_lag']}  "
          f"learner waited {info['wait_s']:.2f}s", flush=True)

  res = local.run(learner=learner, tasks=tasks, pool=pool, workdir=workdir, config=cfg,
                  num_steps=args.steps, engine_config=EngineConfig(
                      max_slots=args.prompts * args.attempts, max_len=256, decode_steps=16),
                  on_step=on_step, on_group=on_group,
                  after_start=lambda parts: mon.start(parts["engines"]))
  occ = mon.stop()
  curve = [float(np.mean(rewards.get(s, [0.0]))) for s in range(args.steps)]
  return {"mode": name, "max_staleness": k, "wall_s": res.wall_s, "steps": res.steps,
          "learner_idle_frac": res.learner_wait_s / res.wall_s,
          "learner_train_s": res.learner_train_s, "max_lag": max(lags) if lags else 0,
          "reward_curve": curve, "mean_reward": float(np.mean(curve)), **occ}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=10, help="learner steps per run")
  p.add_argument("--staleness", type=int, default=4, help="max staleness k of the async run")
  p.add_argument("--prompts", type=int, default=8, help="prompts per step")
  p.add_argument("--attempts", type=int, default=8, help="attempts per prompt")
  p.add_argument("--max_new_tokens", type=int, default=40)
  p.add_argument("--grade_workers", type=int, default=32, help="sandboxes grading at once")
  p.add_argument("--env_median_s", type=float, default=1.0,
                 help="median environment (slow test suite) time per task")
  p.add_argument("--env_p99_s", type=float, default=4.0, help="its 99th percentile")
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--pretrain_steps", type=int, default=300)
  p.add_argument("--init_checkpoint", default=None, help="start from this params checkpoint")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="write the results here")
  args = p.parse_args(argv)

  import logging  # pylint: disable=g-import-not-at-top
  logging.basicConfig(level=logging.WARNING)
  from envs import pool as pool_lib  # pylint: disable=g-import-not-at-top
  from envs import suite_pyfunc  # pylint: disable=g-import-not-at-top
  from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  from experiment.config import ExperimentConfig, PretrainConfig  # pylint: disable=g-import-not-at-top
  from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top
  from moe import sharding  # pylint: disable=g-import-not-at-top
  from tools import configs  # pylint: disable=g-import-not-at-top

  work = tempfile.mkdtemp(prefix="bench_async-")
  all_tasks = suite_pyfunc.generate()
  t0 = time.time()
  if args.init_checkpoint:
    model = moe_checkpoint.load_model(args.init_checkpoint)
  else:
    configs.parse(["moe/configs/tiny.gin"])
    cfg = ExperimentConfig(model=configs.model_config(), seed=args.seed,
                           pretrain=PretrainConfig(steps=args.pretrain_steps))
    model = run_lib.pretrain(cfg, work, all_tasks, sharding.make_mesh((1, 1, 1, 1)))
  print(f"starting model ready in {time.time() - t0:.0f}s", flush=True)
  tasks = slow_suite(suite_pyfunc.split(all_tasks, "train"), median_s=args.env_median_s,
                     p99_s=args.env_p99_s, cap_s=4.0, seed=args.seed)
  pool = pool_lib.WarmPool(size=args.grade_workers, max_live=2 * args.grade_workers)
  try:
    results = []
    for name, k in (("sync", 0), ("async", args.staleness)):
      print(f"{name} run (max staleness {k}):", flush=True)
      results.append(run_mode(name, k, model, tasks, pool, args, os.path.join(work, name)))
  finally:
    pool.close()
  sync, asyn = results
  speedup = sync["wall_s"] / asyn["wall_s"]
  gap = abs(asyn["mean_reward"] - sync["mean_reward"])
  print()
  print(f"{'':24}{'sync':>12}{'async':>12}")
  for key, fmt in (("wall_s", "{:.1f}"), ("learner_idle_frac", "{:.2f}"),
                   ("sampler_idle_frac", "{:.2f}"), ("slot_occupancy", "{:.3f}"),
                   ("max_lag", "{}"), ("mean_reward", "{:.3f}")):
    print(f"{key:24}{fmt.format(sync[key]):>12}{fmt.format(asyn[key]):>12}")
  print("reward per step (sync): " + " ".join(f"{r:.2f}" for r in sync["reward_curve"]))
  print("reward per step (async): " + " ".join(f"{r:.2f}" for r in asyn["reward_curve"]))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "results": results, "speedup": speedup}, f, indent=1)
  print(f"async speedup: {speedup:.2f}x at max staleness {args.staleness}; reward gap {gap:.2f} "
        f"(sync {sync['mean_reward']:.2f}, async {asyn['mean_reward']:.2f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
