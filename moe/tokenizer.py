"""Tokenizers of models: bytes, byte-level BPE trained on the corpus, or a checkpoint's own.

`ByteTokenizer`: ids 0..255 are raw bytes; a few special tokens follow. It needs no training
data, round-trips any text exactly and keeps the vocabulary tiny, at one position per byte.
`JsonTokenizer`: any tokenizer saved as `tokenizer.json` (Hugging Face `tokenizers`), with the
BOS / EOS / pad roles its `tokenizer_config.json` names: what a real checkpoint ships.
`BPETokenizer`: the project's byte-level BPE, trained on a generated corpus and saved as
`tokenizer.json` beside the model; several bytes per position.

A tokenizer loaded from a directory exposes the directory's chat template as `chat_template`
(a `moe.chat_template.ChatTemplate`, None when there is none; always None for bytes):
`tok.chat_template.render(messages)` is the prompt text of a conversation, and `tok.encode` of
it the prompt ids, as transformers' `apply_chat_template` gives them.

`for_model(directory, vocab_size)` is the one way to find a model's tokenizer (the server, the
evaluation and the pipeline's parts use it): the model directory's `tokenizer.json`, else the
byte tokenizer when the model's vocabulary is exactly the byte tokenizer's, else a
`TokenizerError` -- never bytes in place of a vocabulary that is not bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import ClassVar, Iterable, Optional

from moe import chat_template as chat_template_lib

NUM_BYTES = 256


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Bytes are ids 0..255; special tokens follow at 256, 257, ..."""

  special_tokens: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
  # Byte models are the project's own; they come without a chat template.
  chat_template: ClassVar[None] = None

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
CONFIG_FILE = "tokenizer_config.json"
# Tokenizer files that come without tokenizer.json (sentencepiece and "slow" tokenizers). This
# project reads tokenizer.json only (transformers is not a runtime dependency), so a directory
# holding just these is an error that says how to convert them, not a model without a tokenizer.
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt",
                          "vocab.txt", CONFIG_FILE)

_log = logging.getLogger(__name__)


class TokenizerError(ValueError):
  """A model's tokenizer cannot be had: a vocabulary that is not bytes with no tokenizer.json,
  tokenizer files other than tokenizer.json, a role token missing from the vocabulary, a
  tokenizer with more ids than the model, or a chat template that cannot be read or compiled."""


def is_byte_vocabulary(vocab_size: int) -> bool:
  """Whether a model of `vocab_size` ids is a byte-level model: exactly `ByteTokenizer`'s ids
  (the 256 bytes, then pad, bos, eos) -- how the project's byte models say what they are."""
  return vocab_size == ByteTokenizer().vocab_size


def _token_content(value) -> Optional[str]:
  """A role's token in tokenizer_config.json: a string, an AddedToken dict, or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerError(f"a special token in {CONFIG_FILE} is neither a string nor "
                       f"{{'content': ...}}: {value!r}")


def _read_tokenizer_json(directory: str):
  import tokenizers  # pylint: disable=g-import-not-at-top
  path = os.path.join(directory, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer at {path}")
  return tokenizers.Tokenizer.from_file(path)


def _load_chat_template(directory: str, config: Optional[dict]):
  """`moe.chat_template.load`, its errors as TokenizerError (a broken checkpoint)."""
  try:
    return chat_template_lib.load(directory, config)
  except chat_template_lib.ChatTemplateError as e:
    raise TokenizerError(str(e)) from e


def _read_config(directory: str) -> Optional[dict]:
  """`directory/tokenizer_config.json` (None when there is none)."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"cannot read {path}: {e}") from e
  if not isinstance(config, dict):
    raise TokenizerError(f"{path} is not a JSON object")
  return config


