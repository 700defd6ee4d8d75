"""What a run leaves behind and shows while it runs: progress bars, metrics.jsonl, TensorBoard
event files, PNG plots and a summary table.

Every logged record is one JSON line {"phase", "step", "time", <scalar metrics>}; TensorBoard gets
the same scalars as `<phase>/<name>`; the plots are drawn from metrics.jsonl at the end, so they
can also be redrawn from a finished run (`make_plots(run_dir)`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Mapping, Optional

import numpy as np

# Shown in the progress bar, in this order, when a phase logs them.
_BAR_KEYS = (("reward", "reward"), ("pass_rate", "pass"), ("loss", "loss"),
             ("tokens_per_s", "tok/s"), ("staleness_mean", "stale"))


def _scalars(metrics: Mapping) -> dict:
  out = {}
  for k, v in metrics.items():
    if isinstance(v, (bool, np.bool_)):
      out[k] = float(v)
    elif isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v)):
      out[k] = float(v)
    elif np.ndim(v) == 0 and isinstance(v, np.ndarray):
      out[k] = float(v)
  return out


class Reporter:
  """Writes metrics.jsonl and TensorBoard events under `run_dir` and draws progress bars."""

  def __init__(self, run_dir: str, *, progress: bool = True, stream=None):
    os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.progress = progress
    self.stream = stream or sys.stderr
    self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
    self._bar = None
    self._t0 = time.time()

  def start_phase(self, name: str, total: int) -> None:
    self.end_phase()
    if self.progress:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=total, desc=f"{name:>8}", file=self.stream, dynamic_ncols=True,
                       leave=True)

  def log(self, phase: str, step: int, metrics: Mapping, *, advance: int = 1) -> dict:
    rec = {"phase": phase, "step": int(step), "time": round(time.time() - self._t0, 3)}
    rec.update(_scalars(metrics))
    self._jsonl.write(json.dumps(rec) + "\n")
    self._jsonl.flush()
    for k, v in rec.items():
      if k not in ("phase", "step", "time"):
        self._tb.add_scalar(f"{phase}/{k}", v, int(step))
    if self._bar is not None:
      post = {short: f"{rec[k]:.3g}" for k, short in _BAR_KEYS if k in rec}
      self._bar.set_postfix(post, refresh=False)
      self._bar.update(advance)
    return rec

  def end_phase(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def close(self) -> None:
    self.end_phase()
    self._tb.flush()
    self._tb.close()
    self._jsonl.close()


def read_metrics(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


_PLOTS = (
    ("reward.png", "RL reward (mean over each step's attempts)", "rl", ("reward", "pass_rate")),
    ("staleness.png", "Policy lag of trained tokens (versions)", "rl",
     ("staleness_mean", "staleness_max")),
    ("kl.png", "KL(sampler || learner) on trained tokens (k3)", "rl", ("sampler_kl",)),
    ("throughput.png", "Learner tokens/s", None, ("tokens_per_s",)),
    ("pretrain_loss.png", "Pre-training loss", "pretrain", ("loss",)),
)


def make_plots(run_dir: str) -> list[str]:
  """Draws the run's PNG plots from metrics.jsonl; returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  recs = read_metrics(run_dir)
  paths = []
  for fname, title, phase, keys in _PLOTS:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    drawn = False
    for k in keys:
      pts = [(r["step"], r[k], r["phase"]) for r in recs
             if k in r and (phase is None or r["phase"] == phase)]
      for ph in sorted({p for _, _, p in pts}):
        xs = [s for s, _, p in pts if p == ph]
        ys = [v for _, v, p in pts if p == ph]
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None,
                label=k if phase else f"{ph}: {k}")
        drawn = True
    if not drawn:
      plt.close(fig)
      continue
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(run_dir, fname)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  evals = [r for r in recs if r["phase"] == "eval"]
  if evals:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = ["before RL" if r["step"] == 0 else f"after RL (step {r['step']})" for r in evals]
    vals = [r["pass1"] for r in evals]
    ax.bar(labels, vals, color=["#999999" if r["step"] == 0 else "#3366cc" for r in evals])
    for i, v in enumerate(vals):
      ax.text(i, v, f"{v:.3f}", ha="center", va="bottom")
    ax.set_title("Held-out pass@1")
    ax.set_ylim(0, max(1e-3, max(vals)) * 1.25)
    fig.tight_layout()
    path = os.path.join(run_dir, "heldout_pass_rate.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths


def summary_table(rows: list[tuple[str, str]]) -> str:
  """A two-column text table."""
  width = max(len(k) for k, _ in rows)
  line = "-" * (width + 3 + max(len(v) for _, v in rows))
  return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])
