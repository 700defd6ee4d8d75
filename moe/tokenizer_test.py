import json
import sys

import pytest

from moe import tokenizer
from moe.hf import testutil


def test_round_trip_and_specials():
  tok = tokenizer.ByteTokenizer()
  ids = tok.encode("def f(x):\n  return x + 1  # é", bos=True, eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids) == "def f(x):\n  return x + 1  # é"
  assert tok.decode(ids, skip_special=False).startswith("<bos>def")
  assert tok.vocab_size == 259


def test_bad_ids_raise():
  tok = tokenizer.ByteTokenizer()
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([65, 9999])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([1, -3], skip_special=False)
  with pytest.raises(KeyError):
    tok.special_id("<nope>")


_TAGS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_CORPUS = [
    "<|im_start|>user\nfix add in road.py<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    '{"name":"read_file","arguments":{"path":"road.py"}}\n</tool_call><|im_end|>\n',
    "def add(a, b):\n    return a + b\n", "def mul(a, b):\n    return a * b\n",
] * 20


def test_bpe_compresses_and_round_trips(tmp_path):
  tok = tokenizer.BPETokenizer.train(_CORPUS, 400, extra_tokens=_TAGS)
  assert 256 + 3 + len(_TAGS) < tok.vocab_size <= 400
  text = _CORPUS[0]
  ids = tok.encode(text, bos=True, eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert len(ids) < len(text.encode()) / 3  # merges learned: far fewer ids than bytes
  assert tok.decode(ids) == text  # bos/eos dropped, the template tags kept
  assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
  # Template tags are one id each, wherever they occur, and never merged with neighbours.
  for tag in _TAGS:
    assert tok.encode(tag) == [tok.special_id(tag)]
    assert tok.special_id(tag) in tok.encode("x" + tag + "y")
  unseen = "naïve café ∑ 🙂 \t\r\n"  # anything encodes (byte fallback), exactly
  assert tok.decode(tok.encode(unseen)) == unseen
  tok.save(str(tmp_path))
  again = tokenizer.for_model(str(tmp_path), tok.vocab_size)
  assert isinstance(again, tokenizer.BPETokenizer)
  assert again.encode(text) == tok.encode(text) and again.vocab_size == tok.vocab_size


def test_bpe_prompts_ending_at_a_line_break_tokenize_as_inside_a_document():
  # Single-turn code prompts end at the signature's line break; the model must see there the
  # tokens its training documents had at that point, or it has never seen what follows them.
  ops = [("add", "+"), ("sub", "-"), ("mul", "*"), ("mod", "%")]
  prompts = [f"# return x {name} {k}\ndef {name}_{k}(x):\n" for name, _ in ops for k in range(12)]
  docs = [p + f"    return x {op} {k}\n" for p, (name, op), k in zip(
      prompts, [o for o in ops for _ in range(12)], [k for _ in ops for k in range(12)])]
  tok = tokenizer.BPETokenizer.train(docs * 5, 600)
  for prompt, doc in zip(prompts, docs):
    head = tok.encode(prompt)
    assert tok.encode(doc)[:len(head)] == head, (prompt, tok.encode(doc)[:len(head)], head)
    assert tok.decode(tok.encode(doc)) == doc
  # Digits are single tokens, so a number is copied digit by digit.
  assert tok.encode("1234") == [tok.encode(d)[0] for d in "1234"]


def test_bpe_bad_input():
  with pytest.raises(ValueError, match="vocab_size must be at least"):
    tokenizer.BPETokenizer.train(_CORPUS, 100)
  tok = tokenizer.BPETokenizer.train(_CORPUS, 300)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([1, tok.vocab_size])
  with pytest.raises(FileNotFoundError):
    tokenizer.BPETokenizer.load("/nonexistent/dir")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A checkpoint's tokenizer as transformers 5 saves one (tokenizer.json, tokenizer_config.json,
  chat_template.jinja); the transformers tokenizer is the reference."""
  fast = testutil.bpe_tokenizer()
  d = tmp_path_factory.mktemp("hf_tok")
  fast.save_pretrained(str(d))
  return str(d), fast


def test_a_checkpoints_tokenizer_json_encodes_and_decodes_as_transformers_does(hf_dir):
  d, fast = hf_dir
  tok = tokenizer.for_model(d, len(fast))
  assert type(tok) is tokenizer.JsonTokenizer and tok.vocab_size == len(fast)
  assert tok.eos_id == fast.eos_token_id and tok.pad_id == fast.pad_token_id
  assert tok.bos_id is None  # the checkpoint has none, as Qwen's
  for text in testutil.TOKENIZER_TEXTS[:4] + ("unseen: ü∑ \t", ""):
    assert tok.encode(text) == fast.encode(text, add_special_tokens=False)
  im_start = fast.convert_tokens_to_ids("<|im_start|>")
  ids = [im_start] + fast.encode("def add(a, b):", add_special_tokens=False) + [fast.eos_token_id]
  # Special added tokens are dropped (transformers' skip_special_tokens=True), or kept.
  assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True) == "def add(a, b):"
  assert tok.decode(ids, skip_special=False) == fast.decode(ids)
  with pytest.raises(ValueError, match="no bos token"):
    tok.encode("x", bos=True)
  assert tok.encode("x", eos=True)[-1] == fast.eos_token_id


def test_ids_a_model_has_past_its_tokenizer_decode_to_nothing(hf_dir):
  d, fast = hf_dir
  n = len(fast)
  tok = tokenizer.for_model(d, n + 16)  # an embedding padded past the tokenizer, as Qwen's
  ids = fast.encode("hello", add_special_tokens=False)
  assert tok.decode(ids + [n, n + 15]) == fast.decode(ids + [n, n + 15]) == "hello"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode(ids + [n + 16])
  with pytest.raises(tokenizer.TokenizerError, match=f"has {n} ids, more than the model's {n - 1}"):
    tokenizer.for_model(d, n - 1)


def test_the_projects_tokenizer_json_loads_as_the_projects_bpe(tmp_path):
  bpe = tokenizer.BPETokenizer.train(_CORPUS, 300, extra_tokens=_TAGS)
  bpe.save(str(tmp_path))
  tok = tokenizer.for_model(str(tmp_path), bpe.vocab_size)
  assert isinstance(tok, tokenizer.BPETokenizer)
  assert tok.decode(tok.encode(_CORPUS[0], bos=True)) == _CORPUS[0]  # template tags kept


def test_bytes_only_for_a_byte_vocabulary_and_a_clear_error_otherwise(tmp_path):
  assert tokenizer.for_model(None, 259) == tokenizer.ByteTokenizer()
  assert tokenizer.for_model(str(tmp_path), 259) == tokenizer.ByteTokenizer()
  assert tokenizer.is_byte_vocabulary(259) and not tokenizer.is_byte_vocabulary(300)
  with pytest.raises(tokenizer.TokenizerError, match=r"has no tokenizer.json, and its vocabulary "
                     r"of 300 ids is not the byte tokenizer's \(259\)"):
    tokenizer.for_model(str(tmp_path), 300)
  with pytest.raises(tokenizer.TokenizerError, match="the model has no directory"):
    tokenizer.for_model(None, 151936)
  (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
  with pytest.raises(tokenizer.TokenizerError, match=r"\['tokenizer.model'\] but no tokenizer.json"):
    tokenizer.for_model(str(tmp_path), 259)  # files that say it is not bytes: never bytes


def test_a_bad_tokenizer_config_is_a_clear_error(hf_dir, tmp_path):
  d, fast = hf_dir
  (tmp_path / "tokenizer.json").write_text(open(f"{d}/tokenizer.json").read())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(tokenizer.TokenizerError, match="no '<|nope|>' token"):
    tokenizer.for_model(str(tmp_path), len(fast))
  (tmp_path / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(tokenizer.TokenizerError, match="cannot read"):
    tokenizer.for_model(str(tmp_path), len(fast))
  # The roles may be AddedToken dicts (older transformers).
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": {"content": "<|im_end|>", "special": True}}))
  assert tokenizer.for_model(str(tmp_path), len(fast)).eos_id == fast.convert_tokens_to_ids(
      "<|im_end|>")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
