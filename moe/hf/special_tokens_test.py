"""Export with the tokenizer: transformers loads the tokenizer, chat template, generation config
and model we write; `eos_token_ids` reads a checkpoint's EOS ids.

Tolerance policy: as roundtrip_test.py, import -> export is bit-exact, so transformers' logits of
the export must equal the original's exactly (no float tolerance).
"""

import json
import sys

import numpy as np
import pytest
import transformers

from moe import hf
from moe import tokenizer as tokenizer_lib
from moe.hf import special_tokens
from moe.hf import testutil as tu

TEXTS = ("def add(a, b):\n    return a + b\n", "naïve café ∑ 🙂 never seen",
         "<|im_start|>user\nfix the bug<|im_end|>\n<|endoftext|>", "")
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "<think>\nlook\n</think>\n\ndone"}]


def _export(tmp_path, **kw):
  src = tu.save_with_tokenizer(tmp_path / "hf")
  model = hf.load_pretrained(src)
  tok = tokenizer_lib.for_model(src, model.config.vocab_size)
  out = str(tmp_path / "ours")
  written = hf.save_pretrained(model, out, tokenizer=tok, **kw)
  return src, out, tok, written


def test_transformers_loads_the_exported_tokenizer_template_generation_config_and_model(tmp_path):
  ref = tu.bpe_tokenizer()
  im_end, eot = ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id
  src, out, tok, written = _export(tmp_path, eos_token_ids=(im_end, eot))
  assert {p.rsplit("/", 1)[-1] for p in written} >= {
      "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
      "config.json", "model.safetensors"}

  theirs = transformers.AutoTokenizer.from_pretrained(src)
  ours = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS:
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False) == tok.encode(text), text
    assert ours.encode(text) == theirs.encode(text), text  # no BOS / post-processor added
  assert (ours.bos_token, ours.eos_token, ours.pad_token) == (None, "<|endoftext|>",
                                                              "<|endoftext|>")
  assert (ours.eos_token_id, ours.pad_token_id) == (eot, eot)
  for kw in ({}, {"enable_thinking": False}):
    want = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kw)
    got = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kw)
    assert got == want and "<think>" in want and got.endswith("<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if kw else "")), kw
  assert ours.chat_template == tu.QWEN3_STYLE_TEMPLATE

  gen = json.loads(open(f"{out}/generation_config.json").read())
  assert gen == {"eos_token_id": [im_end, eot], "pad_token_id": eot}
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [im_end, eot]
  config = json.loads(open(f"{out}/config.json").read())
  assert config["eos_token_id"] == [im_end, eot] and config["pad_token_id"] == eot
  assert config["bos_token_id"] is None

  toks = tu.tokens(length=12) % tok.vocab_size
  want, want_topk = tu.forward(tu.load(src), toks)
  exported = tu.load(out)
  assert exported.generation_config.eos_token_id == [im_end, eot]
  got, got_topk = tu.forward(exported, toks)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_topk, want_topk)

  # Our own loader reads the export back: same tokenizer, template and EOS ids.
  again = tokenizer_lib.for_model(out, config["vocab_size"])
  assert type(again) is tokenizer_lib.JsonTokenizer
  assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
  assert again.chat_template.render(CHAT) == tok.chat_template.render(CHAT)
  assert hf.eos_token_ids(out) == (im_end, eot)
  assert hf.eos_token_ids(src) == (eot,)  # transformers' own generation_config.json


