"""Incremental detokenization: the text of a growing token sequence, released piece by piece.

What: `IncrementalText(tokenizer, stop)` takes a completion's tokens as they are sampled
(`push`) and returns only text that later tokens cannot change; `finish(final_text)` returns the
rest, so that the pieces concatenated equal the completion's final (non-streamed) text exactly.

Why not "decode everything, send what is new": a token can end inside a multi-byte character
(byte-level vocabularies split UTF-8 sequences across tokens), and the decoded text then ends in
U+FFFD, which the next token replaces by the real character. Text sent with that placeholder in
it is wrong, and comparing later decodes against it loses the rest of the stream. So a trailing
run of U+FFFD is held back until a later token settles it (a byte that is really invalid stays
U+FFFD and is released with the next settled character, or by `finish`).

Stop strings: after each chunk the engine decodes the whole sequence; the first stop string
completed ends the completion, whose tokens run up to the one that completed it and whose text stops
before it (`rollout.outputs.find_stop`). A stop string can start in text already decoded and end in
tokens not yet sampled. Text is therefore released only up to the last `max(len(stop)) - 1`
characters, which no stop string found later can reach back into (a stop string that lies wholly
inside the decoded text would already have ended the completion).

Assumes the tokenizer's decode is prefix-stable: the decode of a sequence, less its trailing
U+FFFD, begins the decode of any longer sequence. Byte-level vocabularies (`ByteLevel`, GPT-2
style byte-level BPE) have this property (`transformers` skips its space clean-up, which would
rewrite " ." as ".", for BPE tokenizers). A decode that rewrites released text is detected:
nothing more is released and `finish` raises. One known case: sentencepiece byte fallback decodes
a run of byte tokens that holds an invalid byte as all U+FFFD, valid characters before it
included; a model has to sample invalid UTF-8 for that to happen.
"""

from __future__ import annotations

from typing import Iterable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
  """The settled text of one completion's tokens so far (see the module docstring)."""

  def __init__(self, tokenizer, stop: Sequence[str] = ()):
    """Args:
      tokenizer: has `decode(ids) -> str`.
      stop: the request's stop strings (text near the end is held back while one could form).
    """
    self._tokenizer = tokenizer
    self._ids: list = []
    self._hold = max((len(s) for s in stop), default=1) - 1
    self.sent = ""  # the text released so far

  def push(self, token_ids: Iterable[int]) -> str:
    """Adds newly sampled tokens; returns the text they settle (often "", never unsettled)."""
    self._ids.extend(int(t) for t in token_ids)
    text = self._tokenizer.decode(self._ids).rstrip(REPLACEMENT)
    settled = text[:max(0, len(text) - self._hold)]
    if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
      # Nothing new, or a decode that rewrote released text (a tokenizer that is not
      # prefix-stable): release nothing now; `finish` reports the mismatch.
      return ""
    new = settled[len(self.sent):]
    self.sent = settled
    return new

  def finish(self, final_text: str) -> str:
    """The rest of `final_text` (the completion's text) after what was released.

    Raises:
      ValueError: `final_text` does not begin with the released text (a tokenizer whose decode
        rewrites earlier text; the stream cannot be made to match).
    """
    if not final_text.startswith(self.sent):
      raise ValueError("the streamed text is not a prefix of the completion's text "
                       f"({len(self.sent)} characters streamed)")
    rest = final_text[len(self.sent):]
    self.sent = final_text
    return rest
