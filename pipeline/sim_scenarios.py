"""Scenarios for the pipeline simulator: calibration here, separate pools, thousands of chips.

What: builders that turn hardware and model figures into `simulator` inputs (decode step time of a
memory-bound sampler replica, learner seconds per token, weight-sync times from the fan-out
simulator in `sync.fanout_sim`), the three scenarios the benchmark reports, and `compare`/`sweep`,
which run the synchronous baseline and asynchronous runs on the same prompts.

Why: the numbers in BENCHMARKS.md must come from one place, with each assumption written next to
the figure it sets; `calibration_from_bench` builds the small scenario from the quantities a
`//tools:bench_async` run measured on this machine, so its prediction can be checked against
that run.
"""

import dataclasses
import functools
import math
import statistics

from pipeline import simulator as sm
from sync import fanout_sim

# Hardware assumptions (stated, not measured): an H200-class accelerator.
PEAK_BF16_FLOPS = 989e12
HBM_BPS = 4.8e12
ACCELERATORS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  workload: sm.Workload
  inference: sm.InferencePool
  training: sm.TrainingPool
  sync: sm.WeightSync
  shared_compute: bool = False
  env_workers: int = 0
  assumptions: tuple = ()

  def run(self, max_staleness: int, steps: int, seed: int = 0, **kw) -> sm.Result:
    return sm.simulate(self.workload, self.inference, self.training, self.sync, steps=steps,
                       max_staleness=max_staleness, seed=seed,
                       shared_compute=self.shared_compute, env_workers=self.env_workers, **kw)


def decode_pool(samplers: int, accelerators_per_replica: int, slots: int, *, weight_bytes: float,
                active_params: float, kv_bytes_per_token: float, mean_context_tokens: float,
                peak_flops: float = PEAK_BF16_FLOPS, hbm_Bps: float = HBM_BPS,
                decode_mfu: float = 0.3, prefill_mfu: float = 0.4) -> sm.InferencePool:
  """A memory-bound decode model for one replica sharded over `accelerators_per_replica` chips.

  A step reads every weight once (with hundreds of sequences an MoE layer touches nearly every
  expert), then per sequence adds its matmul flops and its KV-cache reads; prefill is
  compute-bound at `prefill_mfu`.
  """
  flops = accelerators_per_replica * peak_flops
  hbm = accelerators_per_replica * hbm_Bps
  return sm.InferencePool(
      samplers=samplers, slots=slots, step_s=weight_bytes / hbm,
      step_per_seq_s=(2 * active_params / (flops * decode_mfu) +
                      kv_bytes_per_token * mean_context_tokens / hbm),
      prefill_s_per_token=2 * active_params / (flops * prefill_mfu))