def test_a_loaded_checkpoint_keeps_its_eos_list_on_re_export(tmp_path):
  """A chat checkpoint's generation_config.json lists <|im_end|> and <|endoftext|>;
  load_pretrained remembers the list, so an export without eos_token_ids (with the checkpoint's
  own tokenizer or none) writes it again, and our loader and transformers read it back."""
  ref = tu.bpe_tokenizer()
  im_end, eot = ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id
  src = tu.save_with_tokenizer(tmp_path / "hf")
  transformers.GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot).save_pretrained(src)
  model = hf.load_pretrained(src)
  assert model.hf_eos_token_ids == (im_end, eot)
  tok = tokenizer_lib.for_model(src, model.config.vocab_size)
  assert tok.eos_id == eot  # tokenizer_config.json names one of the two
  for name, kw in (("with_tokenizer", {"tokenizer": tok}), ("weights_only", {})):
    out = str(tmp_path / name)
    hf.save_pretrained(model, out, **kw)
    assert hf.eos_token_ids(out) == (im_end, eot), name
    assert json.loads(open(f"{out}/config.json").read())["eos_token_id"] == [im_end, eot]
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [im_end, eot]
    again = hf.load_pretrained(out)  # and once more: the list survives any number of trips
    hf.save_pretrained(again, str(tmp_path / f"{name}_again"))
    assert hf.eos_token_ids(str(tmp_path / f"{name}_again")) == (im_end, eot), name
  # An explicit list still wins.
  hf.save_pretrained(model, str(tmp_path / "explicit"), tokenizer=tok, eos_token_ids=(eot,))
  assert hf.eos_token_ids(str(tmp_path / "explicit")) == (eot,)


def test_load_config_is_the_loaded_models_config_without_reading_weights(tmp_path):
  src = tu.save_with_tokenizer(tmp_path / "hf")
  for kw in ({}, {"dtype": "bfloat16", "config_overrides": {"max_seq_len": 64}}):
    assert hf.load_config(src, **kw) == hf.load_pretrained(src, **kw).config, kw
  assert hf.load_config(src, config_overrides={"max_seq_len": 64}).max_seq_len == 64
  with pytest.raises(hf.CheckpointError, match="not a checkpoint directory"):
    hf.load_config(str(tmp_path / "missing"))


def test_default_eos_is_the_tokenizers_and_a_stale_chat_template_is_removed(tmp_path):
  """The project's BPE (no tokenizer_config.json, no template) exports its <pad>/<bos>/<eos>."""
  model = hf.load_pretrained(tu.save_with_tokenizer(tmp_path / "hf"))
  bpe = tokenizer_lib.BPETokenizer.train(tu.TOKENIZER_TEXTS, 300)
  out = tmp_path / "ours"
  out.mkdir()
  (out / "chat_template.jinja").write_text("{{ 'stale' }}")
  hf.save_pretrained(model, out, tokenizer=bpe)
  assert not (out / "chat_template.jinja").exists()
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen == {"bos_token_id": bpe.bos_id, "eos_token_id": bpe.eos_id,
                 "pad_token_id": bpe.pad_id}
  ours = transformers.AutoTokenizer.from_pretrained(str(out))
  assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
  assert ours.chat_template is None
  for text in TEXTS:
    assert ours.encode(text, add_special_tokens=False) == bpe.encode(text), text
  assert hf.eos_token_ids(str(out)) == (bpe.eos_id,)


def test_a_byte_tokenizer_or_bad_eos_is_refused_before_anything_is_written(tmp_path):
  model = hf.load_pretrained(tu.save_with_tokenizer(tmp_path / "hf"))
  with pytest.raises(hf.CheckpointError, match="ByteTokenizer cannot be exported"):
    hf.save_pretrained(model, tmp_path / "bytes", tokenizer=tokenizer_lib.ByteTokenizer())
  with pytest.raises(hf.CheckpointError, match="outside the model's vocabulary"):
    hf.save_pretrained(model, tmp_path / "eos", eos_token_ids=(model.config.vocab_size,))
  assert not (tmp_path / "bytes").exists() and not (tmp_path / "eos").exists()


def test_eos_token_ids_prefers_generation_config_then_config(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
  assert hf.eos_token_ids(str(tmp_path)) == (5,)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 7]}))
  assert hf.eos_token_ids(str(tmp_path)) == (7, 5)
  (tmp_path / "generation_config.json").write_text(json.dumps({"pad_token_id": 1}))
  assert hf.eos_token_ids(str(tmp_path)) == (5,)
  (tmp_path / "config.json").write_text(json.dumps({}))
  assert hf.eos_token_ids(str(tmp_path)) == ()
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
  with pytest.raises(hf.CheckpointError, match="eos_token_id must be"):
    hf.eos_token_ids(str(tmp_path))
  assert special_tokens.token_ids(None, (3, 3)) == {"bos_token_id": None, "eos_token_id": 3,
                                                    "pad_token_id": None}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
