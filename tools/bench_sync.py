"""Benchmark of weight-sync delta compression, and the 1 TB fan-out estimate.

Every row compares, in the same run and on the same buffers (medians of --repeats interleaved
repeats): our codec vs plain XOR+zstd (ratio, encode, decode), and our in-place apply (what a
sampler's `Subscriber(inplace=True)` does) vs memcpy of the new weights into those same
buffers; `delta.decode` (the convenience interface; its memory comes from results dropped
earlier) and `delta.decode(out=)` vs that same memcpy; `delta.decode(recycle=False)` into
freshly allocated arrays vs a copy into new arrays is reported beside them. Both sides of
every comparison run on the same threads (`--workers`, default: cores, at most 8; the
baselines are split over the threads as `sync.bench` describes); `--workers 2,1` measures
each pair at every listed count, one table per count, so the single-thread rows of both
sides come from the same run.

Synthetic RL-like updates (64M bf16 parameters, changed fractions 1%/4%/25%, minutes on 2 cores):
  .venv/bin/python -m tools.bench_sync --workers 2,1
  bazel run //tools:bench_sync -- --size 16000000
Real consecutive versions from the learner's own training steps (rl.learner.Learner on the
tiny preset, next-token loss on random tokens, AdamW at each learning rate; bf16 sampler copies):
  .venv/bin/python -m tools.bench_sync --learner_steps 6 --learner_lrs 1e-6,1e-5,1e-4,3e-4
Two checkpoints (orbax directories or .npz, cast to the sampler's bf16):
  .venv/bin/python -m tools.bench_sync --from_checkpoints CKPT_STEP_N CKPT_STEP_N+1
A fresh process's first delta against its later ones (numba kernels compiled in the first
apply, loaded from the on-disk kernel cache in it, or readied by the start-up warm-up a
sampler's subscriber runs; each row a fresh interpreter, the cache in a temporary directory):
  .venv/bin/python -m tools.bench_sync --first_swap [--first_swap_params 16777216]
"""

import argparse
import json
import sys
import tempfile

import ml_dtypes
import numpy as np

from sync import bench


def learner_rows(gin_files, lrs, steps: int, repeats: int, workers=(None,), rows: int = 4,
                 seq_len: int = 32, bindings=()):
  """Rows for consecutive learner versions at each learning rate, and a per-lr summary."""
  from tools import train_deltas  # pylint: disable=g-import-not-at-top  (JAX only here)
  from tools import configs  # pylint: disable=g-import-not-at-top
  configs.parse(gin_files, bindings)
  cfg = configs.model_config()
  out, summary = [], []
  for lr in lrs:
    prev = None
    pairs = []
    for version, flat, loss in train_deltas.learner_versions(
        cfg, steps=steps, learning_rate=lr, rows=rows, seq_len=seq_len):
      if prev is not None:
        for w in workers:
          r = bench.measure(prev[1], flat, f"learner lr={lr:g} v{prev[0]}->v{version}",
                            repeats, w)
          print(bench.markdown([r]).splitlines()[-1], flush=True)
        pairs.append(r)  # ratios do not depend on the threads: one row per pair
      prev = (version, flat)
    out.extend(pairs)
    summary.append({"lr": lr, "params": pairs[0].params,
                    "changed": [r.changed for r in pairs], "ratio": [r.ratio for r in pairs],
                    "xor_ratio": [r.xor_ratio for r in pairs]})
  return out, summary


FIRST_SWAP_MODES = (
    # (label, use the cache, warm up at start-up)
    ("no kernel cache, no warm-up (before #20)", False, False),
    ("kernel cache, no warm-up", True, False),
    ("kernel cache + warm-up at start-up (a sampler now)", True, True),
)


def first_swap_rows(params: int) -> list:
  """`bench.first_apply` in a fresh process per mode of FIRST_SWAP_MODES, the cache filled by
  one more process first (its warm-up time is the compile time). Rows: dicts with "label"."""
  rows = []
  with tempfile.TemporaryDirectory(prefix="kernel-cache-") as cache:
    fill = bench.first_apply_in_process(cache, params, warm=True)
    rows.append(dict(fill, label="filling the cache: compile at start-up"))
    for label, cached, warm in FIRST_SWAP_MODES:
      rows.append(dict(bench.first_apply_in_process(cache if cached else "off", params, warm),
                       label=label))
  return rows