class JsonTokenizer:
  """A tokenizer saved as `tokenizer.json` (Hugging Face `tokenizers`) behind the project's
  tokenizer methods (`encode`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`,
  `special_id`).

  Why one class for every tokenizer.json: a real checkpoint's tokenizer and the project's trained
  BPE are the same kind of file, so the server, the evaluation and the learner encode and decode
  both through the same code. transformers 5 decodes through the same library
  (`TokenizersBackend._decode` calls `tokenizers.Tokenizer.decode`), so this class's text equals
  `AutoTokenizer`'s for a checkpoint, without transformers at run time.

  Roles: `bos_token`, `eos_token`, `pad_token` name tokens of the vocabulary, or are None when the
  tokenizer has no such token (Qwen's has no BOS); their ids are None then.
  `skip_ids`: what `decode(..., skip_special=True)` drops; `from_directory` takes the tokenizer's
  special added tokens, as transformers' `decode(skip_special_tokens=True)` does.
  `id_limit`: ids in [vocab_size, id_limit) -- rows a model's embedding has past its tokenizer,
  e.g. Qwen3's 151936 rows over 151669 ids -- decode to nothing, as in `tokenizers`; ids outside
  [0, id_limit) raise ValueError. Defaults to vocab_size.
  `chat_template`: the directory's `moe.chat_template.ChatTemplate`, or None (see the module
  docstring); `from_directory` and `for_model` load it.
  """

  def __init__(self, tok, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
               pad_token: Optional[str] = None, skip_ids: Optional[Iterable[int]] = None,
               id_limit: Optional[int] = None,
               chat_template: Optional[chat_template_lib.ChatTemplate] = None):
    self._tok = tok
    self.chat_template = chat_template
    self._roles = {}
    for role, name in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
      if name is None:
        self._roles[role] = None
        continue
      i = tok.token_to_id(name)
      if i is None:
        raise TokenizerError(f"the tokenizer has no {name!r} token (its {role} token)")
      self._roles[role] = i
    self._skip = frozenset(int(i) for i in (skip_ids or ()))
    n = self.vocab_size
    self.id_limit = n if id_limit is None else int(id_limit)
    if self.id_limit < n:
      raise TokenizerError(f"the tokenizer has {n} ids, more than the model's {self.id_limit}: "
                           "it would encode text into ids the model does not have")

  @classmethod
  def from_directory(cls, directory: str, *, id_limit: Optional[int] = None) -> "JsonTokenizer":
    """A checkpoint's tokenizer: `directory/tokenizer.json` with the roles (bos_token,
    eos_token, pad_token) of `directory/tokenizer_config.json` when there is one, and the
    directory's chat template (`moe.chat_template.load`).

    Raises:
      FileNotFoundError: no tokenizer.json in `directory`.
      TokenizerError: an unreadable tokenizer_config.json, a role token not in the vocabulary,
        or a chat template that cannot be read or compiled.
    """
    config = _read_config(directory) or {}
    return cls._from_files(_read_tokenizer_json(directory), config, id_limit,
                           _load_chat_template(directory, config))

  @classmethod
  def _from_files(cls, tok, config: dict, id_limit: Optional[int],
                  chat_template: Optional[chat_template_lib.ChatTemplate] = None
                  ) -> "JsonTokenizer":
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    return cls(tok, bos_token=_token_content(config.get("bos_token")),
               eos_token=_token_content(config.get("eos_token")),
               pad_token=_token_content(config.get("pad_token")), skip_ids=special,
               id_limit=id_limit, chat_template=chat_template)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def special_id(self, name: str) -> int:
    i = self._tok.token_to_id(name)
    if i is None:
      raise KeyError(f"unknown token {name!r}")
    return i

  @property
  def bos_id(self) -> Optional[int]:
    return self._roles["bos"]

  @property
  def eos_id(self) -> Optional[int]:
    return self._roles["eos"]

  @property
  def pad_id(self) -> Optional[int]:
    return self._roles["pad"]

  def role_tokens(self) -> dict:
    """{"bos_token": text, "eos_token": text, "pad_token": text} for the roles this tokenizer
    has (absent roles left out): what a tokenizer_config.json names, e.g. for an export."""
    return {f"{role}_token": self._tok.id_to_token(i) for role, i in self._roles.items()
            if i is not None}

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """`text`'s ids, without the tokenizer's own post-processing (no BOS a template would add);
    `bos` / `eos` add the role tokens, which must exist."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    for wanted, role in ((bos, "bos"), (eos, "eos")):
      if wanted and self._roles[role] is None:
        raise ValueError(f"this tokenizer has no {role} token")
    if bos:
      ids.insert(0, self._roles["bos"])
    if eos:
      ids.append(self._roles["eos"])
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    for i in ids:
      if not 0 <= i < self.id_limit:
        raise ValueError(f"token id {i} is outside the vocabulary (size {self.id_limit})")
    n = self.vocab_size
    ids = [i for i in ids if i < n and not (skip_special and i in self._skip)]
    # Filtered here, decoded with skip_special_tokens=False: the project's template tags are
    # trainer specials that must survive (see BPETokenizer); for a checkpoint `_skip` is exactly
    # the set `tokenizers` would skip.
    return self._tok.decode(ids, skip_special_tokens=False)

  def save(self, directory: str) -> str:
    """Writes `directory/tokenizer.json`; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_FILE)
    self._tok.save(path)
    return path


