"""OpenAI chat completions protocol: validating `POST /v1/chat/completions` bodies, rendering
their messages through the model's chat template, and shaping the answers.

What: `parse_chat_request(body, tokenizer, vocab_size, max_tokens_limit)` checks the messages,
renders them with the checkpoint's chat template (`tokenizer.chat_template`, see
`moe.chat_template`: the text transformers' `apply_chat_template(..., add_generation_prompt=True)`
gives) and encodes that text with the checkpoint's tokenizer -- the prompt ids a chat model was
trained on -- and parses the sampling fields as completions do (`protocol.parse_sampling`).
`ChatFormat` shapes choices, stream chunks (`delta`s) and logprobs (streamed too, each token's
`top_logprobs` alternatives included when asked for) the way OpenAI's chat API does, with the
sampler's extra fields of completions (`token_ids`, `prompt_token_ids`, `routing`,
`policy_version`, `policy_versions`, `prompt_routing`).

Tools: `tools` (OpenAI's `{"type": "function", "function": {"name", "description",
"parameters", "strict"}}` entries) are given to the chat template as transformers'
`apply_chat_template(tools=...)` gives them, and a conversation's earlier tool use renders through
the template too: an assistant message's `tool_calls` (each call's `arguments`, a JSON string in
OpenAI's API, parsed into the object transformers' templates expect, as vLLM does) and `tool`
messages (with `tool_call_id`). What a template without tool support does with them is the
template's affair (most ignore `tools`). The answer is not parsed into `tool_calls`: a call the
model writes stays in the message `content` as the model wrote it (Qwen3's `<tool_call>` block),
with finish_reason "stop", for the client to parse. So `tool_choice` may only be "auto" (the
default) or "none" (the tools are still rendered, as vLLM does; the model is not constrained
either way); "required" or a named function, which need constrained decoding or parsing, are
refused with a 400, and so are the deprecated `functions` / `function_call` (send `tools`).

Why a module of its own: the chat fields (messages, `max_completion_tokens`, boolean `logprobs`
with `top_logprobs`) and answer shapes differ from completions, while everything after the
prompt ids -- queueing, sampling, streaming, timeouts -- is the completions path, which
`rollout.server` runs for both.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from moe import chat_template
from rollout import protocol
from rollout.sampling import MAX_TOP_LOGPROBS

# Roles a message may have (OpenAI's; "developer" is its newer name for "system"). Whether the
# template accepts a role, or an order of them, is the template's call (its raise_exception).
ROLES = ("system", "developer", "user", "assistant", "tool")
# Message fields passed to the template, besides role and content (strings).
_MESSAGE_STRINGS = ("name", "tool_call_id", "reasoning_content")

_OPENAI_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                  "top_p", "n", "stream", "stream_options", "logprobs", "top_logprobs", "stop",
                  "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
                  "tool_choice"}
# OpenAI's deprecated function-calling fields, and what replaced them.
_DEPRECATED = {"functions": "'tools'", "function_call": "'tool_choice'"}
TOOL_CHOICES = ("auto", "none")
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
_EXTRA_FIELDS = {"top_k", "stop_token_ids", "ignore_eos", "timeout", "return_routing",
                 "return_prompt_routing"}
_MAX_ERROR = 300


def _text(value: Any, where: str) -> str:
  """A string the tokenizer can take (JSON can carry lone surrogates, which none can)."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise protocol.BadRequest(f"{where} is not valid Unicode: a lone surrogate at character "
                              f"{e.start}") from None
  return value


def _content(value: Any, where: str, role: str):
  """A message's content: a string, a list of text parts (joined with newlines, as vLLM does),
  or null for an assistant message (dropped: the template sees no content)."""
  if isinstance(value, str):
    return _text(value, where)
  if value is None and role == "assistant":
    return None
  if isinstance(value, list) and value:
    texts = []
    for j, part in enumerate(value):
      if not (isinstance(part, dict) and part.get("type") == "text" and set(part) == {
          "type", "text"} and isinstance(part["text"], str)):
        raise protocol.BadRequest(f"{where}[{j}] must be a text part "
                                  f"{{'type': 'text', 'text': ...}}, got {protocol.show(part)}")
      texts.append(_text(part["text"], f"{where}[{j}].text"))
    return "\n".join(texts)
  raise protocol.BadRequest(f"{where} must be a string or a list of text parts, got "
                            f"{protocol.show(value)}")


