"""Projects asynchronous vs synchronous RL at scale with the pipeline simulator.

Runs three scenarios from `pipeline.sim_scenarios` and prints, per scenario, its assumptions, a
table (synchronous baseline and asynchronous runs at several max staleness k, same prompts,
speedups against the synchronous run of the same invocation) and where the bottleneck is:
  (a) calibration: this machine's shape (one sampler and the learner sharing the cores), built
      from the figures a `//tools:bench_async --json FILE` run measured (`--measured FILE`), and
      its prediction next to that run's measured wall times; skipped without `--measured`;
  (b) separate pools: 64 accelerators, a 30B-A3B MoE, inference on a third;
  (c) at scale: 4096 accelerators over four clusters, a 1T-A32B MoE coding agent, sweeping
      the inference fraction and k.

  bazel run //tools:sim_pipeline             # all three (a few minutes on two busy cores)
  bazel run //tools:sim_pipeline -- --quick  # fewer steps and sweep points
  bazel run //tools:sim_pipeline -- --measured /tmp/bench_async.json --only_measured
"""

import argparse
import json
import sys
import time

from pipeline import sim_scenarios as sc


def predicted_vs_measured(report: dict, seed: int = 0) -> list:
  """Per workload of a bench_async JSON: the calibration scenario's sync and async runs
  (simulated with that run's steps and k, from its measured figures) beside the measured ones."""
  k, steps = report["args"]["staleness"], report["args"]["steps"]
  rows = []
  for env, cal in report["calibration"].items():
    scn = sc.calibration_from_bench(cal, source=f"bench_async ({env})")
    sim = dict(sc.compare(scn, [k], steps, seed))
    meas = report["summary"][env]
    rows.append(dict(
        workload=env, k=k, steps=steps, scenario=scn,
        predicted_sync_s=sim[0].wall_s, predicted_async_s=sim[k].wall_s,
        predicted_speedup=sim[0].wall_s / sim[k].wall_s,
        predicted_bottleneck=(sim[0].bottleneck, sim[k].bottleneck),
        measured_sync_s=meas["sync"]["wall_s"], measured_async_s=meas["async"]["wall_s"],
        measured_sync_range=(meas["sync"]["wall_min_s"], meas["sync"]["wall_max_s"]),
        measured_async_range=(meas["async"]["wall_min_s"], meas["async"]["wall_max_s"]),
        measured_speedup=meas["speedup"]))
  return rows


def predicted_vs_measured_table(rows) -> str:
  """Markdown: predicted and measured wall times and speedups, one row per workload."""
  out = ["| workload | mode | predicted wall s | measured wall s, median (min-max) | "
         "predicted / measured |", "| --- | --- | --- | --- | --- |"]
  for r in rows:
    for mode, label in (("sync", "sync"), ("async", f"async k={r['k']}")):
      p, m, (lo, hi) = (r[f"predicted_{mode}_s"], r[f"measured_{mode}_s"],
                        r[f"measured_{mode}_range"])
      out.append(f"| {r['workload']} | {label} | {p:.1f} | {m:.1f} ({lo:.1f}-{hi:.1f}) | "
                 f"{p / m:.2f} |")
    out.append(f"| {r['workload']} | speedup | {r['predicted_speedup']:.2f}x | "
               f"{r['measured_speedup']:.2f}x | {r['predicted_speedup'] / r['measured_speedup']:.2f} |")
  return "\n".join(out) + "\n"


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
  p.add_argument("--measured", help="a bench_async --json file: builds scenario (a) from it")
  p.add_argument("--only_measured", action="store_true", help="scenario (a) only")
  args = p.parse_args(argv)
  ks = [int(x) for x in args.ks.split(",")]
  fractions = [float(x) for x in args.fractions.split(",")]
  sweep_ks = [int(x) for x in args.sweep_ks.split(",")]
  if args.quick:
    args.steps, args.scale_steps, ks, fractions, sweep_ks = 8, 6, [4], [0.333, 0.667], [4]
  out, t0 = {}, time.time()

  if args.measured:
    with open(args.measured, encoding="utf-8") as fh:
      report = json.load(fh)
    pvm = predicted_vs_measured(report, args.seed)
    for r in pvm:
      _report(r["scenario"], sc.compare(r["scenario"], ks, args.steps, args.seed), out=out)
    print(f"\n### a: predicted vs measured ({args.measured}; {report['args']['steps']} steps, "
          f"machine {report['machine_before']['cpu']}, "
          f"{report['machine_before']['cores_usable']} cores)\n")
    print(predicted_vs_measured_table(pvm), flush=True)
    out["predicted_vs_measured"] = [{k: v for k, v in r.items() if k != "scenario"}
                                    for r in pvm]
  else:
    print("\n(a) skipped: pass --measured FILE from `//tools:bench_async -- --json FILE`")
  if args.only_measured:
    _dump(args.json, out)
    return 0

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
  _dump(args.json, out)
  return 0


def _dump(path, out):
  if path:
    with open(path, "w", encoding="utf-8") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  sys.exit(main())
