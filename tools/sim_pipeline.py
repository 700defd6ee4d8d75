"""Projects asynchronous vs synchronous RL with the pipeline simulator (issue 7, "at scale").

Runs three scenarios from `pipeline.sim_scenarios` and prints, per scenario, its assumptions, a
table (synchronous baseline and asynchronous runs at several max staleness k, same prompts,
speedups against the synchronous run of the same invocation) and where the bottleneck is:
  (a) calibration: this machine's shape (one sampler and the learner sharing the cores);
  (b) separate pools: 64 accelerators, a 30B-A3B MoE, inference on a third;
  (c) at scale: 4096 accelerators over four clusters, a 1T-A32B MoE coding agent, sweeping
      the inference fraction and k.

  bazel run //tools:sim_pipeline             # all three (a few minutes on two busy cores)
  bazel run //tools:sim_pipeline -- --quick  # fewer steps and sweep points
"""

import argparse
import json
import sys
import time

from pipeline import sim_scenarios as sc


def _statements(rows):
  out = []
  for k, r in rows:
    shares = ", ".join(f"{key} {v:.0%}" for key, v in sorted(r.mid_shares.items(),
                                                               key=lambda kv: -kv[1]) if v >= 0.01)
    out.append(f"- {'sync' if k == 0 else f'k={k}'}: {r.bottleneck}-bound (binding utilisation "
               f"{r.binding_utilisation:.0%}); {r.mid_step_s:,.1f} s/step mid-run; mid-run time: "
               f"{shares}")
  return "\n".join(out)


def _report(scn, rows, extra=(), out=None):
  sync = rows[0][1]
  base = sync.wall_s
  print(f"\n### {scn.name}\n")
  print("Assumptions: " + "; ".join(scn.assumptions) + ".\n")
  print(sc.table(rows, sync))
  for label, r in extra:
    print(f"{label}: wall {r.wall_s:,.0f} s ({base / r.wall_s:.2f}x), mid-run "
          f"{sync.mid_step_s / r.mid_step_s:.2f}x, staleness mean "
          f"{r.staleness_mean:.2f} / max {r.staleness_max}, dropped groups {r.dropped_groups} "
          f"({r.wasted_token_frac:.1%} of generated tokens wasted)\n")
  print(_statements(rows), flush=True)
  if out is not None:
    out[scn.name] = [dict(k=k, wall_s=r.wall_s, speedup=base / r.wall_s,
                          mid_step_s=r.mid_step_s,
                          mid_speedup=sync.mid_step_s / r.mid_step_s, bottleneck=r.bottleneck,
                          shares=r.shares, slot_occupancy=r.slot_occupancy,
                          train_idle=r.train_idle_frac, staleness_mean=r.staleness_mean,
                          staleness_max=r.staleness_max) for k, r in rows]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=16, help="learner steps, scenarios a and b")
  p.add_argument("--scale_steps", type=int, default=16, help="learner steps, scenario c")
  p.add_argument("--ks", default="1,2,4,8", help="max staleness values besides sync")
  p.add_argument("--fractions", default="0.167,0.333,0.5,0.667",
                 help="inference fractions swept at scale")
  p.add_argument("--sweep_ks", default="4", help="k values in the inference-fraction sweep")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", help="also write the figures here")
  args = p.parse_args(argv)
  ks = [int(x) for x in args.ks.split(",")]
  fractions = [float(x) for x in args.fractions.split(",")]
  sweep_ks = [int(x) for x in args.sweep_ks.split(",")]
  if args.quick:
    args.steps, args.scale_steps, ks, fractions, sweep_ks = 8, 6, [4], [0.333, 0.667], [4]
  out, t0 = {}, time.time()

  a = sc.calibration_scenario()
  _report(a, sc.compare(a, ks, args.steps, args.seed), out=out)

  b = sc.separate_pools_scenario()
  rows = sc.compare(b, ks, args.steps, args.seed)
  drop = b.run(4, args.steps, args.seed, consume="completion")
  _report(b, rows, [("k=4, learner takes groups by completion and drops stale ones", drop)],
          out)

  c = sc.at_scale_scenario()
  _report(c, sc.compare(c, ks, args.scale_steps, args.seed), out=out)
  print("\n### c: inference-fraction sweep (4096 accelerators)\n")
  print("| inference share | samplers | training chips | k | s/step mid-run (speedup) | wall "
        "speedup | learner idle | slot occupancy | bottleneck mid-run (binding utilisation) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  sweep = []
  for f in fractions:
    scn = sc.at_scale_scenario(inference_frac=f)
    train_chips = 4096 - scn.inference.samplers * 16
    rows = sc.compare(scn, sweep_ks, args.scale_steps, args.seed)
    base, base_mid = rows[0][1].wall_s, rows[0][1].mid_step_s
    for k, r in rows:
      print(f"| {f:.0%} | {scn.inference.samplers} | {train_chips} | "
            f"{'sync' if k == 0 else k} | {r.mid_step_s:,.1f} ({base_mid / r.mid_step_s:.2f}x) | "
            f"{base / r.wall_s:.2f}x | "
            f"{r.train_idle_frac:.0%} | {r.slot_occupancy:.0%} | {r.bottleneck} "
            f"({r.binding_utilisation:.0%}) |", flush=True)
      sweep.append(dict(fraction=f, k=k, mid_step_s=r.mid_step_s, speedup=base / r.wall_s,
                        mid_speedup=base_mid / r.mid_step_s,
                        bottleneck=r.bottleneck, shares=r.shares))
  out["sweep"] = sweep
  print(f"\n(simulated in {time.time() - t0:.0f} s)")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  sys.exit(main())
