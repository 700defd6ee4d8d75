import sys

import pytest

from moe import tokenizer


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
  again = tokenizer.load(str(tmp_path))
  assert isinstance(again, tokenizer.BPETokenizer)
  assert again.encode(text) == tok.encode(text) and again.vocab_size == tok.vocab_size
  assert isinstance(tokenizer.load(str(tmp_path / "none")), tokenizer.ByteTokenizer)


def test_bpe_bad_input():
  with pytest.raises(ValueError, match="vocab_size must be at least"):
    tokenizer.BPETokenizer.train(_CORPUS, 100)
  tok = tokenizer.BPETokenizer.train(_CORPUS, 300)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([1, tok.vocab_size])
  with pytest.raises(FileNotFoundError):
    tokenizer.BPETokenizer.load("/nonexistent/dir")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
