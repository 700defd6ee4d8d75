"""`rollout.detokenize.IncrementalText` against every tokenizer the sampler serves with.

Property checked for many seeds: however a token sequence is cut into chunks, the pieces
released concatenated with `finish`'s rest equal the completion's text exactly, and text is held
back only while it is unsettled (a trailing U+FFFD, or the last characters a stop string could
still reach into) -- a decoder that held everything until the end would fail too.
"""

import random
import sys

import pytest
import tokenizers as hf_tokenizers
import transformers

from moe import tokenizer as tokenizer_lib
from moe.tokenizer import ByteTokenizer
from rollout import detokenize
from rollout import outputs

FFFD = detokenize.REPLACEMENT
PIECES = ["a", "b", "é", "ü", "日本", "語", "🙂", "🎉", " ", " .", ".", ",", " ,", "isn't", " 's",
          "\n", "ok", " !", "naïve"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
  """A tiny GPT-2 style byte-level BPE, saved the way checkpoints ship one; its directory."""
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<eos>"],
      initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  rng = random.Random(0)
  tok.train_from_iterator(["".join(rng.choices(PIECES, k=40)) for _ in range(200)], trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
  d = tmp_path_factory.mktemp("bpe")
  fast.save_pretrained(str(d))
  return str(d)


def _tokenizer(name, hf_tok):
  """The served tokenizers: bytes, a checkpoint's BPE, and that BPE under a model with 40 ids
  past it (a padded embedding, as Qwen's: those ids decode to nothing)."""
  if name == "bytes":
    return tokenizer_lib.for_model(None, ByteTokenizer().vocab_size)
  n = tokenizer_lib.JsonTokenizer.from_directory(hf_tok).vocab_size
  return tokenizer_lib.for_model(hf_tok, n + 40 if name == "hf_bpe_padded" else n)


def _random_ids(tok, rng, vocab_size):
  """Encoded multi-byte text with random ids (invalid bytes, specials, split pieces) mixed in."""
  ids = []
  while len(ids) < 60:
    if rng.random() < 0.7:
      ids += tok.encode("".join(rng.choices(PIECES, k=rng.randint(1, 4))))
    else:
      ids += [rng.randrange(vocab_size) for _ in range(rng.randint(1, 3))]
  return ids


def _chunks(ids, rng):
  i = 0
  while i < len(ids):
    k = rng.randint(1, 5)
    yield ids[i:i + k]
    i += k


TOKENIZERS = ["bytes", "hf_bpe", "hf_bpe_padded"]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", range(40))
def test_pieces_equal_the_final_text(name, seed, hf_tok):
  tok = _tokenizer(name, hf_tok)
  rng = random.Random(seed)
  ids = _random_ids(tok, rng, getattr(tok, "id_limit", tok.vocab_size))
  inc = detokenize.IncrementalText(tok)
  pieces, seen = [], []
  for chunk in _chunks(ids, rng):
    pieces.append(inc.push(chunk))
    seen += chunk
    # Released as soon as settled: everything but a trailing run of U+FFFD.
    assert inc.sent == tok.decode(seen).rstrip(FFFD)
  final = tok.decode(ids)
  assert "".join(pieces) + inc.finish(final) == final


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", range(40))
def test_pieces_equal_the_final_text_with_stop_strings(name, seed, hf_tok):
  """The engine's rule (`rollout.outputs.find_stop`, called after each chunk): the first stop
  string completed ends the completion, which keeps the tokens up to the one that completed it,
  with the text before the stop string. The chunk that ends a completion is not pushed (the
  server sends the rest from the completion's text)."""
  tok = _tokenizer(name, hf_tok)
  rng = random.Random(1000 + seed)
  ids = _random_ids(tok, rng, getattr(tok, "id_limit", tok.vocab_size))
  whole = tok.decode(ids)
  stop = [whole[i:i + rng.randint(1, 4)] for i in rng.sample(range(len(whole)), 2)]
  stop = [s for s in stop if s] or ["#"]
  hold = max(len(s) for s in stop) - 1
  inc = detokenize.IncrementalText(tok, stop)
  pieces, seen, final = [], [], None
  for chunk in _chunks(ids, rng):
    seen += chunk
    found = outputs.find_stop(seen, tok.decode, stop)
    if found is not None:
      kept, final = found
      # The kept tokens are never fewer than those pushed (streamed) before this chunk, and
      # their text is the completion's text followed by the stop string they complete.
      assert kept > len(seen) - len(chunk)
      rest = tok.decode(seen[:kept])
      assert rest.startswith(final) and any(rest[len(final):].startswith(s) for s in stop)
      assert not any(s in tok.decode(seen[:kept - 1]) for s in stop)
      break
    pieces.append(inc.push(chunk))
    settled = tok.decode(seen).rstrip(FFFD)
    assert inc.sent == settled[:max(0, len(settled) - hold)]
  if final is None:
    final = tok.decode(ids)
  assert "".join(pieces) + inc.finish(final) == final


def test_a_split_character_is_held_until_complete():
  inc = detokenize.IncrementalText(ByteTokenizer())
  snowman = list("a☃b".encode())  # 61 e2 98 83 62
  assert [inc.push([t]) for t in snowman] == ["a", "", "", "☃", "b"]
  inc = detokenize.IncrementalText(ByteTokenizer())
  # An invalid byte stays U+FFFD: released with the next settled character, or by finish.
  assert inc.push([0xFF]) == "" and inc.push([0x61]) == FFFD + "a"
  assert inc.push([0xE2]) == "" and inc.finish(FFFD + "a" + FFFD) == FFFD


def test_a_decode_that_rewrites_released_text_is_reported():
  class Rewriting:
    def decode(self, ids):
      return "ab" if len(ids) < 2 else "xb"

  inc = detokenize.IncrementalText(Rewriting())
  assert inc.push([1]) == "ab" and inc.push([2]) == ""
  with pytest.raises(ValueError, match="not a prefix"):
    inc.finish("xb")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