def _object(value: Any, where: str, what: str) -> dict:
  if not isinstance(value, dict):
    raise protocol.BadRequest(f"{where} must be {what}, got {protocol.show(value)}")
  return value


def _fields(value: dict, allowed, where: str) -> None:
  unknown = sorted(set(value) - set(allowed), key=str)
  if unknown:
    raise protocol.BadRequest(f"{where} has unknown field(s) {protocol.show(unknown)}; "
                              f"accepted: {list(allowed)}")


def _refuse_deprecated(body: Any) -> None:
  """OpenAI's deprecated 'functions' / 'function_call' get a 400 that says what replaced them."""
  for name, instead in _DEPRECATED.items():
    if isinstance(body, dict) and name in body:
      raise protocol.BadRequest(f"'{name}' is OpenAI's deprecated form of {instead}; send "
                                f"{instead} instead")


def parse_tools(body: dict) -> Optional[list]:
  """'tools' -> the list of tool schemas the template renders (None when absent), after checking
  'tool_choice' (module docstring)."""
  choice = body.get("tool_choice")
  if choice is not None and choice not in TOOL_CHOICES:
    raise protocol.BadRequest(
        f"'tool_choice' must be one of {list(TOOL_CHOICES)}, got {protocol.show(choice)}: this "
        "server neither forces tool calls nor parses them (a call the model writes is in the "
        "message content)")
  tools = body.get("tools")
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise protocol.BadRequest(f"'tools' must be a list of tools, got {protocol.show(tools)}")
  for i, tool in enumerate(tools):
    where = f"'tools'[{i}]"
    _object(tool, where, "an object {'type': 'function', 'function': {...}}")
    _fields(tool, ("type", "function"), where)
    if tool.get("type") != "function":
      raise protocol.BadRequest(f"{where}.type must be 'function', got "
                                f"{protocol.show(tool.get('type'))}")
    fn = _object(tool.get("function"), f"{where}.function",
                 "an object with 'name' (and 'description', 'parameters', 'strict')")
    _fields(fn, _FUNCTION_FIELDS, f"{where}.function")
    for name, kind, ok in (("name", "a string", str), ("description", "a string", str),
                           ("parameters", "an object (a JSON schema)", dict),
                           ("strict", "true or false", bool)):
      if (name in fn or name == "name") and not isinstance(fn.get(name), ok):
        raise protocol.BadRequest(f"{where}.function.{name} must be {kind}, got "
                                  f"{protocol.show(fn.get(name))}")
    _text(json.dumps(tool, ensure_ascii=False), where)
  return tools


def _tool_calls(value: Any, where: str) -> list:
  """An assistant message's 'tool_calls' as the template renders them: each call's 'arguments'
  (OpenAI's JSON string, or an object) as an object."""
  if not isinstance(value, list):
    raise protocol.BadRequest(f"{where} must be a list of tool calls, got {protocol.show(value)}")
  out = []
  for j, call in enumerate(value):
    w = f"{where}[{j}]"
    _object(call, w, "an object {'id': ..., 'type': 'function', 'function': {'name': ..., "
            "'arguments': ...}}")
    _fields(call, ("id", "type", "function"), w)
    if call.get("type", "function") != "function":
      raise protocol.BadRequest(f"{w}.type must be 'function', got "
                                f"{protocol.show(call.get('type'))}")
    fn = _object(call.get("function"), f"{w}.function", "an object with 'name' and 'arguments'")
    _fields(fn, ("name", "arguments"), f"{w}.function")
    if not isinstance(fn.get("name"), str):
      raise protocol.BadRequest(f"{w}.function.name must be a string, got "
                                f"{protocol.show(fn.get('name'))}")
    args = fn.get("arguments")
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except ValueError:
        raise protocol.BadRequest(f"{w}.function.arguments is not JSON: "
                                  f"{protocol.show(fn['arguments'])}") from None
    if not isinstance(args, dict):
      raise protocol.BadRequest(f"{w}.function.arguments must be a JSON object (or a string "
                                f"holding one), got {protocol.show(fn.get('arguments'))}")
    if "id" in call and not isinstance(call["id"], str):
      raise protocol.BadRequest(f"{w}.id must be a string, got {protocol.show(call['id'])}")
    rendered = {"type": "function", "function": {"name": _text(fn["name"], f"{w}.function.name"),
                                                 "arguments": args}}
    if "id" in call:
      rendered = {"id": _text(call["id"], f"{w}.id"), **rendered}
    _text(json.dumps(args, ensure_ascii=False), f"{w}.function.arguments")
    out.append(rendered)
  return out


