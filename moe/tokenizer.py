"""Byte-level tokenizer for the tiny demo models.

Token ids 0..255 are raw bytes; a few special tokens follow. A byte-level vocabulary needs no
training data or downloads, round-trips any text exactly, and keeps the tiny model's vocabulary
small. Real checkpoints bring their own tokenizer (see `moe.hf`).
"""

from __future__ import annotations

import dataclasses
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

