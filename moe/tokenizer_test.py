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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
