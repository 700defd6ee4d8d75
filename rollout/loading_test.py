"""Loading served weights from project checkpoints, Hugging Face checkpoints and configs."""

import sys

import numpy as np
import pytest

from moe import checkpoint
from moe import hf
from moe import params as moe_params
from rollout import loading
from rollout import testing


def _same(a, b):
  assert set(a) == set(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def test_project_and_hf_checkpoints_load_and_are_detected(tmp_path):
  model = testing.tiny_model(seed=4)
  flat = moe_params.flatten(model)
  proj, hfd = str(tmp_path / "proj"), str(tmp_path / "hf")
  checkpoint.save_params(model, proj)
  hf.save_pretrained(model, hfd, architecture="MixtralForCausalLM")
  assert loading.is_hf_checkpoint(hfd) and not loading.is_hf_checkpoint(proj)
  _same(moe_params.flatten(loading.load_model(checkpoint=proj)), flat)
  served = loading.load_model(hf_checkpoint=hfd, max_seq_len=32)
  assert served.config.max_seq_len == 32
  _same(moe_params.flatten(served), flat)
  _same(loading.load_flat(proj, model.config), flat)
  _same(loading.load_flat(hfd, model.config), flat)


def test_bad_sources_raise_value_error(tmp_path):
  with pytest.raises(ValueError, match="exactly one"):
    loading.load_model()
  with pytest.raises(ValueError, match="exactly one"):
    loading.load_model(hf_checkpoint=str(tmp_path), config=testing.tiny_config())
  with pytest.raises(ValueError, match="not a directory"):
    loading.load_model(hf_checkpoint=str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="does not exist"):
    loading.load_flat(str(tmp_path / "missing"), testing.tiny_config())
  with pytest.raises(ValueError, match="cannot read project checkpoint"):
    loading.load_flat(str(tmp_path), testing.tiny_config())


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
