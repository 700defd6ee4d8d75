"""Model presets, run-type files and the experiment loader: what parses, and what fails clearly.

Real sizes are checked with eval_shape only. Every bad configuration the loader promises to catch
(unknown names, %gin.REQUIRED left unset, unused bindings, impossible meshes, negative staleness,
dataclass checks) has a test that asserts a ConfigError naming what to fix.
"""

import dataclasses
import os
import sys

import pytest

from experiment.config import ExperimentConfig, PretrainConfig, RLConfig
from moe import build
from moe.config import ModelConfig
from rl.train_state import OptimizerConfig
from tools import configs

PRESETS = sorted(f for f in os.listdir(configs.MODEL_SIZES_DIR) if f.endswith(".gin"))
RUNS = "tools/configs/runs"
TINY = "moe/configs/tiny.gin"
DEFAULT = "tools/configs/experiments/default.gin"
# The values every required field of the pretrain/rl/eval run files needs.
REQUIRED = ["PretrainConfig.steps = 5", "PretrainConfig.learning_rate = 1e-3",
            "RLConfig.steps = 3", "OptimizerConfig.learning_rate = 1e-4",
            "PipelineConfig.max_staleness = 1", "EvalConfig.samples = 4",
            "EvalConfig.max_tokens = 8"]
ALL_RUNS = [TINY] + [f"{RUNS}/{r}.gin" for r in ("pretrain", "rl", "eval")]


# Real sizes take seconds to tens of seconds to build even abstractly; each is built once, by the
# plan experiment that includes it (tools/experiments_test.py checks their published counts).
SMALL_PRESETS = ("tiny.gin", "small.gin")


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_parses_and_validates(preset):
  configs.parse([f"moe/configs/{preset}"])
  cfg = configs.model_config()
  assert cfg.num_experts_per_tok <= cfg.num_experts
  if preset in SMALL_PRESETS:
    assert build.param_count(build.abstract(cfg)) > 0
  else:
    plans = [f for f in configs.experiment_files() if configs.is_plan_experiment(f)
             and f"include 'moe/configs/{preset}'" in open(f).read()]
    assert plans, f"{preset}: no *_plan.gin experiment builds it (add one, or list it as small)"


def test_small_preset_size():
  configs.parse(["moe/configs/small.gin"])
  cfg = configs.model_config()
  assert build.param_count(build.abstract(cfg)) == 20_148_224
  assert build.active_param_count(cfg) == 3_633_152


def test_bad_model_configs_fail_clearly():
  with pytest.raises(configs.ConfigError, match="not found"):
    configs.parse(["moe/configs/nope.gin"])
  with pytest.raises(configs.ConfigError):
    configs.parse([], ["ModelConfig.no_such_field = 3"])
  configs.parse([], ["ModelConfig.num_heads = 3", "ModelConfig.num_kv_heads = 2"])
  with pytest.raises(configs.ConfigError, match="multiple of num_kv_heads"):
    configs.model_config()


# --- load_experiment ---------------------------------------------------------------------------


def test_all_run_files_compose_into_an_experiment():
  cfg = configs.load_experiment(ALL_RUNS, REQUIRED, num_devices=1)
  assert type(cfg) is ExperimentConfig and type(cfg.model) is ModelConfig
  assert (cfg.pretrain.steps, cfg.rl.steps, cfg.rl.pipeline.max_staleness) == (5, 3, 1)
  assert (cfg.eval.samples, cfg.eval.max_tokens) == (4, 8)
  assert cfg.model.hidden_size == 128  # from tiny.gin


def test_rl_run_file_builds_the_rl_learner_defaults():
  """runs/rl.gin constructs the nested learner config (gin cannot bind inside a default
  instance), so its values must be RLConfig's Python default, experiment.config.RL_LEARNER,
  apart from the required learning rate: an experiment built in Python trains like one from gin."""
  cfg = configs.load_experiment(ALL_RUNS, REQUIRED, num_devices=1)
  assert cfg.rl.learner == dataclasses.replace(
      RLConfig().learner, optimizer=OptimizerConfig(learning_rate=1e-4))
  nested = configs.load_experiment(ALL_RUNS, REQUIRED + [
      "PolicyLossConfig.clip_eps_high = 0.28", "LossConfig.replay = 'proximal'",
      "OptimizerConfig.warmup_steps = 5"], num_devices=1).rl.learner
  assert (nested.loss.policy.clip_eps_high, nested.loss.replay,
          nested.optimizer.warmup_steps) == (0.28, "proximal", 5)


