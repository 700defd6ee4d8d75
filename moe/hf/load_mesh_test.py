"""Loading straight onto a device mesh, and exporting a sharded model.

The flag below gives this file 8 CPU devices when it runs in its own process (as Bazel runs it);
a process that imported jax before it could see fewer, and then the test fails rather than check
a smaller mesh.
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
  assert len(jax.devices()) >= 8, (
      f"needs 8 devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}), has {jax.devices()}: run "
      "this file in its own process")
  shape = (1, 2, 2, 2)
  mesh = sharding.make_mesh(shape)
  tu.save(tu.make_model(tu.mixtral_config()), tmp_path / "hf", max_shard_size="60KB")
  plain = hf.load_pretrained(tmp_path / "hf")
  sharded = hf.load_pretrained(tmp_path / "hf", mesh=mesh)

  gate = sharded.layers[0].ffn.experts.gate.get_value()
  assert isinstance(gate.sharding, jax.sharding.NamedSharding) and gate.sharding.mesh == mesh
  assert gate.sharding.spec[0] == "expert"
  assert len({s.device for s in gate.addressable_shards}) == 8
  # Each device holds a part of the experts, not a replica of all of them.
  assert gate.addressable_shards[0].data.shape[0] == gate.shape[0] // mesh.shape["expert"]
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
