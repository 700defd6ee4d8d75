"""experiment.testing.assert_trained passes a run directory that shows training and fails one
that does not: the records of a run whose every request was refused, or unchanged weights.
assert_learned_from_rewards fails a run whose records show no reward signal or no policy
gradient; even_code_tasks are graded by their hidden tests in a real sandbox."""

import json
import os
import sys

import numpy as np
import pytest

from envs import reward
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from experiment import testing
from experiment.config import ExperimentConfig, PretrainConfig, RLConfig
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.config import ModelConfig
from pipeline import episodes as episodes_lib
from pipeline import local
from pipeline.config import PipelineConfig
from rl.learner import LearnerConfig
from rl.train_step import LossConfig
from rl.trajectory_io import TrajectoryWriter
from rollout.engine import Completion

TINY = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=2, max_seq_len=128)
CFG = ExperimentConfig(model=TINY, pretrain=PretrainConfig(steps=2),
                       rl=RLConfig(steps=2, pipeline=PipelineConfig(prompts_per_step=2,
                                                                    attempts=2)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """Two checkpoints of different weights (standing for before and after RL)."""
  d = tmp_path_factory.mktemp("models")
  for seed in (0, 1):
    moe_checkpoint.save_params(build.create(TINY, seed=seed), str(d / f"seed{seed}"))
  return d


def _run_dir(path, models, *, rl_episodes=4, final_seed=1, summary_episodes=None):
  """A run directory as experiment.run writes it, with the RL steps' episode counts given."""
  os.makedirs(path)
  recs = [{"phase": "pretrain", "step": i + 1, "loss": 5.1, "grad_norm": 2.0, "tokens": 120.0,
           "policy_version": float(i + 1)} for i in range(2)]
  recs += [{"phase": "eval", "step": 0, "pass1": 0.0}]
  recs += [{"phase": "rl", "step": i + 1, "loss": 0.02 if rl_episodes else 0.0,
            "grad_norm": 0.3 if rl_episodes else 0.0,
            "tokens": 30.0 * rl_episodes, "trained_episodes": float(rl_episodes),
            "policy_version": float(i + 1)} for i in range(2)]
  with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
  total = 2 * rl_episodes if summary_episodes is None else summary_episodes
  with open(path / "summary.json", "w", encoding="utf-8") as f:
    json.dump({"rl": {"steps": 2, "groups": 4, "trained_episodes": total,
                      "infra_failures": 0, "policy_version": 2}}, f)
  os.symlink(models / "seed0", path / "pretrained_model")
  os.symlink(models / f"seed{final_seed}", path / "final_model")
  return str(path)


def test_a_run_that_trained_passes(tmp_path, models):
  testing.assert_trained(_run_dir(tmp_path / "run", models), CFG)


def test_a_run_that_trained_on_nothing_fails(tmp_path, models):
  # Every request refused: every step and file is there, no episode was trained.
  run_dir = _run_dir(tmp_path / "run", models, rl_episodes=0)
  with pytest.raises(AssertionError, match="did not train") as e:
    testing.assert_trained(run_dir, CFG)
  msg = str(e.value)
  assert "rl step 1: 0.0 trained_episodes" in msg and "rl step 2: grad_norm 0.0" in msg
  assert "'trained_episodes': 0" in msg  # the summary's totals too


def test_missing_episodes_unchanged_weights_and_disagreeing_totals_fail(tmp_path, models):
  short = _run_dir(tmp_path / "short", models, rl_episodes=3)
  assert any("3.0 trained_episodes, 4 expected" in p for p in testing.problems(short, CFG))
  same = _run_dir(tmp_path / "same", models, final_seed=0)
  assert testing.problems(same, CFG) == [
      "final_model vs pretrained_model: none of the "
      f"{len(moe_checkpoint.load_params_flat(str(models / 'seed0'))[1])} weight arrays changed"]
  lying = _run_dir(tmp_path / "lying", models, summary_episodes=9)
  assert any("summary.json says 9 episodes trained, metrics.jsonl 8" in p
             for p in testing.problems(lying, CFG))


def test_even_code_tasks_reward_the_share_of_even_leading_characters():
  tasks = testing.even_code_tasks(n_train=4, n_test=2)
  assert [t.split for t in tasks] == ["train"] * 4 + ["test"] * 2
  assert len({t.task_id for t in tasks}) == 6 and all(t.grading == "fraction" for t in tasks)
  # One prompt and 8 generated tokens fit the end-to-end test's 64-token rows.
  local.check_capacity(tasks, PipelineConfig(prompts_per_step=2, attempts=4, max_new_tokens=8,
                                             seq_len=64, batch_rows=8))
  task = tasks[0]
  with pool_lib.WarmPool(size=2) as pool:
    def graded(completion):
      files = dict(task.files, **{"solution.py": single_turn.solution_file(task, completion)})
      g = reward.grade(task, files, pool=pool)
      assert g.status == reward.OK and len(g.outcomes) == testing.EVEN_CODE_CHARS, g.detail
      return g.reward
    assert graded(task.solution) == 1.0  # four spaces (code 32)
    assert graded("\t\t\t\treturn 1\n") == 0.0  # tabs (code 9)
    assert graded("  \t return 0\n") == 0.75
    assert graded("b\xff") == 0.25  # 'b' (98) even, U+00FF odd, then too short: fail
    assert graded("") == 0.0


def _learning_run_dir(path, models, *, final_seed=1, rewards=((1.0, 0.0), (0.0, 1.0)),
                      record=None):
  """A run directory whose RL trajectories hold one group per entry of `rewards`."""
  run_dir = _run_dir(path, models, final_seed=final_seed)
  w = TrajectoryWriter(os.path.join(run_dir, "rl", "trajectories"), "c", records_per_shard=2)
  for g, group in enumerate(rewards):
    eps = []
    for j, r in enumerate(group):
      gen = [10 + j, 20 + g, 30]
      comp = Completion(token_ids=gen, logprobs=[-1.0] * 3, routing=np.ones((1, 3, 2), np.uint8),
                        policy_versions=[0] * 3, finish_reason="stop",
                        prompt_routing=np.zeros((1, 2, 2), np.uint8))
      eps.append(episodes_lib.from_completion(
          group_id=f"g{g}", episode_id=f"g{g}-{j}", group_size=len(group), prompt_ids=[1, 2, 3],
          completion=comp, reward=r))
    w.write_all(eps)
    w.flush()
  w.close()
  recs = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  for r in recs:
    if r["phase"] == "rl":
      r.update(reward=0.5, reward_std=0.5, signal_groups=2.0, grad_norm=0.7, pg_loss=r["loss"])
      r.update(record or {})
  with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
  return run_dir


def test_the_advantage_weighted_logprob_gain_follows_the_advantages(tmp_path, models):
  same = _learning_run_dir(tmp_path / "same", models, final_seed=0)
  assert testing.advantage_logprob_gain(same) == 0.0
  gain = testing.advantage_logprob_gain(_learning_run_dir(tmp_path / "a", models))
  assert gain != 0.0
  # Advantages are relative to the group: opposite rewards flip the gain, a group whose
  # attempts all got one reward adds nothing to it.
  flipped = _learning_run_dir(tmp_path / "b", models, rewards=((0.0, 1.0), (1.0, 0.0)))
  assert testing.advantage_logprob_gain(flipped) == pytest.approx(-gain, rel=1e-5)
  padded = _learning_run_dir(tmp_path / "c", models,
                             rewards=((1.0, 0.0), (0.0, 1.0), (0.5, 0.5)))
  assert testing.advantage_logprob_gain(padded) == pytest.approx(gain, rel=1e-5)


def test_learning_problems_name_what_shows_no_learning(tmp_path, models):
  run_dir = _learning_run_dir(tmp_path / "good", models)
  gain = testing.advantage_logprob_gain(run_dir)
  # Seed 1's weights against seed 0's: the gain has some sign; the check follows it.
  assert (testing.learning_problems(run_dir, CFG) == []) == (gain > 0)
  flat = _learning_run_dir(tmp_path / "flat", models, final_seed=0, rewards=((1.0, 1.0),),
                           record={"reward_std": 0.0, "signal_groups": 0.0, "grad_norm": 0.0})
  aux = ExperimentConfig(model=TINY, pretrain=CFG.pretrain,
                         rl=RLConfig(steps=2, pipeline=CFG.rl.pipeline, learner=LearnerConfig(
                             loss=LossConfig(objective="policy", aux_loss=True))))
  found = testing.learning_problems(flat, aux)
  assert found[0].startswith("aux_loss=True, kl_coef=0.0: the policy gradient is not the only")
  for step in (1, 2):
    assert f"rl step {step}: reward_std 0.0 (every group's attempts got one reward" in "\n".join(
        found)
    assert f"rl step {step}: 0.0 groups with a non-zero advantage" in found
    assert f"rl step {step}: grad_norm 0.0 (must be finite and > 0)" in found
  assert found[-1] == ("RL changed the advantage-weighted log-probability of its attempts by 0.0 "
                       "(must rise)")
  mixed = _learning_run_dir(tmp_path / "mixed", models, record={"pg_loss": 0.01})
  assert "rl step 1: loss 0.02 is not the policy-gradient term pg_loss 0.01 alone" in (
      testing.learning_problems(mixed, CFG))
  with pytest.raises(AssertionError, match="did not learn from rewards"):
    testing.assert_learned_from_rewards(flat, CFG)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
