"""Params-only checkpoints: round trip, sharded restore onto a mesh, bad input.

Arrays are written and read back bit for bit, so comparisons are exact.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np
import pytest

from moe import build
from moe import checkpoint
from moe import params
from moe import sharding
from moe.config import ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, router_type="sigmoid", max_seq_len=32)


def test_round_trip_flat_and_model(tmp_path):
  model = build.create(CFG, seed=3)
  path = str(tmp_path / "ckpt")
  checkpoint.save_params(model, path)
  cfg, flat = checkpoint.load_params_flat(path)
  assert cfg == CFG
  want = params.flatten(model)
  assert set(flat) == set(want)
  assert "layers/0/ffn/router/bias" in flat
  for k in want:
    np.testing.assert_array_equal(flat[k], want[k])
  loaded = checkpoint.load_model(path)
  assert loaded.config == CFG
  for k, v in params.flatten(loaded).items():
    np.testing.assert_array_equal(v, want[k])


def test_restore_sharded_on_a_mesh(tmp_path):
  model = build.create(CFG, seed=1)
  path = str(tmp_path / "ckpt")
  checkpoint.save_params(model, path)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  loaded = checkpoint.load_model(path, mesh=mesh)
  experts = loaded.layers[0].ffn.experts.gate.get_value()
  assert experts.sharding.mesh.shape["expert"] == 4
  assert experts.sharding.spec[0] == "expert"
  for k, v in params.flatten(loaded).items():
    np.testing.assert_array_equal(v, params.flatten(model)[k])


def test_unknown_config_field_rejected():
  with pytest.raises(ValueError, match="unknown fields"):
    checkpoint.config_from_json(dict(checkpoint.config_to_json(CFG), bogus=1))


def test_missing_checkpoint_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match="no model checkpoint at .*nope: no such directory"):
    checkpoint.load_model(str(tmp_path / "nope"))
  # A directory that is not a model checkpoint (here: only the params item) says what it lacks.
  (tmp_path / "half" / checkpoint.PARAMS_ITEM).mkdir(parents=True)
  for load in (checkpoint.load_model, checkpoint.load_params_flat, checkpoint.load_config):
    with pytest.raises(FileNotFoundError, match=r"half is not a model checkpoint: .*model_config"):
      load(str(tmp_path / "half"))


def test_nest_unnest_inverse():
  flat = {"a/b": 1, "a/c/d": 2, "e": 3}
  assert checkpoint.unnest(checkpoint.nest(flat)) == flat


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
