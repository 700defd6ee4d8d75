"""Export: import -> export -> import is bit-exact, and transformers loads what we write.

Tolerance policy: files and weights are compared bit for bit. The one float comparison, our
forward against transformers' on a model we created and exported, allows LOGIT_ATOL = 2e-5: ten
times the largest gap observed here (1.7e-6 over token seeds 0-2, logits of magnitude 2.6-3.0; the
two sides differ only in summation order), as in parity_test.py.
"""

import json
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open

from moe import build
from moe import hf
from moe import params
from moe.config import ModelConfig
from moe.hf import testutil as tu

OBSERVED_LOGIT_GAP = 1.7e-6  # max |logit gap| of the created model (seeds 0-2: 1.4e-6 .. 1.7e-6)
LOGIT_ATOL = 2e-5  # 10x the observed gap, rounded up


def _file_tensors(path):
  """{name: array} over every shard of a checkpoint directory (test-sized checkpoints only)."""
  out = {}
  for f in sorted(path.glob("*.safetensors")):
    with safe_open(str(f), "flax") as h:
      for k in h.keys():
        assert k not in out, k
        out[k] = np.asarray(h.get_tensor(k))
  return out


@pytest.mark.parametrize("config", [
    tu.mixtral_config,
    tu.qwen3_config,
    lambda: tu.qwen3_config(tie_word_embeddings=True, norm_topk_prob=True),
])
def test_import_export_import_is_bit_exact(tmp_path, config):
  ref = tu.make_model(config())
  tu.save(ref, tmp_path / "hf")
  model = hf.load_pretrained(tmp_path / "hf")
  model = nnx.merge(*nnx.split(model))  # the architecture survives split/merge (e.g. after jit)
  written = hf.save_pretrained(model, tmp_path / "ours", max_shard_size="50KB")
  assert (tmp_path / "ours" / "model.safetensors.index.json").exists() and len(written) > 4

  again = hf.load_pretrained(tmp_path / "ours")
  assert again.config == model.config and again.hf_architecture == model.hf_architecture
  a, b = params.flatten(model), params.flatten(again)
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name

  # The files hold exactly the tensors transformers wrote (classic per-expert layout).
  theirs, ours = _file_tensors(tmp_path / "hf"), _file_tensors(tmp_path / "ours")
  assert theirs.keys() == ours.keys()
  for name in theirs:
    assert theirs[name].dtype == ours[name].dtype and np.array_equal(theirs[name], ours[name]), name

  # transformers loads the export and computes exactly what the original computed.
  toks = tu.tokens()
  want, want_topk = tu.forward(ref, toks)
  got, got_topk = tu.forward(tu.load(tmp_path / "ours"), toks)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_topk, want_topk)


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
  tu.save(tu.make_model(tu.qwen3_config(), dtype=torch.bfloat16), tmp_path / "hf")
  model = hf.load_pretrained(tmp_path / "hf")
  hf.save_pretrained(model, tmp_path / "ours")
  assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "bfloat16"
  theirs, ours = _file_tensors(tmp_path / "hf"), _file_tensors(tmp_path / "ours")
  assert theirs.keys() == ours.keys()
  for name in theirs:
    assert ours[name].dtype.name == "bfloat16"
    assert np.array_equal(theirs[name].view(np.uint16), ours[name].view(np.uint16)), name


@pytest.fixture(scope="module")
def created():
  """A model made by build.create (no Hugging Face origin), Mixtral-shaped."""
  cfg = hf.config_from_hf({**tu.mixtral_config().to_dict(),
                           "architectures": ["MixtralForCausalLM"]})
  return build.create(cfg, seed=3)


def test_created_model_exports_and_transformers_agrees(tmp_path, created):
  model = created
  with pytest.raises(hf.CheckpointError, match="architecture"):
    hf.save_pretrained(model, tmp_path / "x")
  hf.save_pretrained(model, tmp_path / "out", architecture="MixtralForCausalLM")
  assert (hf.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
          == model.config)
  ref = tu.load(tmp_path / "out")
  assert type(ref).__name__ == "MixtralForCausalLM"
  toks = tu.tokens(seed=2)
  want, want_topk = tu.forward(ref, toks)
  out = model(toks)
  np.testing.assert_allclose(np.asarray(out.logits), want, rtol=0, atol=LOGIT_ATOL)
  np.testing.assert_array_equal(np.sort(np.asarray(out.routing), axis=-1), want_topk)
  again = params.flatten(hf.load_pretrained(tmp_path / "out"))
  for name, value in params.flatten(model).items():
    assert np.array_equal(value, again[name]), name


def test_export_cast_and_single_file(tmp_path, created):
  written = hf.save_pretrained(created, tmp_path, architecture="MixtralForCausalLM",
                               dtype="bfloat16")
  assert [p.rsplit("/", 1)[-1] for p in written] == ["model.safetensors", "config.json"]
  loaded = params.flatten(hf.load_pretrained(tmp_path))
  for name, value in params.flatten(created).items():
    assert loaded[name].dtype.name == "bfloat16"
    np.testing.assert_array_equal(loaded[name], value.astype(loaded[name].dtype))


def test_resave_removes_stale_shards(tmp_path, created):
  hf.save_pretrained(created, tmp_path, architecture="MixtralForCausalLM",
                     max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  hf.save_pretrained(created, tmp_path, architecture="MixtralForCausalLM")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
  hf.load_pretrained(tmp_path)


def test_load_and_save_hold_one_parameter_at_a_time(tmp_path):
  """Host memory beyond the finished model stays within a few parameters, never a second model.

  tracemalloc sees numpy's host buffers. On the CPU a device array may alias the buffer it was
  made from, so load is measured as peak minus what is still held at the end (the model itself).
  """
  # Parameters of ~2 MB, so the interpreter's own small allocations during a load (a few hundred
  # KB, varying from run to run) stay small against the bound.
  tu.save(tu.make_model(tu.qwen3_config(num_experts=16, num_hidden_layers=4, hidden_size=128,
                                        intermediate_size=256, moe_intermediate_size=256)),
          tmp_path / "hf")
  model = hf.load_pretrained(tmp_path / "hf")
  flat = params.flatten(model)
  total, largest = sum(v.nbytes for v in flat.values()), max(v.nbytes for v in flat.values())
  del flat, model
  assert 3 * largest < total / 2  # the bounds below are far from "the whole model"
  tracemalloc.start()
  try:
    model = hf.load_pretrained(tmp_path / "hf")
    held, peak = tracemalloc.get_traced_memory()
    assert peak - held < 3 * largest, (peak, held, largest, total)
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    hf.save_pretrained(model, tmp_path / "ours")
    assert tracemalloc.get_traced_memory()[1] - base < 3 * largest
  finally:
    tracemalloc.stop()


def test_unexportable_configs_raise(tmp_path):
  for cfg, arch, msg in [
      (ModelConfig(router_type="sigmoid"), "MixtralForCausalLM", "router_type"),
      (ModelConfig(num_shared_experts=1), "Qwen3MoeForCausalLM", "shared experts"),
      (ModelConfig(first_k_dense=1), "MixtralForCausalLM", "dense layers"),
      (ModelConfig(qk_norm=False), "Qwen3MoeForCausalLM", "qk_norm"),
      (ModelConfig(), "LlamaForCausalLM", "unknown architecture"),
  ]:
    with pytest.raises(hf.CheckpointError, match=msg):
      hf.save_pretrained(build.abstract(cfg), tmp_path, architecture=arch)
  assert not any(tmp_path.iterdir())  # refused before writing anything


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
