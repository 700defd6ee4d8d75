"""Loading served weights from project checkpoints, Hugging Face checkpoints and configs."""

import json
import sys

import numpy as np
import pytest

from moe import checkpoint
from moe import hf
from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from rollout import loading
from rollout import testing
from rollout.engine import EngineConfig


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


def test_the_served_tokenizer_is_the_checkpoints_own_never_bytes_by_default(tmp_path):
  """A model whose vocabulary is not bytes is served with the tokenizer.json beside its weights
  (Hugging Face or project checkpoint alike), and without one it does not start."""
  model = testing.tiny_model(seed=4, vocab_size=300)
  hfd, proj = str(tmp_path / "hf"), str(tmp_path / "proj")
  hf.save_pretrained(model, hfd, architecture="MixtralForCausalLM")
  checkpoint.save_params(model, proj)
  ec = EngineConfig(max_slots=2, max_len=32, decode_steps=2, max_queue=2)
  for kw in ({"hf_checkpoint": hfd}, {"checkpoint": proj}):
    with pytest.raises(tokenizer_lib.TokenizerError, match="300 ids is not the byte tokenizer's"):
      loading.load_engine(ec, **kw)
  bpe = tokenizer_lib.BPETokenizer.train(["def add(a, b):\n    return a + b\n"] * 20, 300)
  text = "def add(b, a):"
  for kw in ({"hf_checkpoint": hfd}, {"checkpoint": proj}):
    bpe.save(next(iter(kw.values())))
    engine = loading.load_engine(ec, **kw)
    try:
      assert isinstance(engine.tokenizer, tokenizer_lib.BPETokenizer)
      assert engine.tokenizer.encode(text) == bpe.encode(text) != list(text.encode())
      assert engine.config.eos_token_ids == (bpe.eos_id,)
    finally:
      engine.stop()


def test_generation_stops_at_every_eos_id_of_the_checkpoint(tmp_path):
  """A chat checkpoint's config.json names one EOS id and its generation_config.json two (Qwen3:
  <|endoftext|> and <|im_end|>); the served model, biased to emit the second, must stop there.

  The bias: every embedding gets a large constant in one hidden dimension, so after the final
  norm that dimension is positive at every position whatever the blocks add, and the LM head's
  column for the second id reads it with a large weight: greedy decoding emits that id first.
  """
  model = testing.tiny_model(seed=4)  # 259 ids: bytes; the byte tokenizer's <eos> is 258
  first, second = 258, 200
  flat = moe_params.flatten(model)
  flat["embed"] = flat["embed"].copy()
  flat["embed"][:, 0] = 50.0
  flat["lm_head"] = flat["lm_head"].copy()
  flat["lm_head"][:, second] = 0.0
  flat["lm_head"][0, second] = 10.0
  moe_params.load_flat(model, flat)
  hfd = tmp_path / "hf"
  hf.save_pretrained(model, hfd, architecture="MixtralForCausalLM",
                     eos_token_ids=(first, second))
  config = json.loads((hfd / "config.json").read_text())
  config["eos_token_id"] = first  # config.json names one, as a chat checkpoint's does
  (hfd / "config.json").write_text(json.dumps(config))

  ec = EngineConfig(max_slots=2, max_len=32, decode_steps=4, max_queue=2, deterministic=True)
  prompt = list(b"def f(x):")
  engine = loading.load_engine(ec, hf_checkpoint=str(hfd))
  try:
    assert engine.config.eos_token_ids == (first, second)
    c = engine.generate(prompt, max_tokens=8, temperature=0.0)[0]
    assert c.token_ids == [second] and c.finish_reason == "stop"
    # Without the EOS ids the same model runs on: the bias, not chance, produced the stop.
    c = engine.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert c.token_ids == [second] * 8 and c.finish_reason == "length"
  finally:
    engine.stop()

  # A project checkpoint (a run's final_model) with the same generation_config.json beside it.
  proj = tmp_path / "proj"
  checkpoint.save_params(model, str(proj))
  (proj / "generation_config.json").write_text((hfd / "generation_config.json").read_text())
  engine = loading.load_engine(ec, checkpoint=str(proj))
  try:
    assert engine.config.eos_token_ids == (first, second)
    c = engine.generate(prompt, max_tokens=8, temperature=0.0)[0]
    assert c.token_ids == [second] and c.finish_reason == "stop"
  finally:
    engine.stop()

  (hfd / "generation_config.json").unlink()  # no generation config: config.json's one id
  engine = loading.load_engine(ec, hf_checkpoint=str(hfd))
  try:
    assert engine.config.eos_token_ids == (first,)
    c = engine.generate(prompt, max_tokens=5, temperature=0.0)[0]
    assert c.token_ids == [second] * 5 and c.finish_reason == "length"
  finally:
    engine.stop()


def test_a_model_without_a_directory_is_bytes_or_token_ids_only():
  assert loading.load_tokenizer(None, 259) == tokenizer_lib.ByteTokenizer()
  assert loading.load_tokenizer(None, 300) is None  # a random-init preset: token-id prompts


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
