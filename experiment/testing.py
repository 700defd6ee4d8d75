"""Checks that a finished run directory shows a run that trained (test-only helper).

The end-to-end tests call `assert_trained(run_dir, cfg)` on what `experiment.run.run` left behind:
metrics.jsonl (one record per pre-training and RL step), summary.json (the RL totals) and the
pre-trained and final models. A run whose every sampling request was refused writes all of these
files with the right number of records, so the checks read the figures in them (see rl.testing).
"""

from __future__ import annotations

import json
import os

from experiment.config import ExperimentConfig
from moe import checkpoint as moe_checkpoint
from rl import testing as rl_testing


def read_metrics(run_dir: str) -> dict:
  """{phase: [records in file order]} of run_dir/metrics.jsonl."""
  phases: dict = {}
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      rec = json.loads(line)
      phases.setdefault(rec["phase"], []).append(rec)
  return phases


def problems(run_dir: str, cfg: ExperimentConfig) -> list[str]:
  """What in run_dir shows that the run did not train as `cfg` asks (empty if nothing).

  Pre-training: cfg.pretrain.steps steps, each with trained tokens, a finite non-zero loss and
  the next policy version. RL: cfg.rl.steps steps, each packing all of its
  cfg.rl.pipeline.episodes_per_step episodes (the tiny runs of the tests have no infrastructure
  failures, so any missing episode is a fault), with the same per-step checks; summary.json's
  totals agree; and the final model's weights differ from the pre-trained ones RL started from.
  """
  out = []
  metrics = read_metrics(run_dir)
  out += rl_testing.step_problems(metrics.get("pretrain", []), steps=cfg.pretrain.steps,
                                  episodic=False)
  per_step = cfg.rl.pipeline.episodes_per_step
  rl_steps = metrics.get("rl", [])
  out += [f"rl {p}" for p in rl_testing.step_problems(rl_steps, steps=cfg.rl.steps,
                                                      episodes_per_step=per_step)]
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    totals = json.load(f).get("rl", {})
  want = {"steps": cfg.rl.steps, "trained_episodes": cfg.rl.steps * per_step,
          "infra_failures": 0, "policy_version": cfg.rl.steps}
  got = {k: totals.get(k) for k in want}
  if got != want:
    out.append(f"summary.json rl totals {got}, expected {want}")
  logged = sum(r.get("trained_episodes", 0) for r in rl_steps)
  if totals.get("trained_episodes") != logged:
    out.append(f"summary.json says {totals.get('trained_episodes')} episodes trained, "
               f"metrics.jsonl {logged}")
  if cfg.rl.steps:
    _, initial = moe_checkpoint.load_params_flat(os.path.join(run_dir, "pretrained_model"))
    _, final = moe_checkpoint.load_params_flat(os.path.join(run_dir, "final_model"))
    out += [f"final_model vs pretrained_model: {p}"
            for p in rl_testing.weight_problems(initial, final)]
  return out


def assert_trained(run_dir: str, cfg: ExperimentConfig) -> None:
  """Raises AssertionError naming every sign that the run in run_dir did not train."""
  found = problems(run_dir, cfg)
  if found:
    raise AssertionError(f"the run in {run_dir} did not train:\n  " + "\n  ".join(found))
