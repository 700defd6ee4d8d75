"""Paired comparison of two evaluations of the same tasks: the gain in pass@1 and its error.

  bazel run //tools:compare_evals -- runs/20261201-101500          # a main-job run directory
  bazel run //tools:compare_evals -- before.jsonl after.jsonl [--json out.json]

Reads the per-task JSONL files that `evaluation.evaluate` writes (a main-job run directory holds
them as eval_before.jsonl and eval_after.jsonl) and pairs the tasks by id. For each task its
pass@1 is c/n (passing over good samples); the report gives:

  * tasks up / down / unchanged, and the mean per-task gain (equal to the pooled pass@1 gain when
    every task has the same n);
  * the task-level standard error of that mean, std(gains, ddof=1) / sqrt(tasks): how much the
    gain would vary over another draw of tasks from the same suite;
  * the sample-level (binomial) standard error, sqrt(sum_t [pb(1-pb)/nb + pa(1-pa)/na]) / tasks:
    how much it would vary over another draw of samples for these same tasks;
  * the gain in units of each.

Why a tool: BENCHMARKS.md's main-job figures are these numbers, and this is the command that
produces them from a run's own files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from evaluation import evaluate as evaluate_lib


def _pass1(rows: list, label: str) -> dict:
  out = {}
  for r in rows:
    if r["task_id"] in out:
      raise ValueError(f"{label}: task {r['task_id']!r} appears twice")
    out[r["task_id"]] = (int(r["c"]), int(r["n"]))
  return out


def compare(before: list, after: list) -> dict:
  """Paired statistics of per-task pass@1 (see the module docstring).

  Args:
    before, after: per-task result dicts (at least task_id, n, c), as `read_results` returns.

  Raises:
    ValueError: the two evaluations do not cover the same tasks, or a task has no good sample.
  """
  b, a = _pass1(before, "before"), _pass1(after, "after")
  if set(b) != set(a):
    only_b, only_a = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    raise ValueError(f"the evaluations cover different tasks (only before: {only_b[:5]}, "
                     f"only after: {only_a[:5]})")
  if len(b) < 2:
    raise ValueError("need at least two tasks for a standard error")
  gains, var = [], 0.0
  for t in sorted(b):
    (cb, nb), (ca, na) = b[t], a[t]
    if nb < 1 or na < 1:
      raise ValueError(f"task {t!r} has no good sample (n = {nb} before, {na} after)")
    pb, pa = cb / nb, ca / na
    gains.append(pa - pb)
    var += pb * (1 - pb) / nb + pa * (1 - pa) / na
  k = len(gains)
  mean = sum(gains) / k
  task_se = math.sqrt(sum((g - mean) ** 2 for g in gains) / (k - 1) / k)
  sample_se = math.sqrt(var) / k
  return {
      "tasks": k,
      "up": sum(g > 0 for g in gains), "down": sum(g < 0 for g in gains),
      "unchanged": sum(g == 0 for g in gains),
      "passed_before": sum(c for c, _ in b.values()), "samples_before": sum(n for _, n in b.values()),
      "passed_after": sum(c for c, _ in a.values()), "samples_after": sum(n for _, n in a.values()),
      "mean_gain": mean, "task_se": task_se, "sample_se": sample_se,
      "gain_over_task_se": mean / task_se if task_se > 0 else math.inf,
      "gain_over_sample_se": mean / sample_se if sample_se > 0 else math.inf,
  }


def text(s: dict) -> str:
  return (f"pass@1 before {s['passed_before']}/{s['samples_before']} -> after "
          f"{s['passed_after']}/{s['samples_after']}; per task ({s['tasks']} paired): "
          f"{s['up']} up, {s['down']} down, {s['unchanged']} unchanged; mean gain "
          f"{s['mean_gain']:+.3f}, task-level SE {s['task_se']:.3f} "
          f"({s['gain_over_task_se']:.1f} SE), sample-level (binomial) SE {s['sample_se']:.3f} "
          f"({s['gain_over_sample_se']:.1f} SE)")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("paths", nargs="+",
                 help="a run directory, or the before and after per-task JSONL files")
  p.add_argument("--json", help="also write the statistics here")
  args = p.parse_args(argv)
  if len(args.paths) == 1:
    d = args.paths[0]
    paths = [os.path.join(d, "eval_before.jsonl"), os.path.join(d, "eval_after.jsonl")]
  elif len(args.paths) == 2:
    paths = args.paths
  else:
    p.error("give a run directory or two JSONL files")
  try:
    stats = compare(*(evaluate_lib.read_results(x) for x in paths))
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text(stats))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(stats, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
