"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

What: `load(directory, config)` finds a model directory's Jinja chat template -- the
`chat_template.jinja` transformers 5 saves beside `tokenizer.json` (also `default.jinja` under
`additional_chat_templates/`), else the `chat_template` key of `tokenizer_config.json` that older
checkpoints carry (a string, or a list of named templates) -- and returns a `ChatTemplate`, or
None when the directory has none. `ChatTemplate.render(messages, add_generation_prompt=True)` is
the prompt text a chat model was trained on; encoding it with the checkpoint's tokenizer (no
special tokens added) gives the ids `apply_chat_template(..., tokenize=True)` gives.

Why our own renderer: transformers (and torch) is not a runtime dependency of the server, but the
rendered text must equal transformers' to the character, or a chat model is served prompts it
never saw. So this follows `transformers.utils.chat_template_utils` (5.24): the same jinja2
environment (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`, `loopcontrols`, the
`{% generation %}` tag), the same globals (`raise_exception`, `strftime_now`, a restricted `dict`
and `namespace`), `tojson` without HTML escaping, the same template variables (`messages`,
`tools`, `documents`, `add_generation_prompt`, and the tokenizer's named special tokens --
`bos_token`, `eos_token`, ... -- from tokenizer_config.json), and the same message clean-up (keys
whose value is None dropped; reasoning given as `reasoning` or `thinking` also visible as
`reasoning_content`). `chat_template_test` checks the text against transformers'.

Templates are untrusted code from a checkpoint: the sandbox keeps them from reaching Python
internals, and jinja2 older than 3.1.6 (known sandbox escapes) is refused, as transformers does.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the named special tokens it
# passes to every template (`special_tokens_map`), when the tokenizer has them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# Names a message's reasoning may come under; templates read the first (transformers' aliases).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MIN_JINJA = (3, 1, 6)

_log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
  """A chat template that cannot be loaded or compiled, or a conversation it refuses to render
  (its `raise_exception`, or an error while rendering); the message says which."""


class _Refused(jinja2.exceptions.TemplateError):
  """Raised by a template's own `raise_exception` (a TemplateError, as transformers raises)."""


def _jinja_version_ok(version: str) -> bool:
  parts = []
  for p in version.split(".")[:3]:
    digits = "".join(c for c in p if c.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts) >= _MIN_JINJA


@functools.lru_cache(maxsize=None)
def _environment():
  """The jinja2 environment transformers renders chat templates in (see the module docstring);
  one for the process (templates compiled from it share no state)."""
  if not _jinja_version_ok(jinja2.__version__):
    raise ChatTemplateError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat "
                            "templates need jinja2 >= 3.1.6")

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for transformers' masks;
    rendering only needs its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise _Refused(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  class TemplateDict:
    """`dict(...)` for templates without the type itself (no attribute tricks through it)."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore names (no way to CPython internals)."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace.check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace.check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env


def _plain(value: Any) -> Any:
  """`value` rebuilt from JSON types only (what a template may see), as transformers does."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping]) -> list:
  """The messages a template sees: plain data, keys whose value is None dropped (templates crash
  on or print "None" for `content: null`, but handle a missing key), and reasoning sent as
  `thinking` / `reasoning` also under `reasoning_content` (and `thinking`), as transformers does.

  Raises:
    ChatTemplateError: a message that is not a mapping, or no messages.
  """
  if isinstance(messages, (str, bytes, Mapping)) or not messages:
    raise ChatTemplateError("a conversation is a non-empty list of messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise ChatTemplateError(f"message {i} is not a mapping: {type(m).__name__}")
    m = {k: v for k, v in _plain(m).items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


class ChatTemplate:
  """One compiled chat template and the special-token variables it renders with.

  Attributes:
    source: the template's text.
    special_tokens: {name: token} for the named special tokens the tokenizer has (`bos_token`,
      `eos_token`, ...), passed to the template as variables.
    origin: where it was read from (for messages).
  """

  def __init__(self, source: str, special_tokens: Optional[Mapping[str, str]] = None, *,
               origin: str = "chat template"):
    if not isinstance(source, str):
      raise ChatTemplateError(f"{origin}: a chat template is a string, got "
                              f"{type(source).__name__}")
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    self.origin = origin
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ChatTemplateError(f"{origin} does not compile: {e.message} (line {e.lineno})") from e

  # A compiled jinja template does not pickle; its source does and compiles again on load, so
  # what holds a template (the agent loop's turns of a chat model, envs.harness.turn_format)
  # can be sent to another process.
  def __getstate__(self) -> dict:
    return {k: v for k, v in self.__dict__.items() if k != "_template"}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._template = _environment().from_string(self.source)

  def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
             tools: Optional[Sequence[Mapping]] = None, **variables) -> str:
    """The prompt text of `messages` (OpenAI-style dicts: role, content, tool_calls, ...).

    `add_generation_prompt` appends the start of an assistant turn (what a chat server wants:
    the model writes the reply next). `tools` are the JSON schemas of the functions the model
    may call (OpenAI's `{"type": "function", "function": {...}}` entries), given to the template
    as transformers gives them (as they are; templates that know tools list them in the
    prompt). `variables` are further template variables (e.g. `enable_thinking=False` for
    Qwen3); they override the special tokens, as in transformers.

    Raises:
      ChatTemplateError: the template refused the conversation (its `raise_exception`) or failed
        on it (e.g. a message without the `content` it reads); the message says why.
    """
    chat = normalize_messages(messages)
    kwargs = _plain({**self.special_tokens, **variables})
    if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or
                              not all(isinstance(t, Mapping) for t in tools)):
      raise ChatTemplateError("tools are a list of JSON schemas (mappings)")
    try:
      return self._template.render(messages=chat, tools=_plain(list(tools))
                                   if tools is not None else None, documents=None,
                                   add_generation_prompt=bool(add_generation_prompt), **kwargs)
    except _Refused as e:
      raise ChatTemplateError(f"the chat template refused the conversation: {e.message}") from e
    except jinja2.TemplateError as e:  # undefined values, sandbox violations
      raise ChatTemplateError(f"the chat template failed on the conversation: "
                              f"{type(e).__name__}: {e.message}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
      # A template written for other message shapes (e.g. concatenating a missing field): the
      # conversation is what the caller can change.
      raise ChatTemplateError(f"the chat template failed on the conversation: "
                              f"{type(e).__name__}: {e}") from e


def _special_tokens(config: Mapping) -> dict:
  """The named special tokens of a tokenizer_config.json (strings or AddedToken dicts)."""
  out = {}
  for name in SPECIAL_TOKEN_NAMES:
    v = config.get(name)
    if isinstance(v, dict):
      v = v.get("content")
    if isinstance(v, str):
      out[name] = v
  return out


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ChatTemplateError(f"cannot read {path}: {e}") from e


def _from_config(value, origin: str) -> dict:
  """The `chat_template` key of tokenizer_config.json -> {name: template}."""
  if isinstance(value, str):
    return {"default": value}
  if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                     and isinstance(t.get("template"), str) for t in value):
    return {t["name"]: t["template"] for t in value}
  raise ChatTemplateError(f"{origin}: 'chat_template' is neither a string nor a list of "
                          "{'name': ..., 'template': ...}")


def load(directory: Optional[str], config: Optional[Mapping] = None) -> Optional[ChatTemplate]:
  """The chat template of the tokenizer in `directory`, or None when it has none.

  Where, in transformers' order: `chat_template.jinja` and `additional_chat_templates/*.jinja`
  (files win over the config), else `config["chat_template"]` (`config`: the directory's parsed
  tokenizer_config.json). With several named templates the one named "default" is used; named
  templates without a default are reported in the log and give None (the caller needs to pick
  one, which a chat endpoint cannot).

  Raises:
    ChatTemplateError: an unreadable template file, a malformed `chat_template` key, or a
      template that does not compile (a broken checkpoint; better found at load than per request).
  """
  if not directory:
    return None
  config = config or {}
  templates = {}
  path = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(path):
    templates["default"] = (_read(path), path)
  extra = os.path.join(directory, TEMPLATE_DIR)
  if os.path.isdir(extra):
    for name in sorted(os.listdir(extra)):
      if name.endswith(".jinja"):
        p = os.path.join(extra, name)
        templates.setdefault(name[:-len(".jinja")], (_read(p), p))
  if not templates and config.get("chat_template") is not None:
    where = os.path.join(directory, "tokenizer_config.json")
    templates = {k: (v, f"{where} (chat_template {k!r})")
                 for k, v in _from_config(config["chat_template"], where).items()}
  if not templates:
    return None
  if "default" not in templates:
    _log.warning("%s: named chat templates %s and no default one: no chat template used",
                 directory, sorted(templates))
    return None
  source, origin = templates["default"]
  return ChatTemplate(source, _special_tokens(config), origin=origin)
