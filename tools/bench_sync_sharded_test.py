"""Sharded publishing from a learner on a 2x4 mesh of 8 CPU devices (#20): the manifest lists
every block of every tensor, a sampler rebuilds each version bit for bit from them, and nothing
the publisher encodes or snapshots is a gathered tensor; and the benchmark program runs."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from moe import params as params_lib  # noqa: E402
from moe.config import ModelConfig  # noqa: E402
from sync import publisher as publisher_lib  # noqa: E402
from sync import sharded  # noqa: E402
from sync import store as store_lib  # noqa: E402
from sync import weights  # noqa: E402
from tools import bench_sync_sharded  # noqa: E402
from tools import train_deltas  # noqa: E402

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, max_seq_len=32)
MESH = (1, 2, 4, 1)  # fsdp 2 x expert 4


def _device_boxes(learner) -> dict:
  """name -> the distinct blocks (boxes) its sharding gives the 8 devices."""
  out = {}
  for name, arr in params_lib.flatten(learner.model(), to_numpy=False).items():
    boxes = {tuple(sl.indices(d)[:2] for sl, d in zip(idx, arr.shape))
             for idx in arr.sharding.devices_indices_map(arr.shape).values()}
    out[name] = sorted(boxes)
  return out


def test_the_learners_blocks_are_published_and_rebuilt_bit_for_bit(tmp_path, monkeypatch):
  assert jax.device_count() == 8
  encoded = []  # (name, shape) of every array the shard streams encode or snapshot
  real_encode, real_save = publisher_lib.delta.encode_to, publisher_lib.snapshot.save

  def encode_spy(sink, base, new, **kw):
    encoded.extend((k, np.asarray(v).shape, np.asarray(v).nbytes) for k, v in new.items())
    return real_encode(sink, base, new, **kw)

  def save_spy(store, version, flat):
    encoded.extend((k, np.asarray(v).shape, np.asarray(v).nbytes) for k, v in flat.items())
    return real_save(store, version, flat)

  monkeypatch.setattr(publisher_lib.delta, "encode_to", encode_spy)
  monkeypatch.setattr(publisher_lib.snapshot, "save", save_spy)
  learner = bench_sync_sharded.build_learner(MODEL, MESH, learning_rate=1e-3)
  boxes = _device_boxes(learner)
  assert max(len(b) for b in boxes.values()) == 8  # the experts: 4 expert x 2 fsdp blocks
  st = store_lib.Store(str(tmp_path))
  pub = sharded.ShardedPublisher(st)
  got = {}
  sub = sharded.ShardedSubscriber(st, lambda flat, v: got.update(flat=flat, version=v))
  for step in range(3):
    if step:
      learner.train_step(train_deltas.random_batch(MODEL.vocab_size, 4, 16, step))
    encoded.clear()
    blocks, version = learner.sampler_shards()
    rep = pub.publish(blocks)
    m = rep.manifest
    assert m.version == version == step
    # Every block of every tensor is listed, once, with its own stream.
    listed = {}
    for r in m.shards:
      listed.setdefault(r.name, []).append(r.box)
    assert listed == boxes
    assert len({r.prefix for r in m.shards}) == len(m.shards) > len(m.tensors)
    # The sampler's weights are the learner's, bit for bit, in the sampler's dtype.
    assert sub.poll().version == version == got["version"]
    reference, _ = learner.sampler_weights()
    assert got["flat"].keys() == reference.keys()
    for name, want in reference.items():
      assert got["flat"][name].dtype == want.dtype == np.dtype("bfloat16"), name
      np.testing.assert_array_equal(weights.words(got["flat"][name]), weights.words(want),
                                    err_msg=name)
    # Nothing encoded or snapshotted is a gathered tensor: every array is one block.
    assert {(n, s) for n, s, _ in encoded} == {(r.name, r.shape) for r in m.shards}
    assert max(b for _, _, b in encoded) == rep.largest_block
    for name, want in reference.items():
      if len(boxes[name]) > 1:
        assert all(s != want.shape for n, s, _ in encoded if n == name), name
    assert rep.largest_block < max(a.nbytes for a in reference.values())
    assert (rep.delta_bytes is None) == (step == 0)


def test_benchmark_command_line(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert bench_sync_sharded.main(["--steps", "1", "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [r["version"] for r in rows] == [0, 1] and all(r["bit_exact"] for r in rows)
  steady = rows[1]
  # The sharded path never holds a gathered tensor; the gathered one holds the whole model.
  assert steady["sharded"]["largest_encoded"] < steady["gathered"]["largest_encoded"]
  assert steady["gathered"]["peak"] > result["model"]["bytes"] > steady["sharded"]["peak"]
  text = capsys.readouterr().out
  assert "| 1 | sharded (" in text and "| 1 | gathered |" in text


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