def test_ray_grading_add_on_sends_the_grades_to_a_ray_fleet():
  """runs/ray_grading.gin, given after an experiment, switches only the grader (and its fleet)."""
  base = configs.load_experiment([DEFAULT], num_devices=1)
  cfg = configs.load_experiment([DEFAULT, f"{RUNS}/ray_grading.gin"],
                                ["PipelineConfig.ray_address = '10.0.0.1:6379'"], num_devices=1)
  p = cfg.rl.pipeline
  assert (base.rl.pipeline.grader, p.grader) == ("local", "ray")
  assert (p.grader_hosts, p.grader_pool, p.ray_address) == (2, 2, "10.0.0.1:6379")
  assert dataclasses.replace(p, grader="local", ray_address="") == base.rl.pipeline
  with pytest.raises(configs.ConfigError, match="grader must be one of"):
    configs.load_experiment([DEFAULT], ["PipelineConfig.grader = 'cluster'"], num_devices=1)


def test_default_experiment_values_and_command_line_overrides():
  cfg = configs.load_experiment([DEFAULT], num_devices=1)
  assert (cfg.pretrain.steps, cfg.pretrain.batch_rows, cfg.pretrain.seq_len) == (150, 32, 128)
  assert (cfg.tokenizer, cfg.bpe_vocab_size) == ("bpe", 2048)  # the main job's real tokenizer
  assert (cfg.pretrain.learning_rate, cfg.pretrain.corpus_repeats) == (3e-3, 1)
  p = cfg.rl.pipeline
  assert (cfg.rl.steps, cfg.rl.learner.optimizer.learning_rate) == (100, 1e-4)
  assert (p.max_staleness, p.prompts_per_step, p.attempts, p.max_new_tokens, p.seq_len,
          p.batch_rows) == (2, 8, 8, 40, 256, 32)
  assert (cfg.eval.samples, cfg.eval.temperature, cfg.eval.max_tokens) == (8, 1.0, 48)
  # The main entry point passes `--gin.X=V` as "X=V" (no spaces).
  over = configs.load_experiment([DEFAULT], ["RLConfig.steps=150", "PipelineConfig.attempts=4"],
                                 num_devices=1)
  assert (over.rl.steps, over.rl.pipeline.attempts) == (150, 4)


def test_phases_without_a_run_file_are_skipped():
  cfg = configs.load_experiment([TINY, f"{RUNS}/rl.gin"], REQUIRED[2:5], num_devices=1)
  assert cfg.pretrain.steps == 0 and cfg.rl.steps == 3
  cfg = configs.load_experiment([TINY, f"{RUNS}/pretrain.gin"], REQUIRED[:2], num_devices=1)
  assert cfg.rl.steps == 0 and cfg.pretrain.steps == 5


def test_unknown_configurable_or_parameter():
  with pytest.raises(configs.ConfigError, match="(?s)No configurable matching 'RlConfig'.*"
                     "registered by tools/configs.py: ModelConfig.*RLConfig"):
    configs.load_experiment([DEFAULT], ["RlConfig.steps = 3"], num_devices=1)
  with pytest.raises(configs.ConfigError, match="'PipelineConfig' doesn't have a parameter "
                     "named 'staleness'"):
    configs.load_experiment([DEFAULT], ["PipelineConfig.staleness = 3"], num_devices=1)


@pytest.mark.parametrize("missing", range(len(REQUIRED)))
def test_required_value_left_unset(missing):
  name = REQUIRED[missing].split(" = ")[0]
  bindings = REQUIRED[:missing] + REQUIRED[missing + 1:]
  with pytest.raises(configs.ConfigError, match=rf"(?s){name} set to `%gin.REQUIRED` but not "
                     "subsequently overridden.*command line"):
    configs.load_experiment(ALL_RUNS, bindings, num_devices=1)


def test_missing_model():
  with pytest.raises(configs.ConfigError, match="no model size: include a model size file"):
    configs.load_experiment([f"{RUNS}/eval.gin"], REQUIRED[5:], num_devices=1)
  with pytest.raises(configs.ConfigError, match="ExperimentConfig.model is not bound"):
    configs.load_experiment([TINY], num_devices=1)


def test_bindings_nothing_uses():
  # RL settings without runs/rl.gin would be silently dropped; say which binding is missing.
  with pytest.raises(configs.ConfigError, match=r"nothing uses: PipelineConfig.max_staleness, "
                     r"RLConfig.steps; .*ExperimentConfig.rl = @RLConfig\(\)"):
    rl_only = ["RLConfig.steps = 3", "PipelineConfig.max_staleness = 1"]
    configs.load_experiment([TINY, f"{RUNS}/eval.gin"], REQUIRED[5:] + rl_only, num_devices=1)


def test_mesh_must_fit_the_learner_share_of_devices():
  with pytest.raises(configs.ConfigError, match="the learner gets 5 of 8"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (8, 1, 1, 1)"],
                            num_devices=8)
  cfg = configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (4, 1, 1, 1)"],
                                num_devices=8)
  assert cfg.inference_fraction == pytest.approx(1 / 3)