@functools.lru_cache(maxsize=64)
def sync_from_fanout(samplers: int, accelerators_per_replica: int, learner_accelerators: int, *,
                     model_bytes: float, ratio: float = 20.7, encode_Bps_per_core: float = 0.54e9,
                     decode_Bps_per_core: float = 0.79e9, clusters: int = 4,
                     apply_delta_only: bool = True) -> sm.WeightSync:
  """Per-sampler update and pause times from `sync.fanout_sim` (the weight-sync fan-out simulator).

  Samplers are spread round-robin over the four clusters of `sync.fanout_sim.terabyte_four_clusters`
  (its links, relays and per-host assumptions), with one relay per replica, a replica's hosts
  = accelerators_per_replica / 8, and the learner's hosts encoding in parallel. Defaults: the
  plain XOR+zstd figures measured here (20.7x, 0.54 / 0.79 GB/s per core, see
  /work/shared/anchors.md) and the delta scattered on device.
  """
  hosts = max(1, math.ceil(accelerators_per_replica / ACCELERATORS_PER_HOST))
  counts = [len(range(c, samplers, clusters)) for c in range(clusters)]
  cfg = fanout_sim.terabyte_four_clusters(
      encode_Bps_per_core, decode_Bps_per_core, ratio,
      learner_hosts=max(1, learner_accelerators // ACCELERATORS_PER_HOST),
      replicas=max(counts), hosts_per_replica=hosts, apply_delta_only=apply_delta_only)
  cfg = dataclasses.replace(
      cfg, model_bytes=model_bytes,
      clusters=[dataclasses.replace(c, replicas=n, relays=max(1, n))
                for c, n in zip(cfg.clusters[:clusters], counts) if n])
  result = fanout_sim.simulate(cfg)
  serving, pause = {}, {}
  for h in result.hosts:
    key = (h.cluster, h.replica)
    serving[key] = max(serving.get(key, 0.0), h.serving_s)
    pause[key] = max(pause.get(key, 0.0), h.pause_s)
  ready, pauses = [], []
  for i in range(samplers):
    key = (f"cluster{i % clusters}", i // clusters)
    ready.append(serving[key] - pause[key])
    pauses.append(pause[key])
  return sm.WeightSync(tuple(ready), tuple(pauses))


def episode_env_from_group(median_s: float, p99_s: float, attempts: int) -> tuple:
  """Per-episode lognormal (median, p99) whose max over `attempts` draws has the given quantiles.

  The real pipeline grades a group's attempts one after another and the group is ready when the
  last one is graded; the simulator draws each episode's environment time independently and a
  group completes with its slowest episode. Matching the group-time quantiles means solving
  Phi((ln g - mu) / s) ** attempts = q at q = 0.5 and 0.99 for mu and s.
  """
  if not 0 < median_s <= p99_s:
    raise ValueError(f"need 0 < median_s <= p99_s, got {median_s}, {p99_s}")
  nd = statistics.NormalDist()
  z50, z99 = nd.inv_cdf(0.5 ** (1 / attempts)), nd.inv_cdf(0.99 ** (1 / attempts))
  s = (math.log(p99_s) - math.log(median_s)) / (z99 - z50)
  mu = math.log(median_s) - s * z50
  return math.exp(mu), math.exp(mu + s * nd.inv_cdf(0.99))


def calibration_scenario(*, decode_step_s: float, decode_step_per_seq_s: float,
                         train_step_s: float, env_median_s: float, env_p99_s: float,
                         sync_s: float, sync_pause_s: float, slots: int, prompts: int,
                         attempts: int, prompt_tokens: int, response_median: float,
                         response_p99: float, max_tokens: int, env_workers: int = 0,
                         train_s_per_token: float = 0.0, prefill_s_per_token: float = 0.0,
                         source: str = "given") -> Scenario:
  """(a) One sampler and the learner sharing this machine's cores, from measured figures.

  Every figure is a parameter; `calibration_from_bench` fills them from a `//tools:bench_async`
  JSON. The learner's batch has a fixed shape, so its step time is one constant; prefill is
  amortised into the measured decode step. Training stalls the sampler (shared cores); grading
  is not modelled as competing for the cores.
  """
  w = sm.Workload(prompts, attempts, prompt_tokens, response_median, response_p99,
                  max_tokens, env_median_s, env_p99_s)
  inf = sm.InferencePool(1, slots, decode_step_s, decode_step_per_seq_s, prefill_s_per_token)
  return Scenario(
      "a: calibration (this machine, shared cores)", w, inf,
      sm.TrainingPool(train_step_s, train_s_per_token),
      sm.WeightSync.constant(1, sync_s, sync_pause_s), shared_compute=True,
      env_workers=env_workers,
      assumptions=(
          f"figures from {source}",
          f"1 sampler x {slots} slots; decode step {decode_step_s * 1e3:.1f} ms + "
          f"{decode_step_per_seq_s * 1e3:.3f} ms/seq",
          f"{prompts} prompts x {attempts} attempts; response median {response_median:g}, p99 "
          f"{response_p99:g}, max {max_tokens} tokens; env per episode median "
          f"{env_median_s:.2f} s, p99 {env_p99_s:.2f} s, {env_workers or 'unlimited'} at once",
          f"learner {train_step_s:.2f} s/step, stalls the sampler (shared cores); sync "
          f"{sync_s:.2f} s, pause {sync_pause_s:.3f} s"))


def calibration_from_bench(cal: dict, source: str = "bench_async") -> Scenario:
  """`calibration_scenario` from one workload's `calibration` entry of a bench_async JSON."""
  g = cal["group_grade_s"]
  env_median, env_p99 = episode_env_from_group(g["median"], max(g["p99"], g["median"]),
                                               cal["attempts"])
  r = cal["response_tokens"]
  median = max(1.0, r["median"])
  return calibration_scenario(
      decode_step_s=cal["decode_step_s"], decode_step_per_seq_s=cal["decode_step_per_seq_s"],
      train_step_s=cal["train_step_s"], env_median_s=env_median, env_p99_s=env_p99,
      sync_s=cal["sync_s"], sync_pause_s=min(cal["sync_pause_s"], cal["sync_s"]),
      slots=cal["slots"], prompts=cal["prompts"], attempts=cal["attempts"],
      prompt_tokens=int(round(cal["prompt_tokens"])), response_median=median,
      response_p99=max(median, r["p99"]), max_tokens=cal["max_new_tokens"],
      env_workers=cal["grade_workers"] * cal["attempts"], source=source)


def _moe_scenario(name, *, accelerators, inference_frac, per_replica, slots, total_params,
                  active_params, weight_bytes_per_param, kv_bytes_per_token, prompts, attempts,
                  prompt_tokens, median, p99, max_tokens, turns, obs_tokens, env_median_s,
                  env_p99_s, train_mfu, flops_per_param_token, train_fixed_s, notes):
  inf_acc = int(round(accelerators * inference_frac))
  samplers = max(1, inf_acc // per_replica)
  train_acc = accelerators - samplers * per_replica
  w = sm.Workload(prompts, attempts, prompt_tokens, median, p99, max_tokens, env_median_s,
                  env_p99_s, turns, obs_tokens)
  mean_context = prompt_tokens + (turns - 1) * obs_tokens / 2 + median
  inf = decode_pool(samplers, per_replica, slots, weight_bytes=total_params *
                    weight_bytes_per_param, active_params=active_params,
                    kv_bytes_per_token=kv_bytes_per_token, mean_context_tokens=mean_context)
  tr = sm.TrainingPool.from_hardware(train_acc, active_params, PEAK_BF16_FLOPS, train_mfu,
                                     flops_per_param_token, train_fixed_s)
  sy = sync_from_fanout(samplers, per_replica, train_acc,
                        model_bytes=total_params * weight_bytes_per_param)
  return Scenario(name, w, inf, tr, sy, assumptions=(
      f"{accelerators} accelerators (989 TFLOP/s bf16, 4.8 TB/s HBM): {samplers} sampler "
      f"replicas x {per_replica} ({samplers * per_replica}, {inference_frac:.0%}) and "
      f"{train_acc} for training",
      f"model {total_params / 1e9:.0f}B total / {active_params / 1e9:.0f}B active, "
      f"{weight_bytes_per_param} byte(s)/param served, KV {kv_bytes_per_token / 1e3:.0f} kB/token",
      f"decode step {inf.step_s * 1e3:.1f} ms + {inf.step_per_seq_s * 1e6:.1f} us/seq, "
      f"{slots} slots/replica ({inf.tokens_per_s() / 1e3:.0f}k tokens/s pool at full slots)",
      f"learner {flops_per_param_token:g} x active flops/token at {train_mfu:.0%} MFU "
      f"({tr.s_per_token * 1e9:.1f} ns/token) + {train_fixed_s} s/step",
      f"{prompts} prompts x {attempts} attempts, {turns} turn(s), response median {median}, "
      f"p99 {p99}, max {max_tokens} tokens; env per turn median {env_median_s} s, p99 "
      f"{env_p99_s} s",
      f"weight sync from sync.fanout_sim over four clusters: {sy.end_to_end_s:.1f} s end to end, "
      f"pause <= {sy.max_pause_s:.2f} s (XOR+zstd 20.7x at the per-core rates measured here)",
  ) + notes)


def separate_pools_scenario(inference_frac: float = 1 / 3) -> Scenario:
  """(b) Separate pools at the size of the published async-RL results (AReaL, verl, ROLL)."""
  return _moe_scenario(
      "b: separate pools (64 accelerators, 30B-A3B MoE)", accelerators=64,
      inference_frac=inference_frac, per_replica=1, slots=128, total_params=30.5e9,
      active_params=3.3e9, weight_bytes_per_param=2, kv_bytes_per_token=98e3, prompts=128,
      attempts=16, prompt_tokens=1024, median=4096, p99=24576, max_tokens=32768, turns=1,
      obs_tokens=0, env_median_s=5.0, env_p99_s=60.0, train_mfu=0.25,
      flops_per_param_token=8.0, train_fixed_s=5.0,
      notes=("single-turn code RL: tests run once per attempt",))


def at_scale_scenario(inference_frac: float = 1 / 3, accelerators: int = 4096) -> Scenario:
  """(c) A ~1T-parameter MoE (32B active) coding agent over four clusters."""
  return _moe_scenario(
      f"c: at scale ({accelerators} accelerators, 1T-A32B MoE, inference "
      f"{inference_frac:.0%})", accelerators=accelerators, inference_frac=inference_frac,
      per_replica=16, slots=256, total_params=1.0e12, active_params=32e9,
      weight_bytes_per_param=1, kv_bytes_per_token=70e3, prompts=512, attempts=16,
      prompt_tokens=2048, median=4096, p99=32768, max_tokens=32768, turns=4, obs_tokens=512,
      env_median_s=2.0, env_p99_s=30.0, train_mfu=0.25, flops_per_param_token=8.0,
      train_fixed_s=10.0,
      notes=("multi-turn agent: the sequence leaves its slot while tools run; the prefix stays "
             "cached, so a later turn prefills only the tool output",))


def compare(scenario: Scenario, ks, steps: int, seed: int = 0) -> list:
  """The synchronous run (k=0) and one run per k, same prompts; returns [(k, Result)]."""
  return [(k, scenario.run(k, steps, seed)) for k in sorted(set([0, *ks]))]


def table(rows, baseline: sm.Result) -> str:
  """Markdown rows of `compare` output; speedups are against `baseline` (the k=0 run).

  "wall" covers all S steps (startup and drain included); "mid-run" is the steady state
  between versions S/4 and 3S/4, where the bottleneck is also judged.
  """
  head = ("| k | wall s (speedup) | s/step mid-run (speedup) | learner idle | sampler idle | "
          "slot occupancy | staleness mean / max | swapped mid-flight | dropped groups "
          "(wasted tokens) | bottleneck mid-run (binding utilisation) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
  lines = []
  for k, r in rows:
    lines.append(
        f"| {'sync' if k == 0 else k} | {r.wall_s:,.0f} ({baseline.wall_s / r.wall_s:.2f}x) | "
        f"{r.mid_step_s:,.1f} ({baseline.mid_step_s / r.mid_step_s:.2f}x) | "
        f"{r.train_idle_frac:.0%} | {r.inference_idle_frac:.0%} | {r.slot_occupancy:.0%} | "
        f"{r.staleness_mean:.2f} / {r.staleness_max} | {r.swapped_midflight_frac:.0%} | "
        f"{r.dropped_groups} ({r.wasted_token_frac:.1%}) | {r.bottleneck} "
        f"({r.binding_utilisation:.0%}) |")
  return head + "\n".join(lines) + "\n"
