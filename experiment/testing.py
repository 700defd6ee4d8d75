"""Checks that a finished run directory shows a run that trained (test-only helper).

The end-to-end tests call `assert_trained(run_dir, cfg)` on what `experiment.run.run` left behind:
metrics.jsonl (one record per pre-training and RL step), summary.json (the RL totals) and the
pre-trained and final models. A run whose every sampling request was refused writes all of these
files with the right number of records, so the checks read the figures in them (see rl.testing).

`even_code_tasks` is a task set for those runs that gives RL a reward to learn from. The built-in
suite's tasks need working code, which a tiny model pre-trained for a few steps never writes:
every reward is 0, every GRPO advantage 0, and the RL steps have no gradient. The hidden tests of
these tasks instead check a property of the completion's text that a near-random byte-level
model has about half the time, so attempts at one prompt get different rewards and the policy
gradient is non-zero. `assert_learned_from_rewards` checks that it was.
"""

from __future__ import annotations

import collections
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from envs.tasks import task_format
from experiment.config import ExperimentConfig
from moe import checkpoint as moe_checkpoint
from rl import objectives
from rl import testing as rl_testing
from rl import trajectory_io
from rl.episodes import Episode


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


def advantage_logprob_gain(run_dir: str) -> float:
  """How much RL raised the log-probability of above-average attempts over below-average ones.

  J(model) = sum over the RL phase's episodes (run_dir/rl/trajectories) of A_e * log p(the
  episode's generated tokens), A_e its GRPO advantage within its group (rl.objectives, over the
  group's graded attempts) and the log-probability computed with the episode's recorded routing,
  as the learner does. The policy gradient ascends J (its loss is -J per trained token, the
  ratio's value aside), so J(final_model) - J(pretrained_model) > 0 shows that RL moved the
  weights towards the rewarded attempts. Weights moved by anything else (the router loss, a
  sign error, a step on the wrong batch) move J either way or not at all.
  """
  tdir = os.path.join(run_dir, "rl", "trajectories")
  groups: dict = collections.OrderedDict()
  for name in trajectory_io.list_shards(tdir):
    for rec in trajectory_io.read_shard(os.path.join(tdir, name)):
      ep = Episode.from_record(rec)
      if not ep.infra_failure:
        groups.setdefault(ep.group_id, []).append(ep)
  scored = []
  for members in groups.values():
    adv = objectives.group_advantages(np.array([ep.reward for ep in members]))
    scored += [(ep, float(a)) for ep, a in zip(members, adv) if a != 0]

  def objective(path: str) -> float:
    model = moe_checkpoint.load_model(path)
    total = 0.0
    for ep, a in scored:
      tokens = jnp.asarray(ep.tokens[None])
      routing = None if ep.routing is None else jnp.asarray(ep.routing[:, None])
      logits = model(tokens, routing=routing).logits
      logp = objectives.token_logprobs(logits[:, :-1], tokens[:, 1:])[0]
      total += a * float(jnp.sum(logp * jnp.asarray(ep.loss_mask[1:])))
    return total

  return (objective(os.path.join(run_dir, "final_model")) -
          objective(os.path.join(run_dir, "pretrained_model")))


