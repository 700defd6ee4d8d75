"""Prefix-cache benchmark: multi-turn episodes on the sampler with and without prefix reuse.

Run (about 2 minutes on 2 cores; BENCHMARKS.md "## Prefix caching in the sampler" holds the
results):
  .venv/bin/python -m tools.bench_prefix_cache --json /tmp/bench_prefix_cache.json
  bazel run //tools:bench_prefix_cache

What it measures, all in one run on the same weights (moe/configs/tiny.gin, seeded random init):
  * Simulated agent episodes of 4 and 8 turns, `--episodes` of them at once (in lock-step, as a
    vector of environments: `run_episodes`). Turn k's prompt is turn k-1's prompt + its completion + a
    fixed-length observation (random token ids); the first prompt is `--prompt_len` tokens.
    Each completion is `--completion_len` tokens (temperature 1, no stop token).
  * Per episode: the prompt tokens the engine prefilled (`len(prompt) - Completion.cached_tokens`
    summed over its turns; cross-checked against the engine's `prompt_tokens_total`), against
    the episode's unique tokens (its final prompt + final completion: every token it holds,
    once) and against the least any cache could prefill (the first prompt, then each turn's
    observation and the previous completion's last token, which was never fed). And episodes/s.
  * A single-turn workload (distinct prompts, and GRPO-style groups of n attempts), where the
    cache can only cost: the figures behind `EngineConfig.prefix_cache_blocks`' default.

Fairness: each engine first runs the whole workload once with other tokens (compiling every
shape), then the timed runs interleave (off, on, on, off, ...; `--repeats` of each) so drifting
machine load hits both; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from moe import build
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams


def run_episodes(engine: Engine, *, episodes: int, turns: int, prompt_len: int,
                 completion_len: int, obs_len: int, seed: int) -> dict:
  """Runs `episodes` episodes of `turns` turns side by side; returns per-episode figures.

  The episodes step in lock-step, as a vector of environments: each turn's prompts are
  submitted together (one `submit_batch`). Every episode then has the same lengths, so each
  side compiles the same few shapes in its warm-up and none while it is timed.
  """
  vocab = engine.model_config.vocab_size
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(0, vocab, prompt_len)] for _ in range(episodes)]
  prefilled = cached = final = 0
  before = engine.metrics().get("prompt_tokens_total", 0)
  t0 = time.perf_counter()
  for turn in range(turns):
    params = SamplingParams(max_tokens=completion_len, temperature=1.0,
                            seed=int(rng.integers(0, 2**31)))
    outs = [h.result(600)[0] for h in engine.submit_batch(prompts, params)]
    for e, c in enumerate(outs):
      prefilled += len(prompts[e]) - c.cached_tokens
      cached += c.cached_tokens
      if turn == turns - 1:
        final += len(prompts[e]) + len(c.token_ids)
      else:
        prompts[e] = prompts[e] + c.token_ids + [int(t) for t in rng.integers(0, vocab, obs_len)]
  wall = time.perf_counter() - t0
  counted = engine.metrics().get("prompt_tokens_total", 0) - before
  if counted != prefilled:
    raise AssertionError(f"engine prefilled {counted} tokens, completions say {prefilled}")
  return {"wall_s": wall, "episodes_per_s": episodes / wall,
          "prefill_tokens_per_episode": prefilled / episodes,
          "cached_tokens_per_episode": cached / episodes,
          "unique_tokens_per_episode": final / episodes,
          "least_prefill_per_episode": prompt_len + (turns - 1) * (obs_len + 1)}


def run_single_turn(engine: Engine, *, prompts: int, n: int, prompt_len: int,
                    completion_len: int, seed: int) -> dict:
  """`prompts` distinct prompts (n attempts each, one request per prompt), all submitted at once."""
  rng = np.random.default_rng(seed)
  batch = [[int(t) for t in rng.integers(0, engine.model_config.vocab_size, prompt_len)]
           for _ in range(prompts)]
  t0 = time.perf_counter()
  hs = engine.submit_batch(batch, SamplingParams(n=n, max_tokens=completion_len,
                                                 temperature=1.0, seed=seed))
  toks = sum(len(c.token_ids) for h in hs for c in h.result(600))
  wall = time.perf_counter() - t0
  return {"wall_s": wall, "tokens_per_s": toks / wall}


def _median(rows: list, key: str) -> float:
  return statistics.median(r[key] for r in rows)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--episodes", type=int, default=8, help="concurrent episodes")
  p.add_argument("--turns", type=int, nargs="+", default=[4, 8])
  p.add_argument("--prompt_len", type=int, default=32, help="first prompt's tokens")
  p.add_argument("--completion_len", type=int, default=16, help="tokens per completion")
  p.add_argument("--obs_len", type=int, default=24, help="observation tokens per turn")
  p.add_argument("--block_size", type=int, default=16, help="EngineConfig.prefix_block_size")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--single_turn_prompts", type=int, default=16)
  p.add_argument("--single_turn_len", type=int, default=64,
                 help="prompt and completion tokens of the single-turn workload")
  p.add_argument("--gin_file", default="moe/configs/tiny.gin")
  p.add_argument("--json", default=None, help="also write the results here")
  args = p.parse_args(argv)

  from tools import configs  # pylint: disable=g-import-not-at-top
  configs.parse([args.gin_file])
  cfg = configs.model_config()
  model = build.create(cfg, seed=0)
  max_len = cfg.max_seq_len
  need = args.prompt_len + max(args.turns) * (args.completion_len + args.obs_len)
  if need > max_len:
    raise SystemExit(f"episodes need {need} positions, the model has {max_len}")
  slots = max(args.episodes, args.single_turn_prompts)
  base = dict(max_slots=slots, max_len=max_len, decode_steps=8,
              prefix_block_size=args.block_size)
  engines = {"off": Engine(model, config=EngineConfig(**base, prefix_cache_blocks=0)),
             "on": Engine(model, config=EngineConfig(
                 **base, prefix_cache_blocks=slots * max_len // args.block_size))}
  ep_kw = dict(episodes=args.episodes, prompt_len=args.prompt_len,
               completion_len=args.completion_len, obs_len=args.obs_len)
  st_kw = dict(prompt_len=args.single_turn_len, completion_len=args.single_turn_len)
  workloads = {f"{k} turns": (lambda eng, seed, k=k: run_episodes(eng, turns=k, seed=seed,
                                                                 **ep_kw))
               for k in args.turns}
  workloads["single turn, distinct prompts"] = lambda eng, seed: run_single_turn(
      eng, prompts=args.single_turn_prompts, n=1, seed=seed, **st_kw)
  workloads["single turn, groups of n=4"] = lambda eng, seed: run_single_turn(
      eng, prompts=args.single_turn_prompts // 4, n=4, seed=seed, **st_kw)
  report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "args": vars(args), "rows": {}}
  try:
    for w, (name, fn) in enumerate(workloads.items()):
      # Seeds differ across workloads and runs: no run may find another's tokens cached.
      for eng in engines.values():
        fn(eng, 1000 * w + 999)  # warm-up: compiles every shape
      runs = {"off": [], "on": []}
      for r in range(args.repeats):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
          runs[side].append(fn(engines[side], 1000 * w + r))
      row = {side: {k: _median(v, k) for k in v[0]} for side, v in runs.items()}
      report["rows"][name] = row
      print(name, json.dumps(row), flush=True)
    report["metrics_on"] = {k: v for k, v in engines["on"].metrics().items()
                            if k.startswith("prefix_cache")}
  finally:
    for eng in engines.values():
      eng.stop()
  print()
  print("| workload | prefill tokens/episode off -> on | unique tokens/episode | on / unique "
        "| on / least | episodes/s off -> on | gain |")
  print("|---|---|---|---|---|---|---|")
  for name, row in report["rows"].items():
    off, on = row["off"], row["on"]
    if "episodes_per_s" in off:
      print(f"| {name} | {off['prefill_tokens_per_episode']:.0f} -> "
            f"{on['prefill_tokens_per_episode']:.0f} | {on['unique_tokens_per_episode']:.0f} | "
            f"{on['prefill_tokens_per_episode'] / on['unique_tokens_per_episode']:.2f} | "
            f"{on['prefill_tokens_per_episode'] / on['least_prefill_per_episode']:.2f} | "
            f"{off['episodes_per_s']:.2f} -> {on['episodes_per_s']:.2f} | "
            f"{on['episodes_per_s'] / off['episodes_per_s']:.2f}x |")
    else:
      print(f"| {name} | | | | | {off['tokens_per_s']:.0f} -> {on['tokens_per_s']:.0f} "
            f"tokens/s | {on['tokens_per_s'] / off['tokens_per_s']:.2f}x |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
