"""Every model preset parses and validates; real sizes are checked with eval_shape only."""

import os
import sys

import pytest

from moe import build, sharding
from tools import configs

PRESETS = sorted(f for f in os.listdir(os.path.join(configs.REPO_ROOT, "moe/configs"))
                 if f.endswith(".gin"))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_parses_and_builds_abstractly(preset):
  configs.parse([f"moe/configs/{preset}"])
  cfg = configs.model_config()
  model = build.abstract(cfg)
  assert build.param_count(model) > 0


def test_real_sizes_match_published_counts():
  # Published totals: Mixtral-8x7B 46.7B (12.9B active); Qwen3-30B-A3B 30.5B (3.3B active).
  configs.parse(["moe/configs/mixtral_8x7b.gin"])
  mixtral = configs.model_config()
  assert build.param_count(build.abstract(mixtral)) / 1e9 == pytest.approx(46.7, abs=0.1)
  assert build.active_param_count(mixtral) / 1e9 == pytest.approx(12.9, abs=0.1)
  configs.parse(["moe/configs/qwen3_30b_a3b.gin"])
  qwen = configs.model_config()
  assert build.param_count(build.abstract(qwen)) / 1e9 == pytest.approx(30.5, abs=0.1)
  assert build.active_param_count(qwen) / 1e9 == pytest.approx(3.3, abs=0.1)


def test_resource_plan_without_devices():
  configs.parse(["moe/configs/deepseek_v3_like.gin"])
  cfg = configs.model_config()
  mesh = sharding.make_mesh((1, 1, 1, 1))
  plan = build.resource_plan(cfg, mesh)
  # 256 routed experts x 58 MoE layers x 3 x 7168 x 2048 dominate: ~654B routed parameters.
  assert 6.4e11 < plan["params"] < 7.2e11
  assert plan["param_bytes"] == 2 * plan["params"]  # bf16


def test_bad_configs_fail_clearly():
  with pytest.raises(configs.ConfigError, match="not found"):
    configs.parse(["moe/configs/nope.gin"])
  with pytest.raises(configs.ConfigError):
    configs.parse([], ["ModelConfig.no_such_field = 3"])
  configs.parse([], ["ModelConfig.num_heads = 3", "ModelConfig.num_kv_heads = 2"])
  with pytest.raises(configs.ConfigError, match="multiple of num_kv_heads"):
    configs.model_config()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