def first_swap_markdown(rows) -> str:
  """`first_swap_rows` as a Markdown table."""
  head = ("| process | warm-up at start-up s | first delta s | later deltas s (median) | "
          "first / later | kernel signatures readied during the first |\n"
          "| --- | --- | --- | --- | --- | --- |\n")
  lines = []
  for r in rows:
    warm = "-" if r["warm_up_s"] is None else f"{r['warm_up_s']:.2f}"
    lines.append(f"| {r['label']} | {warm} | {r['first_s']:.3f} | {r['later_s']:.3f} | "
                 f"{r['first_s'] / r['later_s']:.1f}x | {r['compiled_in_first']} |\n")
  return head + "".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", type=int, default=64 << 20, help="parameters (synthetic)")
  p.add_argument("--fractions", default="0.01,0.04,0.25")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--workers", default="",
                 help="comma-separated thread counts, each used by ours and the baselines alike "
                      "(default: cores, at most 8); e.g. 2,1 adds the single-thread rows")
  p.add_argument("--from_checkpoints", nargs=2, metavar=("BASE", "NEW"))
  p.add_argument("--keep_dtype", action="store_true",
                 help="with --from_checkpoints: do not cast floating tensors to bf16")
  p.add_argument("--learner_steps", type=int, default=0,
                 help="train the learner this many steps per learning rate and measure "
                      "consecutive versions (instead of synthetic updates)")
  p.add_argument("--learner_lrs", default="1e-6,1e-5,1e-4,3e-4")
  p.add_argument("--first_swap", action="store_true",
                 help="time a fresh process's first delta against its later ones (see above)")
  p.add_argument("--first_swap_params", type=int, default=1 << 24)
  p.add_argument("--no_sim", action="store_true")
  p.add_argument("--json", help="also write the rows and the simulation here")
  from tools import configs  # pylint: disable=g-import-not-at-top
  # --gin_file: the model for --learner_steps (default moe/configs/tiny.gin); --gin.X=V bindings,
  # e.g. --gin.ModelConfig.hidden_size=256.
  args, files, bindings = configs.parse_flags(p, sys.argv[1:] if argv is None else argv)
  workers = [int(x) for x in args.workers.split(",") if x] or [None]
  report = {}
  if args.first_swap:
    rows = first_swap_rows(args.first_swap_params)
    print(first_swap_markdown(rows))
    print(f"({rows[0]['params']} parameters: {rows[0]['chunks']} chunks; every row a fresh "
          "process; one delta = apply in place checked by the changes and by the result "
          "hashes, and a decode into new arrays)")
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"first_swap": rows}, f, indent=1, default=str)
    return 0
  if args.from_checkpoints:
    rows = [bench.from_checkpoints(*args.from_checkpoints,
                                   dtype=None if args.keep_dtype else ml_dtypes.bfloat16,
                                   repeats=args.repeats, workers=w) for w in workers]
  elif args.learner_steps:
    rows, report["learner"] = learner_rows(
        files or ["moe/configs/tiny.gin"],
        [float(x) for x in args.learner_lrs.split(",")], args.learner_steps, args.repeats,
        workers, bindings=bindings)
  else:
    fr = [float(f) for f in args.fractions.split(",")]
    rows = []
    for label, base, new in bench.synthetic_pairs(args.size, fr):
      for w in workers:
        rows.append(bench.measure(base, new, label, args.repeats, w))
        print(bench.markdown(rows[-1:]).splitlines()[-1], flush=True)
  for w in sorted({r.workers for r in rows}, reverse=True):
    print()
    print(bench.markdown([r for r in rows if r.workers == w]))
    print(f"(medians of {args.repeats} interleaved repeats, {w} thread(s) for ours and for "
          "every baseline; 'apply / memcpy' = delta.apply_inplace (check='changes' with the "
          "held version named, as the subscriber runs it / check='result') vs np.copyto of the "
          f"new weights into the same held buffers split over the same {w} thread(s))")
  for s in report.get("learner", []):
    print(f"learner lr={s['lr']:g} ({s['params']} params): changed "
          f"{np.median(s['changed']):.2%} (range {min(s['changed']):.2%}-"
          f"{max(s['changed']):.2%}), ratio median {np.median(s['ratio']):.1f}x vs XOR+zstd "
          f"{np.median(s['xor_ratio']):.1f}x")
  report["rows"] = [dict(r.__dict__, apply_vs_memcpy=r.apply_vs_memcpy,
                         apply_changes_vs_memcpy=r.apply_changes_vs_memcpy,
                         decode_vs_memcpy=r.decode_vs_memcpy,
                         decode_out_vs_memcpy=r.decode_out_vs_memcpy) for r in rows]
  if not args.no_sim:
    most = max(r.workers for r in rows)
    row = min((r for r in rows if r.workers == most), key=lambda r: abs(r.changed - 0.04))
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
