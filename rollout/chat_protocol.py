"""OpenAI chat completions protocol: validating `POST /v1/chat/completions` bodies, rendering
their messages through the model's chat template, and shaping the answers.

What: `parse_chat_request(body, tokenizer, vocab_size, max_tokens_limit)` checks the messages,
renders them with the checkpoint's chat template (`tokenizer.chat_template`, see
`moe.chat_template`: the text transformers' `apply_chat_template(..., add_generation_prompt=True)`
gives) and encodes that text with the checkpoint's tokenizer -- the prompt ids a chat model was
trained on -- and parses the sampling fields as completions do (`protocol.parse_sampling`).
`ChatFormat` shapes choices, stream chunks (`delta`s) and logprobs the way OpenAI's chat API does,
with the sampler's extra fields of completions (`token_ids`, `prompt_token_ids`, `routing`,
`policy_version`, `policy_versions`, `prompt_routing`).

Why a module of its own: the chat fields (messages, `max_completion_tokens`, boolean `logprobs`
with `top_logprobs`) and answer shapes differ from completions, while everything after the
prompt ids -- queueing, sampling, streaming, timeouts -- is the completions path, which
`rollout.server` runs for both.
"""

from __future__ import annotations

from typing import Any

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
                  "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias"}
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
    unknown = sorted(set(m) - {"role", "content", *_MESSAGE_STRINGS}, key=str)
    if unknown:
      raise protocol.BadRequest(f"{where} has unknown field(s) {protocol.show(unknown)}; "
                                f"accepted: {['role', 'content', *_MESSAGE_STRINGS]}")
    role = m.get("role")
    if role not in ROLES:
      raise protocol.BadRequest(f"{where}.role must be one of {list(ROLES)}, got "
                                f"{protocol.show(role)}")
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
    out.append(msg)
  return out


def render_prompt(messages: list, tokenizer, vocab_size: int) -> list:
  """The prompt ids of `messages`: the chat template's text (with the generation prompt) encoded
  by the tokenizer, as transformers' `apply_chat_template(..., tokenize=True)` encodes it."""
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    what = "no tokenizer" if tokenizer is None else "no chat template"
    raise protocol.BadRequest(
        f"this model has {what} (its checkpoint has no chat_template.jinja or tokenizer_config "
        "'chat_template'), so it cannot take chat messages; send a prompt to /v1/completions")
  try:
    text = template.render(messages, add_generation_prompt=True)
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
  messages = parse_messages(body["messages"])
  prompt = render_prompt(messages, tokenizer, vocab_size)
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
                  req: dict, first: bool) -> dict:
    delta, extra = self._delta(text, first, req)
    return {"index": index, "delta": delta,
            "logprobs": logprobs_json(tokenizer, token_ids, logprobs) if req["logprobs"] else None,
            "finish_reason": None, "token_ids": token_ids, **extra}

  def final_chunk(self, index: int, text: str, finish_reason: str, completion, req: dict,
                  first: bool) -> dict:
    delta, extra = self._delta(text, first, req)
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            "token_ids": [], **extra, **_extras(completion, req)}
