"""Tokenizers of the project's own models: bytes, or byte-level BPE trained on their corpus.

`ByteTokenizer`: ids 0..255 are raw bytes; a few special tokens follow. It needs no training
data, round-trips any text exactly and keeps the vocabulary tiny, at one position per byte.
`BPETokenizer`: byte-level BPE (Hugging Face `tokenizers`) trained on a generated corpus and
saved as `tokenizer.json` beside the model; several bytes per position. `load(dir)` gives the
one saved with a model, else bytes. Real checkpoints bring their own tokenizer (see `moe.hf`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

NUM_BYTES = 256


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Bytes are ids 0..255; special tokens follow at 256, 257, ..."""

  special_tokens: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")

  @property
  def vocab_size(self) -> int:
    return NUM_BYTES + len(self.special_tokens)

  def special_id(self, name: str) -> int:
    try:
      return NUM_BYTES + self.special_tokens.index(name)
    except ValueError:
      raise KeyError(f"unknown special token {name!r}; have {self.special_tokens}") from None

  @property
  def bos_id(self) -> int:
    return self.special_id("<bos>")

  @property
  def eos_id(self) -> int:
    return self.special_id("<eos>")

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    if bos:
      ids.insert(0, self.bos_id)
    if eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    out = bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < NUM_BYTES:
        out.append(i)
      elif not skip_special:
        if i >= self.vocab_size or i < 0:
          raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        out.extend(self.special_tokens[i - NUM_BYTES].encode())
      elif i >= self.vocab_size or i < 0:
        raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
    # Sampled byte sequences can be invalid UTF-8; replacement keeps decoding total.
    return out.decode("utf-8", errors="replace")



TOKENIZER_FILE = "tokenizer.json"


class BPETokenizer:
  """A byte-level BPE tokenizer (Hugging Face `tokenizers`), trained on a corpus or loaded.

  The byte tokenizer spends one id per byte, so an agent transcript of ~800 bytes is ~800
  positions; byte-level BPE trained on the same corpus (a vocabulary of a few thousand) cuts
  that about four-fold, which is attention and decode work the tiny models on a CPU do not pay.
  Byte-level pre-tokenisation (GPT-2's) keeps it lossless for any text.

  `special_tokens` (pad, bos, eos) are dropped by `decode(..., skip_special=True)`;
  `extra_tokens` (a chat template's tags: `<|im_start|>`, `<tool_call>`, ...) are single ids
  that are always matched in text and always decoded, as in Qwen's tokenizer, so a tool call's
  markers are one token each and survive decoding. Saved as a standard `tokenizer.json`.
  """

  special_tokens: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")

  def __init__(self, tok):
    self._tok = tok
    self._special = {}
    for name in self.special_tokens:
      i = tok.token_to_id(name)
      if i is None:
        raise ValueError(f"the tokenizer has no {name!r} token")
      self._special[name] = i
    self._drop = frozenset(self._special.values())

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int, *,
            extra_tokens: Iterable[str] = ()) -> "BPETokenizer":
    """Trains on `texts` to at most `vocab_size` ids (fewer when the corpus has fewer merges)."""
    import tokenizers  # pylint: disable=g-import-not-at-top
    from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
    extra = list(dict.fromkeys(extra_tokens))
    reserved = list(cls.special_tokens) + extra
    if vocab_size < NUM_BYTES + len(reserved):
      raise ValueError(f"vocab_size must be at least {NUM_BYTES + len(reserved)} (the 256 bytes "
                       f"and {len(reserved)} special and template tokens), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Reserved tokens are the trainer's specials (ids 0..): never split, never merged into.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=reserved,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return cls(tok)

  @classmethod
  def load(cls, path: str) -> "BPETokenizer":
    """From a `tokenizer.json` file or a directory holding one."""
    import tokenizers  # pylint: disable=g-import-not-at-top
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.exists(path):
      raise FileNotFoundError(f"no tokenizer at {path}")
    return cls(tokenizers.Tokenizer.from_file(path))

  def save(self, directory: str) -> str:
    """Writes `directory/tokenizer.json`; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_FILE)
    self._tok.save(path)
    return path

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def special_id(self, name: str) -> int:
    i = self._tok.token_to_id(name)
    if i is None:
      raise KeyError(f"unknown token {name!r}")
    return i

  @property
  def bos_id(self) -> int:
    return self._special["<bos>"]

  @property
  def eos_id(self) -> int:
    return self._special["<eos>"]

  @property
  def pad_id(self) -> int:
    return self._special["<pad>"]

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if bos:
      ids.insert(0, self.bos_id)
    if eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    n = self.vocab_size
    for i in ids:
      if not 0 <= i < n:
        raise ValueError(f"token id {i} is outside the vocabulary (size {n})")
    if skip_special:
      ids = [i for i in ids if i not in self._drop]
    # skip_special_tokens=False: the template tags are trainer specials too and must survive.
    return self._tok.decode(ids, skip_special_tokens=False)


def load(path: str | None):
  """The tokenizer saved in `path` (a directory with tokenizer.json), else the byte tokenizer."""
  if path and os.path.exists(os.path.join(path, TOKENIZER_FILE)):
    return BPETokenizer.load(path)
  return ByteTokenizer()
