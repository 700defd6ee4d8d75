"""Benchmark of weight-sync delta compression, and the 1 TB fan-out estimate.

Run (64M bf16 parameters, changed fractions 1%/4%/25%, < 2 minutes on 2 cores):
  .venv/bin/python -m tools.bench_sync
  bazel run //tools:bench_sync -- --size 16000000
Real learner steps (orbax checkpoint directories or .npz, cast to the sampler's bf16):
  .venv/bin/python -m tools.bench_sync --from_checkpoints CKPT_STEP_N CKPT_STEP_N+1
"""

import argparse
import json
import sys

import ml_dtypes

from sync import bench


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", type=int, default=64 << 20, help="parameters (synthetic)")
  p.add_argument("--fractions", default="0.01,0.04,0.25")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--workers", type=int, default=None)
  p.add_argument("--from_checkpoints", nargs=2, metavar=("BASE", "NEW"))
  p.add_argument("--keep_dtype", action="store_true",
                 help="with --from_checkpoints: do not cast floating tensors to bf16")
  p.add_argument("--no_sim", action="store_true")
  p.add_argument("--json", help="also write the rows and the simulation here")
  args = p.parse_args(argv)
  if args.from_checkpoints:
    rows = [bench.from_checkpoints(*args.from_checkpoints,
                                   dtype=None if args.keep_dtype else ml_dtypes.bfloat16,
                                   repeats=args.repeats, workers=args.workers)]
  else:
    fr = [float(f) for f in args.fractions.split(",")]
    rows = []
    for label, base, new in bench.synthetic_pairs(args.size, fr):
      rows.append(bench.measure(base, new, label, args.repeats, args.workers))
      print(bench.markdown(rows[-1:]).splitlines()[-1], flush=True)
  print()
  print(bench.markdown(rows))
  report = {"rows": [r.__dict__ for r in rows]}
  if not args.no_sim:
    row = min(rows, key=lambda r: abs(r.changed - 0.04))
    report["terabyte"] = bench.terabyte_report(row)
    print(f"1 TB model, four clusters (calibrated on '{row.label}', "
          f"{row.workers} workers here):")
    for mode, r in report["terabyte"].items():
      print(f"  {mode}: step -> every sampler serving {r['end_to_end_s']:.1f} s, "
            f"max pause {r['max_pause_s']:.2f} s, delta {r['delta_GB']:.1f} GB")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