def learning_problems(run_dir: str, cfg: ExperimentConfig) -> list[str]:
  """What in run_dir shows that RL did not learn from its rewards (empty if nothing).

  The run must have the policy gradient as its only loss (cfg.rl.learner.loss: aux_loss off,
  kl_coef 0), so that whatever moved the weights came from the rewards. Every RL step record
  must show rewards that differ within its groups (reward_std > 0), groups with a non-zero advantage
  (signal_groups > 0), a loss that is the policy-gradient term alone (loss == pg_loss) and a
  non-zero, finite gradient. The loss's value is no test here: with the ratio at 1 (on-policy)
  and advantages that sum to 0 in each group it is 0 up to rounding, while its gradient is not.
  Finally the update must have raised `advantage_logprob_gain`.
  """
  out = []
  loss = cfg.rl.learner.loss
  if loss.aux_loss or loss.policy.kl_coef:
    out.append(f"aux_loss={loss.aux_loss}, kl_coef={loss.policy.kl_coef}: the policy gradient is "
               "not the only loss, so a weight change does not show learning from rewards")
  for i, r in enumerate(read_metrics(run_dir).get("rl", [])):
    where = f"rl step {i + 1}"
    if not r.get("reward_std", 0) > 0:
      out.append(f"{where}: reward_std {r.get('reward_std')} (every group's attempts got one "
                 "reward: no advantage)")
    if not r.get("signal_groups", 0) > 0:
      out.append(f"{where}: {r.get('signal_groups')} groups with a non-zero advantage")
    grad_norm = float(r.get("grad_norm", math.nan))
    if not (math.isfinite(grad_norm) and grad_norm > 0):
      out.append(f"{where}: grad_norm {grad_norm} (must be finite and > 0)")
    if r.get("loss") != r.get("pg_loss"):
      out.append(f"{where}: loss {r.get('loss')} is not the policy-gradient term "
                 f"pg_loss {r.get('pg_loss')} alone")
  if cfg.rl.steps:
    gain = advantage_logprob_gain(run_dir)
    if not gain > 0:
      out.append(f"RL changed the advantage-weighted log-probability of its attempts by {gain} "
                 "(must rise)")
  return out


def assert_learned_from_rewards(run_dir: str, cfg: ExperimentConfig) -> None:
  """Raises AssertionError naming every sign that RL in run_dir did not learn from rewards."""
  found = learning_problems(run_dir, cfg)
  if found:
    raise AssertionError(f"RL in {run_dir} did not learn from rewards:\n  " + "\n  ".join(found))


# Characters of the body each hidden test of `even_code_tasks` checks (one test per character).
EVEN_CODE_CHARS = 4

_EVEN_CODE_TEST = """\
PROMPT = {prompt!r}


def _char(i):
    with open("solution.py", encoding="utf-8") as f:
        body = f.read()[len(PROMPT):]
    assert len(body) > i, f"the body has {{len(body)}} characters"
    return body[i]
"""

_EVEN_CODE_CASE = """

def test_char_{i}():
    assert ord(_char({i})) % 2 == 0
"""


def even_code_tasks(n_train: int = 6, n_test: int = 3) -> list[task_format.Task]:
  """Single-turn tasks whose reward is the share of the body's first characters of even code.

  Task i asks for a function body whose first EVEN_CODE_CHARS characters have even code points (four
  spaces of indentation do, so `solution` is ordinary Python). The hidden test file has one test per
  character and grading is "fraction", so the reward takes five values and a group of attempts by a
  near-random model rarely gets one value for all. Built through the task format's validation
  (envs.tasks.task_format.from_dict) and graded like every task: the hidden tests run in a sandbox
  on the final solution.py. The first n_train tasks are split "train", the next n_test "test" (held
  out).
  """
  out = []
  for i in range(n_train + n_test):
    name = f"even_{i}"
    desc = f"begin the body with {EVEN_CODE_CHARS} characters of even code"
    prompt = f"# {EVEN_CODE_CHARS} even chars\ndef {name}():\n"  # short: episodes fit 64 tokens
    test = _EVEN_CODE_TEST.format(prompt=prompt) + "".join(
        _EVEN_CODE_CASE.format(i=c) for c in range(EVEN_CODE_CHARS))
    out.append(task_format.from_dict({
        "task_id": f"even-code-{i}", "instructions": f"Write {name}: {desc}.",
        "files": {"solution.py": prompt + "    raise NotImplementedError\n"},
        "hidden_tests": {"test_hidden.py": test}, "hidden_test_ids": ["test_hidden.py"],
        "grading": "fraction", "split": "train" if i < n_train else "test",
        "suite": "even_code", "prompt": prompt, "entry_point": name,
        "solution": "    return 0\n",
        "limits": {"timeout_s": 5.0, "memory_mb": 256, "max_turns": 1, "max_tokens": 64}}))
  return out
