"""experiment.testing.assert_trained passes a run directory that shows training and fails one
that does not: the records of a run whose every request was refused, or unchanged weights."""

import json
import os
import sys

import pytest

from experiment import testing
from experiment.config import ExperimentConfig, PretrainConfig, RLConfig
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.config import ModelConfig
from pipeline.config import PipelineConfig

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
  recs = [{"phase": "pretrain", "step": i + 1, "loss": 5.1, "tokens": 120.0,
           "policy_version": float(i + 1)} for i in range(2)]
  recs += [{"phase": "eval", "step": 0, "pass1": 0.0}]
  recs += [{"phase": "rl", "step": i + 1, "loss": 0.02 if rl_episodes else 0.0,
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
  assert "rl step 1: 0.0 trained_episodes" in msg and "rl step 2: loss 0.0" in msg
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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
