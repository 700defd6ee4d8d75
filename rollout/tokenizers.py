"""Tokenizers the server can use for text prompts and completion text.

What: `for_checkpoint(path, vocab_size)` picks the tokenizer that comes with a model:
  * a Hugging Face checkpoint directory with tokenizer files -> its `transformers` tokenizer;
  * otherwise, a model whose vocabulary covers the 256 byte values -> `ByteTokenizer` (the tiny
    demo models are byte-level: `moe.tokenizer.ByteTokenizer`, ids 0..255 are bytes).
Ids beyond the byte range decode to the empty string in the byte fallback (special tokens, or a
random-weights model's unused ids); `token_ids` in responses are always exact.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from moe.tokenizer import NUM_BYTES, ByteTokenizer

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ByteLevel:
  """Byte-level text <-> ids for any vocabulary of at least 256 ids."""

  def __init__(self, vocab_size: int, eos_id: Optional[int] = None):
    if vocab_size < NUM_BYTES:
      raise ValueError(f"a byte-level tokenizer needs a vocabulary of >= {NUM_BYTES} ids, the "
                       f"model has {vocab_size}")
    self.vocab_size = vocab_size
    self.eos_id = eos_id

  def encode(self, text: str) -> list:
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8",
                                                                        errors="replace")


class HFTokenizer:
  """A `transformers` tokenizer behind the same two methods."""

  def __init__(self, path: str):
    import transformers  # only needed for checkpoints that ship a tokenizer
    self._tok = transformers.AutoTokenizer.from_pretrained(path)
    self.eos_id = self._tok.eos_token_id
    self.vocab_size = len(self._tok)

  def encode(self, text: str) -> list:
    return list(self._tok.encode(text, add_special_tokens=False))

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def for_checkpoint(path: Optional[str], vocab_size: int):
  """The tokenizer for a model (see the module docstring); None if there is none."""
  if path and any(os.path.exists(os.path.join(path, f)) for f in _HF_FILES):
    return HFTokenizer(path)
  if vocab_size == ByteTokenizer().vocab_size:
    bt = ByteTokenizer()
    return ByteLevel(vocab_size, eos_id=bt.eos_id)
  if vocab_size >= NUM_BYTES:
    return ByteLevel(vocab_size)
  return None
