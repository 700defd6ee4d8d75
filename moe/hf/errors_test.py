"""Bad checkpoints fail with a CheckpointError naming the file and tensor, before any data is read.

Every case starts from a valid multi-shard Mixtral or Qwen3-MoE checkpoint written by transformers
and breaks one thing. `reads` counts tensor reads: validation must refuse the checkpoint with none.
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from moe import hf
from moe.hf import testutil as tu
from moe.hf.safetensors_io import Checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt")
  tu.save(tu.make_model(tu.mixtral_config()), root / "mixtral", max_shard_size="60KB")
  tu.save(tu.make_model(tu.qwen3_config()), root / "qwen3")
  return root


@pytest.fixture
def reads(monkeypatch):
  count = [0]
  real = Checkpoint.read

  def counting(self, *a, **kw):
    count[0] += 1
    return real(self, *a, **kw)

  monkeypatch.setattr(Checkpoint, "read", counting)
  return count


def _copy(pristine, tmp_path, which="mixtral"):
  dst = tmp_path / which
  shutil.copytree(pristine / which, dst)
  return dst


def _shard_of(ckpt, name):
  index = ckpt / "model.safetensors.index.json"
  if index.exists():
    return ckpt / json.loads(index.read_text())["weight_map"][name]
  return ckpt / "model.safetensors"


def _rewrite(path, edit):
  """Rewrites one safetensors file with edit({name: array}) applied (fp32 test checkpoints)."""
  with safe_open(str(path), "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})


def _expect(ckpt, reads, *patterns):
  with pytest.raises(hf.CheckpointError) as err:
    hf.load_pretrained(ckpt)
  for p in patterns:
    assert p in str(err.value), (p, str(err.value))
  assert reads[0] == 0, "tensor data was read before the checkpoint was refused"
  return str(err.value)


LAST = "model.norm.weight"  # in the last shard: a late problem must still be found first
EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"


def test_valid_checkpoint_loads(pristine, reads):
  hf.load_pretrained(pristine / "mixtral")
  assert reads[0] > 0


def test_unknown_architecture(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path)
  cfg = json.loads((ckpt / "config.json").read_text())
  cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
  (ckpt / "config.json").write_text(json.dumps(cfg))
  _expect(ckpt, reads, "config.json", "unknown architecture 'LlamaForCausalLM'")


def test_missing_config(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path)
  os.remove(ckpt / "config.json")
  _expect(ckpt, reads, f"{ckpt}/config.json: missing")


def test_missing_checkpoint_files(tmp_path, reads):
  (tmp_path / "config.json").write_text(json.dumps(
      {**tu.mixtral_config().to_dict(), "architectures": ["MixtralForCausalLM"]}))
  _expect(tmp_path, reads, "neither model.safetensors nor model.safetensors.index.json")
  _expect(tmp_path / "nope", reads, "not a checkpoint directory")


@pytest.mark.parametrize("name", [LAST, EXPERT])
def test_missing_tensor(pristine, tmp_path, reads, name):
  ckpt = _copy(pristine, tmp_path)
  shard = _shard_of(ckpt, name)
  _rewrite(shard, lambda t: t.pop(name))
  index = ckpt / "model.safetensors.index.json"
  wm = json.loads(index.read_text())
  del wm["weight_map"][name]
  index.write_text(json.dumps(wm))
  _expect(ckpt, reads, f"tensor {name} is missing")


def test_tensor_missing_from_its_listed_shard(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path)
  shard = _shard_of(ckpt, LAST)
  _rewrite(shard, lambda t: t.pop(LAST))
  _expect(ckpt, reads, f"tensor {LAST} is listed in {shard.name}")


@pytest.mark.parametrize("name,shape", [(LAST, (65,)), (EXPERT, (96, 64))])
def test_misshapen_tensor(pristine, tmp_path, reads, name, shape):
  ckpt = _copy(pristine, tmp_path)
  shard = _shard_of(ckpt, name)
  _rewrite(shard, lambda t: t.update({name: np.zeros(shape, np.float32)}))
  _expect(ckpt, reads, str(shard), f"tensor {name} has shape {list(shape)}",
          f"expected {list(shape[::-1]) if len(shape) == 2 else [64]}")


def test_wrong_dtype(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path)
  shard = _shard_of(ckpt, EXPERT)
  _rewrite(shard, lambda t: t.update({EXPERT: t[EXPERT].astype(np.int32)}))
  _expect(ckpt, reads, str(shard), f"tensor {EXPERT} has dtype I32")


def test_unexpected_tensor(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path, "qwen3")
  name = "model.layers.0.self_attn.q_proj.bias"
  _rewrite(ckpt / "model.safetensors", lambda t: t.update({name: np.zeros(96, np.float32)}))
  _expect(ckpt, reads, str(ckpt / "model.safetensors"), f"unexpected tensor {name}")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "huge_header"])
def test_corrupt_or_unreadable_file(pristine, tmp_path, reads, damage):
  ckpt = _copy(pristine, tmp_path)
  shard = _shard_of(ckpt, LAST)
  data = shard.read_bytes()
  shard.write_bytes({"garbage": b"\x00not a safetensors file" * 10,
                     "truncated": data[:-16],
                     "empty": b"",
                     "huge_header": (1 << 60).to_bytes(8, "little") + data[8:]}[damage])
  _expect(ckpt, reads, str(shard), "unreadable safetensors file")


def test_unreadable_permissions(pristine, tmp_path, reads):
  if os.geteuid() == 0:  # root reads anything: make the shard a directory instead
    ckpt = _copy(pristine, tmp_path, "qwen3")
    os.remove(ckpt / "model.safetensors")
    os.mkdir(ckpt / "model.safetensors")
    _expect(ckpt, reads, "neither model.safetensors")
  else:
    ckpt = _copy(pristine, tmp_path, "qwen3")
    os.chmod(ckpt / "model.safetensors", 0)
    _expect(ckpt, reads, str(ckpt / "model.safetensors"), "unreadable safetensors file")


def test_qwen3_layer_pattern_and_config_mismatch(pristine, tmp_path, reads):
  ckpt = _copy(pristine, tmp_path, "qwen3")
  cfg = json.loads((ckpt / "config.json").read_text())
  (ckpt / "config.json").write_text(json.dumps(dict(cfg, mlp_only_layers=[1])))
  _expect(ckpt, reads, "config.json", "not a prefix")
  # A config that disagrees with the tensors (dense layer 0 read as MoE) names the tensor.
  (ckpt / "config.json").write_text(json.dumps(dict(cfg, mlp_only_layers=[])))
  _expect(ckpt, reads, "model.layers.0.mlp.experts.0.down_proj.weight", "missing")


def test_bad_dtype_argument(pristine, reads):
  with pytest.raises(hf.CheckpointError, match="dtype"):
    hf.load_pretrained(pristine / "qwen3", dtype="int8")
  assert reads[0] == 0


def test_config_overrides(pristine, reads):
  model = hf.load_pretrained(pristine / "qwen3",
                             config_overrides={"expert_impl": "ragged", "max_seq_len": 64})
  assert model.config.expert_impl == "ragged" and model.config.max_seq_len == 64
  reads[0] = 0
  with pytest.raises(hf.CheckpointError, match="no_such_field"):
    hf.load_pretrained(pristine / "qwen3", config_overrides={"no_such_field": 1})
  # An override that changes shapes no longer matches the tensors: named, nothing read.
  with pytest.raises(hf.CheckpointError,
                     match=r"lm_head.weight has shape \[128, 64\], expected \[256, 64\]"):
    hf.load_pretrained(pristine / "qwen3", config_overrides={"vocab_size": 256})
  assert reads[0] == 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