def parse_messages(messages: Any) -> list:
  """'messages' -> the list of message dicts the template renders (BadRequest naming the
  message and field otherwise)."""
  if not isinstance(messages, list) or not messages:
    raise protocol.BadRequest("'messages' must be a non-empty list of messages")
  out = []
  for i, m in enumerate(messages):
    where = f"'messages'[{i}]"
    if not isinstance(m, dict):
      raise protocol.BadRequest(f"{where} must be an object with 'role' and 'content', got "
                                f"{protocol.show(m)}")
    _fields(m, ("role", "content", *_MESSAGE_STRINGS, "tool_calls"), where)
    role = m.get("role")
    if role not in ROLES:
      raise protocol.BadRequest(f"{where}.role must be one of {list(ROLES)}, got "
                                f"{protocol.show(role)}")
    if m.get("tool_calls") is not None and role != "assistant":
      raise protocol.BadRequest(f"{where}.tool_calls: only an assistant message makes tool "
                                f"calls, this one is a {role} message")
    if "content" not in m and role != "assistant":
      raise protocol.BadRequest(f"{where}.content is required")
    msg = {"role": role}
    content = _content(m.get("content"), f"{where}.content", role)
    if content is not None:
      msg["content"] = content
    for name in _MESSAGE_STRINGS:
      v = m.get(name)
      if v is None:
        continue
      if not isinstance(v, str):
        raise protocol.BadRequest(f"{where}.{name} must be a string, got {protocol.show(v)}")
      msg[name] = _text(v, f"{where}.{name}")
    if m.get("tool_calls") is not None:
      msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    out.append(msg)
  return out


def render_prompt(messages: list, tokenizer, vocab_size: int,
                  tools: Optional[list] = None) -> list:
  """The prompt ids of `messages` (and `tools`): the chat template's text (with the generation
  prompt) encoded by the tokenizer, as transformers' `apply_chat_template(..., tools=tools,
  tokenize=True)` encodes it."""
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    what = "no tokenizer" if tokenizer is None else "no chat template"
    raise protocol.BadRequest(
        f"this model has {what} (its checkpoint has no chat_template.jinja or tokenizer_config "
        "'chat_template'), so it cannot take chat messages; send a prompt to /v1/completions")
  try:
    text = template.render(messages, add_generation_prompt=True, tools=tools)
  except chat_template.ChatTemplateError as e:
    msg = str(e)
    raise protocol.BadRequest("'messages': " + (msg if len(msg) <= _MAX_ERROR else
                                                msg[:_MAX_ERROR] + "...")) from None
  ids = tokenizer.encode(text)
  return protocol.token_list(ids, vocab_size, "'messages' (rendered and encoded)")


def parse_chat_request(body: Any, tokenizer, vocab_size: int, max_tokens_limit: int,
                       max_completions: int = protocol.MAX_COMPLETIONS_PER_REQUEST) -> dict:
  """Validates a chat completions request and renders its prompt.

  Args:
    body: the decoded JSON body.
    tokenizer: the served model's tokenizer; its `chat_template` renders the messages (none:
      the request is a 400 saying so).
    vocab_size: the model's vocabulary (rendered ids must lie in it).
    max_tokens_limit: the context length less one. Without `max_tokens` /
      `max_completion_tokens` a completion may fill the rest of the context.
    max_completions: most completions (`n`) one request may ask for.

  Returns:
    `protocol.parse_sampling`'s dict with prompts=[the prompt ids], logprobs=bool.

  Raises:
    protocol.BadRequest: with a message naming the field.
  """
  _refuse_deprecated(body)
  protocol.check_fields(body, _OPENAI_FIELDS | _EXTRA_FIELDS)
  if "messages" not in body:
    raise protocol.BadRequest("'messages' is required")
  n = protocol.parse_n(body)
  if n > max_completions:
    raise protocol.BadRequest(f"'n' asks for {n} completions; at most {max_completions} per "
                              "request (send several requests)")
  limit = max_tokens_limit
  old = protocol.parse_max_tokens(body, "max_tokens", None, limit)
  new = protocol.parse_max_tokens(body, "max_completion_tokens", None, limit)
  if old is not None and new is not None and old != new:
    raise protocol.BadRequest("'max_tokens' and 'max_completion_tokens' differ; send one "
                              "('max_tokens' is its older name)")
  max_tokens = new if new is not None else old
  logprobs = body.get("logprobs")
  if logprobs is not None and not isinstance(logprobs, bool):
    raise protocol.BadRequest(f"'logprobs' must be true or false, got {protocol.show(logprobs)}")
  top = body.get("top_logprobs")
  if top is not None:
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
      raise protocol.BadRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {protocol.show(top)}")
    if not logprobs:
      raise protocol.BadRequest("'top_logprobs' needs 'logprobs': true")
  tools = parse_tools(body)
  messages = parse_messages(body["messages"])
  prompt = render_prompt(messages, tokenizer, vocab_size, tools)
  if max_tokens is None:
    max_tokens = limit + 1 - len(prompt)
    if max_tokens < 1:
      raise protocol.BadRequest(f"'messages' fill the context: {len(prompt)} prompt tokens of "
                                f"{limit + 1}")
  req = protocol.parse_sampling(body, tokenizer, vocab_size, n=n, max_tokens=max_tokens,
                                logprobs=top or 0)
  req["prompts"] = [prompt]
  req["logprobs"] = bool(logprobs)
  return req