def test_negative_staleness():
  with pytest.raises(configs.ConfigError, match="max_staleness must be >= 0, got -1"):
    configs.load_experiment([DEFAULT], ["PipelineConfig.max_staleness = -1"], num_devices=1)


def test_dataclass_checks_become_config_errors():
  with pytest.raises(configs.ConfigError, match=r"every k in \(1, 16\) must lie in \[1, samples\]"):
    configs.load_experiment([DEFAULT], ["EvalConfig.k_list = (1, 16)"], num_devices=1)
  with pytest.raises(configs.ConfigError, match="exceeds the model's max_seq_len"):
    configs.load_experiment([DEFAULT], ["ModelConfig.max_seq_len = 64"], num_devices=1)
  with pytest.raises(configs.ConfigError, match="PretrainConfig: need steps >= 0"):
    configs.load_experiment([DEFAULT], ["PretrainConfig.steps = -1"], num_devices=1)


def test_impossible_meshes():
  with pytest.raises(configs.ConfigError, match=r"(?s)needs 4 devices but 1 is available.*"
                     "device_count=4"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (1, 1, 4, 1)"],
                            num_devices=1)
  with pytest.raises(configs.ConfigError, match=r"expert axis \(3\) must divide num_experts \(8\)"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (1, 1, 3, 1)"],
                            num_devices=8)
  with pytest.raises(configs.ConfigError, match=r"tensor axis \(8\) must divide num_heads \(4\)"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (1, 1, 1, 8)"],
                            num_devices=8)
  with pytest.raises(configs.ConfigError, match=r"PretrainConfig.batch_rows \(30\) must be a "
                     r"multiple of data x fsdp \(2 x 2 = 4\)"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (2, 2, 1, 1)",
                                        "PretrainConfig.batch_rows = 30"], num_devices=4)
  with pytest.raises(configs.ConfigError, match="four positive sizes"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (1, 1)"], num_devices=1)
  # A mesh the learner's share of the devices and the model take passes (12 devices: 4 serve
  # inference, 8 train); the device count defaults to jax's.
  cfg = configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (2, 2, 2, 1)"],
                                num_devices=12)
  assert cfg.mesh_shape == (2, 2, 2, 1)
  with pytest.raises(configs.ConfigError, match="needs 8 devices"):
    configs.load_experiment([DEFAULT], ["ExperimentConfig.mesh_shape = (2, 2, 2, 1)"])


def test_plan_experiments_are_refused_by_the_main_job():
  path = "tools/configs/experiments/qwen3_30b_a3b_plan.gin"
  with pytest.raises(configs.ConfigError, match=f"plan-only .*`bazel run //tools:plan -- "
                     f"--gin_file={path}"):
    configs.load_experiment([path], num_devices=1024)
  assert configs.load_experiment([path], check_devices=False).mesh_shape == (2, 8, 16, 1)


def test_validate_mesh_directly():
  model = ModelConfig(num_experts=8, num_heads=4, num_kv_heads=2)
  configs.validate_mesh(model, (1, 2, 4, 2), num_devices=16)
  configs.validate_mesh(model, (64, 1, 8, 4), num_devices=None)  # planned: no device check
  with pytest.raises(configs.ConfigError, match="4 positive integers"):
    configs.validate_mesh(model, (1, 0, 1, 1))
  with pytest.raises(configs.ConfigError, match="needs 32 devices but 16 are"):
    configs.validate_mesh(model, (2, 2, 4, 2), num_devices=16)
  # Only the batches of phases that run must split over data x fsdp.
  skip_pretrain = PretrainConfig(steps=0, batch_rows=3)
  configs.validate_experiment(
      ExperimentConfig(model=model, pretrain=skip_pretrain, mesh_shape=(2, 1, 1, 1)), 3)
  with pytest.raises(configs.ConfigError, match=r"PipelineConfig.batch_rows \(64\)"):
    configs.validate_experiment(
        ExperimentConfig(model=model, pretrain=skip_pretrain, mesh_shape=(1, 3, 1, 1)), 3)


def test_serve_run_file_configures_the_engine():
  configs.parse([TINY, f"{RUNS}/serve.gin"], ["EngineConfig.max_slots = 8"])
  ec = configs.GinEngineConfig()
  assert (ec.max_slots, ec.decode_steps, ec.dtype, ec.max_len) == (8, 16, "float32", None)
  assert configs.model_config().hidden_size == 128


def test_run_files_state_what_must_be_set():
  for name in ("pretrain", "rl", "eval", "serve"):
    text = open(os.path.join(configs.RUNS_DIR, f"{name}.gin")).read()
    assert text.startswith("# Run type: ") and "Must set" in text and "Commonly overridden" in text
    for line in text.splitlines():
      if "%gin.REQUIRED" in line and not line.startswith("#"):
        assert line.split(" = ")[0] in text.split("Commonly overridden")[0], line


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