class BPETokenizer(JsonTokenizer):
  """The project's byte-level BPE tokenizer (Hugging Face `tokenizers`), trained on a corpus or
  loaded.

  The byte tokenizer spends one id per byte, so an agent transcript of ~800 bytes is ~800
  positions; byte-level BPE trained on the same corpus (a vocabulary of a few thousand) cuts
  that about four-fold, which is attention and decode work the tiny models on a CPU do not pay.
  Byte-level pre-tokenisation keeps it lossless for any text.

  Pre-tokenisation splits as Qwen2's and Llama 3's tokenizers do (`PRETOKENIZE_PATTERN`): a
  line break stays with the punctuation before it and apart from the indentation after it, and
  digits are single tokens. So a prompt that ends at a line break (a function's signature, a
  turn's header) tokenizes exactly as the same text does inside a training document. With GPT-2's
  pattern the break merged with the next line's indentation (`"\n   "`), a lone `"\n"` token
  only ever preceded the end of a document, and a model trained on it answered such prompts with
  EOS (the pyfunc suite: 0 of 288 validation samples passed where bytes passed 108).

  `special_tokens` (pad, bos, eos) are dropped by `decode(..., skip_special=True)`;
  `extra_tokens` (a chat template's tags: `<|im_start|>`, `<tool_call>`, ...) are single ids
  that are always matched in text and always decoded, as in Qwen's tokenizer, so a tool call's
  markers are one token each and survive decoding. Saved as a standard `tokenizer.json`.
  """

  special_tokens: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
  # Qwen2's (and, but for digit runs, Llama 3's) pre-tokenisation regex.
  PRETOKENIZE_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                         r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

  def __init__(self, tok, *, id_limit: Optional[int] = None):
    pad, bos, eos = self.special_tokens
    for name in self.special_tokens:
      if tok.token_to_id(name) is None:
        raise ValueError(f"the tokenizer has no {name!r} token")
    super().__init__(tok, bos_token=bos, eos_token=eos, pad_token=pad,
                     skip_ids=[tok.token_to_id(name) for name in self.special_tokens],
                     id_limit=id_limit)

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
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(cls.PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Reserved tokens are the trainer's specials (ids 0..): never split, never merged into.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=reserved,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return cls(tok)

  @classmethod
  def load(cls, path: str, *, id_limit: Optional[int] = None) -> "BPETokenizer":
    """From a `tokenizer.json` file or a directory holding one."""
    import tokenizers  # pylint: disable=g-import-not-at-top
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.exists(path):
      raise FileNotFoundError(f"no tokenizer at {path}")
    return cls(tokenizers.Tokenizer.from_file(path), id_limit=id_limit)


def for_model(directory: Optional[str], vocab_size: Optional[int]):
  """The tokenizer of a model of `vocab_size` ids whose files are in `directory` (None: a model
  with no directory, e.g. freshly initialised). `vocab_size` None: the model's vocabulary is not
  known yet (a part of the multi-process pipeline before the learner publishes the model's
  config, pipeline.processes); the tokenizer's own ids are the limit then.

  * `directory/tokenizer.json` -> the project's `BPETokenizer` when it has the project's pad, bos
    and eos and no tokenizer_config.json beside it (a checkpoint's own names its roles there),
    else `JsonTokenizer.from_directory`. Ids the model has past the tokenizer's decode to
    nothing. Either carries the directory's chat template, if it has one (`chat_template`).
  * no tokenizer files, and the model's vocabulary is exactly the byte tokenizer's (see
    `is_byte_vocabulary`) -> `ByteTokenizer`, and a log line says so.

  Raises:
    TokenizerError: anything else: a vocabulary that is not bytes and no tokenizer.json (a model
      served or evaluated through bytes it was not trained on would produce garbage, silently),
      tokenizer files other than tokenizer.json (named, with how to convert them), or a
      tokenizer with more ids than the model, or a chat template that cannot be read or compiled.
  """
  if directory and os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
    tok, config = _read_tokenizer_json(directory), _read_config(directory)
    if config is None and all(tok.token_to_id(n) is not None
                              for n in BPETokenizer.special_tokens):
      out = BPETokenizer(tok, id_limit=vocab_size)
    else:
      out = JsonTokenizer._from_files(tok, config or {}, vocab_size)  # pylint: disable=protected-access
    out.chat_template = _load_chat_template(directory, config)
    _log.info("%s: tokenizer.json, %d ids (the model has %s)", directory, out.vocab_size,
              vocab_size)
    return out
  others = ([f for f in _OTHER_TOKENIZER_FILES if os.path.exists(os.path.join(directory, f))]
            if directory else [])
  if others:
    raise TokenizerError(
        f"{directory} has tokenizer files {others} but no {TOKENIZER_FILE}, the one format this "
        "project reads; write one with transformers: "
        "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
  if vocab_size is not None and is_byte_vocabulary(vocab_size):
    _log.info("%s: no tokenizer files; the model's %d ids are the byte tokenizer's (256 bytes, "
              "pad, bos, eos): byte-level", directory or "model without a directory", vocab_size)
    return ByteTokenizer()
  where = f"{directory} has no {TOKENIZER_FILE}" if directory else "the model has no directory"
  size = "an unknown number of" if vocab_size is None else vocab_size
  raise TokenizerError(
      f"{where}, and its vocabulary of {size} ids is not the byte tokenizer's "
      f"({ByteTokenizer().vocab_size}): save the model's tokenizer.json beside its weights")

