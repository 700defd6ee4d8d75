"""A checkpoint's tokenizer files and special token ids: written on export, read for serving.

What: `write_tokenizer(tokenizer, path, ...)` writes a model's tokenizer beside its exported
weights the way transformers 5 saves one -- `tokenizer.json`, `tokenizer_config.json` (the BOS /
EOS / pad tokens, no chat template in it) and `chat_template.jinja` -- and `generation_config.json`
(bos_token_id, eos_token_id, pad_token_id), so `AutoTokenizer.from_pretrained(dir)` and
`AutoModelForCausalLM.from_pretrained(dir)` (and `GenerationConfig`) load the export.
`eos_token_ids(dir)` reads a checkpoint's end-of-sequence ids: `generation_config.json`'s, else
`config.json`'s.

Why both files: chat checkpoints (Qwen3) end a turn at `<|im_end|>` yet name `<|endoftext|>` (or
one of the two) in config.json; `generation_config.json` lists every id generation must stop at,
and is what transformers' `generate` and serving engines read. An export that dropped it would
make a served chat model run past the end of its turn.

Byte tokenizers are refused (`CheckpointError`): the project's byte vocabulary (256 bytes, then
pad, bos, eos) has no tokenizer.json form here, and transformers has no tokenizer class for it, so
an export "with" it would be a checkpoint whose tokenizer transformers cannot load. Export such a
model without `tokenizer=` (weights and config only).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from moe import chat_template as chat_template_lib
from moe import tokenizer as tokenizer_lib
from moe.hf.errors import CheckpointError

TOKENIZER = tokenizer_lib.TOKENIZER_FILE  # tokenizer.json
TOKENIZER_CONFIG = tokenizer_lib.CONFIG_FILE  # tokenizer_config.json
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = chat_template_lib.TEMPLATE_FILE  # chat_template.jinja


def _write_json(path: str, value) -> str:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, ensure_ascii=False)
    f.write("\n")
  return path


def token_ids(tokenizer, eos_token_ids: Optional[Sequence[int]] = None) -> dict:
  """{"bos_token_id", "eos_token_id", "pad_token_id"} for config.json / generation_config.json.

  `eos_token_ids` (several for a chat model) overrides the tokenizer's one EOS; eos_token_id is
  an int for one id and a list for several, as transformers writes it. A role without a token
  is None (Qwen has no BOS).
  """
  eos = list(eos_token_ids) if eos_token_ids else (
      [tokenizer.eos_id] if tokenizer is not None and tokenizer.eos_id is not None else [])
  eos = [int(t) for t in dict.fromkeys(eos)]
  return {"bos_token_id": None if tokenizer is None else tokenizer.bos_id,
          "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
          "pad_token_id": None if tokenizer is None else tokenizer.pad_id}


def check_tokenizer(tokenizer, vocab_size: int) -> None:
  """Raises CheckpointError unless `tokenizer` can be exported beside a model of `vocab_size`
  ids (see `write_tokenizer`); called before any file is written."""
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    raise CheckpointError(
        "save_pretrained: a ByteTokenizer cannot be exported: the project's byte vocabulary "
        "(256 bytes, then <pad>, <bos>, <eos>) has no tokenizer.json form and transformers has no "
        "tokenizer for it; export the model without tokenizer= (weights and config.json only)")
  if not isinstance(tokenizer, tokenizer_lib.JsonTokenizer):
    raise CheckpointError(f"save_pretrained: tokenizer must be a moe.tokenizer.JsonTokenizer "
                          f"(moe.tokenizer.for_model), got {type(tokenizer).__name__}")
  if tokenizer.vocab_size > vocab_size:
    raise CheckpointError(f"save_pretrained: the tokenizer has {tokenizer.vocab_size} ids, more "
                          f"than the model's {vocab_size}")


def write_tokenizer(tokenizer, path: str, *, vocab_size: int,
                    model_max_length: Optional[int] = None) -> list[str]:
  """Writes `tokenizer` (a `moe.tokenizer.JsonTokenizer` or `BPETokenizer`) into `path`.

  Files: tokenizer.json; tokenizer_config.json with `tokenizer_class` PreTrainedTokenizerFast
  (transformers 4 and 5 both load it), the role tokens and the chat template's other named special
  tokens (so a template renders with the same variables); chat_template.jinja, the template's
  source, when it has one (a stale one from an earlier save is removed otherwise, since the file
  would win over the config).

  Args:
    tokenizer: the model's tokenizer (`moe.tokenizer.for_model`).
    path: the checkpoint directory.
    vocab_size: the model's ids; a tokenizer with more would encode ids the model lacks.
    model_max_length: the model's context (written as the tokenizer's model_max_length).

  Returns:
    The paths written.

  Raises:
    CheckpointError: a byte tokenizer (see the module docstring), something that is not a
      tokenizer.json tokenizer, or a tokenizer with more ids than the model.
  """
  check_tokenizer(tokenizer, vocab_size)
  written = [tokenizer.save(path)]
  template = tokenizer.chat_template
  config = {"tokenizer_class": "PreTrainedTokenizerFast"}
  if template is not None:  # unk_token, sep_token, ... the template was rendered with
    config.update(template.special_tokens)
  config.update(tokenizer.role_tokens())
  if model_max_length is not None:
    config["model_max_length"] = int(model_max_length)
  written.append(_write_json(os.path.join(path, TOKENIZER_CONFIG), config))
  jinja = os.path.join(path, CHAT_TEMPLATE)
  if template is not None:
    with open(jinja, "w", encoding="utf-8") as f:
      f.write(template.source)
    written.append(jinja)
  elif os.path.exists(jinja):
    os.remove(jinja)
  return written


def write_generation_config(path: str, ids: dict) -> str:
  """Writes `path/generation_config.json` holding `ids` (from `token_ids`, Nones left out)."""
  return _write_json(os.path.join(path, GENERATION_CONFIG),
                     {k: v for k, v in ids.items() if v is not None})


def _eos_of(file: str):
  """The eos_token_id of a JSON file as a tuple of ints; None when the file or key is absent."""
  if not os.path.isfile(file):
    return None
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{file}: cannot read: {e}") from e
  eos = value.get("eos_token_id") if isinstance(value, dict) else None
  if eos is None:
    return None
  items = eos if isinstance(eos, list) else [eos]
  if not items or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                          for t in items):
    raise CheckpointError(f"{file}: eos_token_id must be a token id or a non-empty list of "
                          f"them, got {eos!r}")
  return tuple(dict.fromkeys(int(t) for t in items))


def eos_token_ids(directory: str) -> tuple:
  """Every id that ends generation for the checkpoint in `directory`: generation_config.json's
  eos_token_id (an int or a list) when it names one, else config.json's, else () -- the order
  transformers' `generate` uses.

  Raises:
    CheckpointError: an unreadable file or a malformed eos_token_id.
  """
  for name in (GENERATION_CONFIG, "config.json"):
    eos = _eos_of(os.path.join(directory, name))
    if eos is not None:
      return eos
  return ()
