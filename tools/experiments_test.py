"""The all-experiments smoke test: every file under tools/configs/experiments/ parses and builds.

Files are globbed, so a new experiment is covered without editing this test (paxml style).
Runnable experiments are loaded as written, then again with a tiny model swapped in, which is
created and run forward on a few tokens. Plan experiments (`*_plan.gin`) are planned from shapes
only (tools.plan) and their counts checked against the published sizes. Every experiment also
rejects bad overrides with a ConfigError before any work.

Real-size abstract models are built once per module (the 61-layer DeepSeek-V3-like model takes
~25 s on a loaded 2-core machine); everything else is cheap.
"""

import math
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from moe import build
from moe import sharding
from tools import configs
from tools import plan as plan_lib

EXPERIMENTS = configs.experiment_files()
RUNNABLE = [f for f in EXPERIMENTS if not configs.is_plan_experiment(f)]
PLANS = [f for f in EXPERIMENTS if configs.is_plan_experiment(f)]
GIB = 1024 ** 3

# Published sizes (params, active params) in billions, by plan file; abs tolerance 0.1B because
# the published figures are rounded to 0.1B.
PUBLISHED = {
    "mixtral_8x7b_plan.gin": (46.7, 12.9),
    "qwen3_30b_a3b_plan.gin": (30.5, 3.3),
}


def _name(path):
  return os.path.basename(path)


def tiny_model_bindings(mesh_shape):
  """Bindings that swap in a tiny model that still divides over the experiment's mesh."""
  axes = dict(zip(sharding.MESH_AXES, mesh_shape))
  heads = max(2, axes["tensor"])
  return [
      "ModelConfig.hidden_size = 32", "ModelConfig.num_layers = 2",
      f"ModelConfig.num_heads = {heads}", f"ModelConfig.num_kv_heads = {heads}",
      "ModelConfig.head_dim = 16", "ModelConfig.intermediate_size = 64",
      "ModelConfig.moe_intermediate_size = 32",
      f"ModelConfig.num_experts = {max(4, 2 * axes['expert'])}",
      "ModelConfig.num_experts_per_tok = 2", "ModelConfig.num_shared_experts = 0",
      "ModelConfig.first_k_dense = 0", "ModelConfig.param_dtype = 'float32'",
      "ModelConfig.dtype = 'float32'",
  ]


def test_there_are_experiments_of_both_kinds():
  assert {"default.gin", "larger.gin"} <= {_name(f) for f in RUNNABLE}
  assert {"mixtral_8x7b_plan.gin", "qwen3_30b_a3b_plan.gin",
          "deepseek_v3_like_plan.gin"} <= {_name(f) for f in PLANS}


# Experiments that start from a checkpoint the user brings: run by //tools:train with the flag
# that names it; they need not pre-train.
FROM_CHECKPOINT = {"hf_rl.gin": "//tools:train -- --hf_checkpoint=DIR"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=_name)
def test_first_comment_is_the_command_that_runs_it(path):
  first = open(path).readline().strip()
  target = "//tools:plan --" if configs.is_plan_experiment(path) else FROM_CHECKPOINT.get(
      _name(path), "//tools:main --")
  assert first == f"# bazel run {target} --gin_file=tools/configs/experiments/{_name(path)}"


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_runnable_experiment_builds_a_tiny_version(path):
  # The device count of this machine is checked by configs_test; an experiment written for a
  # multi-device mesh still has to divide its model and batches over it.
  cfg = configs.load_experiment([path], check_devices=False)
  assert cfg.rl.steps > 0, "every experiment runs RL"
  assert cfg.pretrain.steps > 0 or _name(path) in FROM_CHECKPOINT, "the main job pre-trains"
  assert build.param_count(build.abstract(cfg.model)) > 0
  tiny = configs.load_experiment([path], tiny_model_bindings(cfg.mesh_shape),
                                 check_devices=False)
  assert (tiny.pretrain, tiny.rl, tiny.eval, tiny.mesh_shape) == (
      cfg.pretrain, cfg.rl, cfg.eval, cfg.mesh_shape)
  assert tiny.model.vocab_size == cfg.model.vocab_size and tiny.model.hidden_size == 32
  model = build.create(tiny.model, seed=tiny.seed)
  tokens = jnp.asarray(np.arange(12).reshape(2, 6) % tiny.model.vocab_size, jnp.int32)
  out = model(tokens)
  assert out.logits.shape == (2, 6, tiny.model.vocab_size)
  assert np.isfinite(np.asarray(out.logits)).all()


@pytest.fixture(scope="module")
def planned():
  """path -> (ExperimentConfig, plan), each real-size model built (abstractly) once."""
  cache = {}

  def get(path):
    if path not in cache:
      cfg = configs.load_experiment([path], check_devices=False)
      cache[path] = (cfg, plan_lib.plan(cfg))
    return cache[path]
  return get


