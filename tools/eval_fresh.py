"""Scores saved models on fresh repository tasks: a validation set that weighs the weak templates.

  bazel run //tools:eval_fresh -- --out=/tmp/fresh MODEL_DIR [MODEL_DIR ...]
  .venv/bin/python -m tools.eval_fresh --out=/tmp/fresh /tmp/val/pre/pretrained_model \
      /tmp/val/A/final_model

Why: the validation split carved from the suite's train tasks (ExperimentConfig.validation_fraction
= 0.15: 45 tasks) is a third const, which no model here solves, and holds 5 helper and 5 imports
tasks, while the held-out split is a third helper; an RL change that moves the weak templates
barely shows on it. These tasks come from `envs.tasks.suite_repo.generate_fresh` (seed 4): they
share no combination, visible assertion or fix with any suite task (held-out included) nor with
the fresh tasks an RL run with `ExperimentConfig.rl_fresh_tasks = --rl_fresh_tasks` trains on
(seed 3), so no model of such runs has seen them. op and rename have none left after those
(their combinations run out), so the set is helper, imports and const.

Each model is scored as the experiment scores its evaluated split (experiment.run's evaluation
with the gin files' AgentConfig and EvalConfig; default agent.gin). Per-task results go to
`<out>/<n>.jsonl`, n the model's position on the command line (`tools.compare_evals A.jsonl
B.jsonl` pairs two of them), and one line per model is printed: passing samples over samples,
and per template.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Sequence

from tools import configs

DEFAULT_GIN = "tools/configs/experiments/agent.gin"
# Per template; the order fixes the draw (each template's tasks avoid the ones drawn before).
PER_TEMPLATE = (("helper", 40), ("imports", 30), ("const", 15))
RL_SEED, FRESH_SEED = 3, 4  # experiment.run's seed + 3 for RL's fresh tasks (cfg.seed = 0)


def fresh_tasks(rl_fresh_tasks: int, rl_templates: Sequence[str],
                per_template: Sequence[tuple[str, int]] = PER_TEMPLATE) -> list:
  """The fresh validation tasks: none of the suite's, none of RL's fresh tasks."""
  from envs.tasks import suite_repo  # pylint: disable=g-import-not-at-top
  seen = suite_repo.generate()
  if rl_fresh_tasks:
    seen += suite_repo.generate_fresh(seen, seed=RL_SEED, per_template=rl_fresh_tasks,
                                      templates=tuple(rl_templates) or suite_repo.TEMPLATES)
  tasks = []
  for template, n in per_template:
    got = suite_repo.generate_fresh(seen, seed=FRESH_SEED, per_template=n, templates=(template,))
    tasks += got
    seen = seen + got
  return tasks


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("models", nargs="+", help="saved model directories (a run's pretrained_model, "
                 "final_model)")
  p.add_argument("--out", required=True, help="directory for the per-task JSONL files")
  p.add_argument("--rl_fresh_tasks", type=int, default=40,
                 help="the largest ExperimentConfig.rl_fresh_tasks of the runs compared")
  p.add_argument("--per_template", default=",".join(f"{t}={n}" for t, n in PER_TEMPLATE),
                 help="tasks per template, in drawing order")
  args, files, bindings = configs.parse_flags(p, sys.argv[1:] if argv is None else argv)
  try:
    cfg = configs.load_experiment(files or [DEFAULT_GIN], bindings)
  except configs.ConfigError as e:
    p.error(str(e))
  if cfg.suite != "repo":
    p.error(f"fresh tasks are repository tasks; the gin files' suite is {cfg.suite!r}")
  for m in args.models:
    if not os.path.isdir(m):
      p.error(f"no model directory {m!r}")
  try:
    per_template = [(t, int(n)) for t, n in (x.split("=") for x in args.per_template.split(","))]
  except ValueError:
    p.error(f"--per_template must look like helper=40,imports=30, got {args.per_template!r}")
  from envs.harness import agent_loop  # pylint: disable=g-import-not-at-top
  from envs.sandbox import pool as pool_lib  # pylint: disable=g-import-not-at-top
  from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top
  from moe.hf import special_tokens  # pylint: disable=g-import-not-at-top
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tasks = fresh_tasks(args.rl_fresh_tasks, cfg.rl_templates, per_template)
  os.makedirs(args.out, exist_ok=True)
  print(f"{len(tasks)} fresh tasks x {cfg.eval.samples}: "
        f"{dict(collections.Counter(t.metadata['template'] for t in tasks))}", flush=True)
  summary = {}
  with pool_lib.WarmPool(size=cfg.sandbox_pool) as pool:
    for i, m in enumerate(args.models):
      model = moe_checkpoint.load_model(m)
      tok = tokenizer_lib.for_model(m, model.config.vocab_size)
      eos = special_tokens.eos_token_ids(m)
      chat = agent_loop.chat_for(tasks, tok, eos)
      report, passed, total = run_lib.evaluate_tasks(
          model, tasks, cfg, pool, os.path.join(args.out, f"{i}.jsonl"), tokenizer=tok,
          eos_token_ids=eos, chat=chat)
      per = collections.defaultdict(lambda: [0, 0])
      for r in report.results:
        template = next(t for t in tasks if t.task_id == r.task_id).metadata["template"]
        per[template][0] += r.c
        per[template][1] += r.n
      summary[m] = {"passed": passed, "samples": total,
                    "per_template": {k: f"{c}/{n}" for k, (c, n) in per.items()}}
      print(f"{i}: {m}: {passed}/{total} "
            + " ".join(f"{k} {c}/{n}" for k, (c, n) in per.items()), flush=True)
  with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
