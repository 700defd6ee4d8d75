"""Loading straight onto a device mesh, and exporting a sharded model.

Run alone (as Bazel does) this file has 8 CPU devices; inside a larger pytest process that
imported jax first it may see fewer, and then uses the largest mesh that fits.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np
import pytest

from moe import hf
from moe import params
from moe import sharding
from moe.hf import testutil as tu


def test_sharded_load_matches_single_device(tmp_path):
  n = len(jax.devices())
  shape = (1, 2, 2, 2) if n >= 8 else (1, 1, 2, 1) if n >= 2 else (1, 1, 1, 1)
  mesh = sharding.make_mesh(shape)
  tu.save(tu.make_model(tu.mixtral_config()), tmp_path / "hf", max_shard_size="60KB")
  plain = hf.load_pretrained(tmp_path / "hf")
  sharded = hf.load_pretrained(tmp_path / "hf", mesh=mesh)

  gate = sharded.layers[0].ffn.experts.gate.get_value()
  assert isinstance(gate.sharding, jax.sharding.NamedSharding) and gate.sharding.mesh == mesh
  if n >= 2:
    assert gate.sharding.spec[0] == "expert"
    assert len({s.device for s in gate.addressable_shards}) == int(np.prod(shape))
  a, b = params.flatten(plain), params.flatten(sharded)
  for name in a:
    assert np.array_equal(a[name], b[name]), name

  # Exporting the sharded model writes the same bytes as exporting the single-device one.
  hf.save_pretrained(plain, tmp_path / "plain")
  hf.save_pretrained(sharded, tmp_path / "sharded")
  assert ((tmp_path / "plain" / "model.safetensors").read_bytes()
          == (tmp_path / "sharded" / "model.safetensors").read_bytes())


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