def _token_entry(tokenizer, t: int, lp: float) -> dict:
  """One token of OpenAI's chat `logprobs.content` (plus its id, which strings can collapse)."""
  s = tokenizer.decode([t]) if tokenizer is not None else str(t)
  return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "token_id": int(t)}


def logprobs_json(tokenizer, token_ids, logprobs, top=None) -> dict:
  """OpenAI's chat `logprobs` object: `content` has one entry per token (`token`, `logprob`,
  `bytes` -- the UTF-8 of the token's decoded text --, `top_logprobs`), each with `token_id`."""
  content = []
  for j, (t, lp) in enumerate(zip(token_ids, logprobs)):
    entry = _token_entry(tokenizer, t, lp)
    entry["top_logprobs"] = ([_token_entry(tokenizer, i, v) for i, v in top[j].items()]
                             if top is not None else [])
    content.append(entry)
  return {"content": content, "refusal": None}


def _extras(completion, req: dict) -> dict:
  versions = list(completion.policy_versions) if completion is not None else []
  out = {"policy_version": versions[-1] if versions else None, "policy_versions": versions}
  if req["return_routing"]:
    out["routing"] = (completion.routing.tolist()
                      if completion is not None and completion.routing is not None else None)
  return out


class ChatFormat:
  """How `/v1/chat/completions` shapes its answers (see `protocol.CompletionsFormat`): choices
  with a `message`, stream chunks with a `delta` (the first of each choice names the role and
  carries `prompt_token_ids`), `logprobs` only when asked, in the chat layout."""
  object = "chat.completion"
  chunk_object = "chat.completion.chunk"
  id_prefix = "chatcmpl"

  def choice(self, index: int, completion, tokenizer, req: dict, prompt_token_ids) -> dict:
    out = {"index": index, "message": {"role": "assistant", "content": completion.text},
           "logprobs": (logprobs_json(tokenizer, completion.token_ids, completion.logprobs,
                                      completion.top_logprobs) if req["logprobs"] else None),
           "finish_reason": completion.finish_reason,
           "token_ids": list(completion.token_ids),
           "prompt_token_ids": [int(t) for t in prompt_token_ids],
           **_extras(completion, req)}
    if req["return_prompt_routing"]:
      out["prompt_routing"] = (completion.prompt_routing.tolist()
                               if completion.prompt_routing is not None else None)
    return out

  def _delta(self, text: str, first: bool, req: dict) -> tuple:
    """(the chunk's `delta`, the fields only a choice's first chunk has)."""
    delta = {"role": "assistant"} if first else {}
    if text or first:
      delta["content"] = text
    extra = {"prompt_token_ids": [int(t) for t in req["prompts"][0]]} if first else {}
    return delta, extra

  def token_chunk(self, index: int, text: str, token_ids: list, logprobs: list, tokenizer,
                  req: dict, first: bool, top=None) -> dict:
    """A chunk of new tokens; `top`: their alternatives (None: not asked for)."""
    delta, extra = self._delta(text, first, req)
    return {"index": index, "delta": delta,
            "logprobs": (logprobs_json(tokenizer, token_ids, logprobs, top)
                         if req["logprobs"] else None),
            "finish_reason": None, "token_ids": token_ids, **extra}

  def final_chunk(self, index: int, text: str, finish_reason: str, completion, req: dict,
                  first: bool) -> dict:
    delta, extra = self._delta(text, first, req)
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            "token_ids": [], **extra, **_extras(completion, req)}