@pytest.mark.parametrize("path", PLANS, ids=_name)
def test_plan_experiment_is_sane(path, planned):
  cfg, p = planned(path)
  m = cfg.model
  assert p["devices"] == math.prod(cfg.mesh_shape) > 1
  assert p["mesh"] == dict(zip(sharding.MESH_AXES, cfg.mesh_shape))
  # Routed experts found from the `exp` axis match the config's arithmetic.
  assert p["routed_expert_params"] == (
      m.num_moe_layers * m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size)
  assert 0 < p["active_params"] < p["params"]
  # Sharding never loses a parameter, and this mesh shards the bulk of them.
  assert p["params"] / p["devices"] <= p["params_per_device"] < p["params"] / 4
  assert p["adam_bytes_per_device"] == 8 * p["params_per_device"]  # fp32 m and v
  assert p["master_bytes_per_device"] == 4 * p["params_per_device"]  # bf16 weights
  assert p["train_bytes_per_device"] == (p["weight_bytes_per_device"]
                                         + p["master_bytes_per_device"]
                                         + p["adam_bytes_per_device"])
  # The plan meshes are chosen so the training state fits 80 GiB devices with room to spare.
  assert p["train_bytes_per_device"] < 40 * GIB
  if _name(path) in PUBLISHED:
    total, active = PUBLISHED[_name(path)]
    assert p["params"] / 1e9 == pytest.approx(total, abs=0.1)
    assert p["active_params"] / 1e9 == pytest.approx(active, abs=0.1)


def test_deepseek_plan_size(planned):
  _, p = planned(os.path.join(configs.EXPERIMENTS_DIR, "deepseek_v3_like_plan.gin"))
  # 256 routed experts x 58 MoE layers x 3 x 7168 x 2048 dominate: ~654B routed parameters;
  # attention is GQA rather than MLA, so the total differs a little from DeepSeek-V3's 671B.
  assert 6.4e11 < p["params"] < 7.2e11
  assert p["routed_expert_params"] == 256 * 58 * 3 * 7168 * 2048
  # Per token: 8 of 256 routed experts, the shared expert, attention and embeddings.
  assert 3.0e10 < p["active_params"] < 4.5e10


def test_plan_agrees_with_moe_resource_plan():
  cfg = configs.load_experiment([os.path.join(configs.EXPERIMENTS_DIR, "default.gin")],
                                ["ExperimentConfig.mesh_shape = (1, 2, 2, 1)"],
                                check_devices=False)
  model = build.abstract(cfg.model)
  p = plan_lib.plan(cfg, model)
  ref = build.resource_plan(cfg.model, plan_lib.abstract_mesh(cfg.mesh_shape))
  assert p["params"] == ref["params"]
  assert p["active_params"] == ref["active_params"]  # leaf-based vs formula-based
  assert p["weight_bytes_per_device"] == ref["param_bytes_per_device"]
  assert p["master_bytes_per_device"] == 0  # float32 weights are their own master copy
  assert p["tokens_per_step"] == cfg.rl.pipeline.batch_rows * cfg.rl.pipeline.seq_len


def test_plan_command_line(capsys):
  default = "tools/configs/experiments/default.gin"
  assert plan_lib.main([f"--gin_file={default}", "--device_memory_gib=0.001",
                        "--gin.ExperimentConfig.mesh_shape=(1, 1, 2, 1)"]) == 0
  out = capsys.readouterr().out
  assert f"config valid: {default}" in out
  assert "data=1 x fsdp=1 x expert=2 x tensor=1 (2 devices)" in out
  assert "does not fit" in out
  assert plan_lib.main([f"--gin_file={default}", "--gin.PipelineConfig.max_staleness=-1"]) == 2
  assert "max_staleness must be >= 0" in capsys.readouterr().err


BAD_OVERRIDES = [
    (["NoSuchConfig.x = 1"], "No configurable matching 'NoSuchConfig'"),
    (["PipelineConfig.max_staleness = -1"], "max_staleness must be >= 0"),
    (["ExperimentConfig.mesh_shape = (1, 1, 3, 1)"], r"expert axis \(3\) must divide"),
    (["EvalConfig.k_list = (1, 1000)"], "must lie in"),
]


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_runnable_experiment_needs_the_devices_of_its_mesh(path):
  with pytest.raises(configs.ConfigError, match="needs 4 devices but 1 is available"):
    configs.load_experiment([path], ["ExperimentConfig.mesh_shape = (2, 1, 2, 1)"],
                            num_devices=1)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=_name)
@pytest.mark.parametrize("bindings,message", BAD_OVERRIDES, ids=lambda x: str(x)[:24])
def test_bad_overrides_fail_before_any_work(path, bindings, message):
  plan_only = configs.is_plan_experiment(path)
  with pytest.raises(configs.ConfigError, match=message):
    configs.load_experiment([path], bindings, num_devices=None if plan_only else 1,
                            check_devices=not plan_only)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
