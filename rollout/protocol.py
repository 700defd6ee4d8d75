"""OpenAI completions protocol: validating request bodies and shaping responses.

What: `parse_completion_request(body, tokenizer, vocab_size)` turns a decoded JSON body of
`POST /v1/completions` into prompts (token-id lists) and `SamplingParams`, raising `BadRequest`
with a message that names the offending field; `parse_sampling` is the part chat completions
share (`rollout.chat_protocol`). `CompletionsFormat` (with `choice_json`, `logprobs_json`) builds
the response objects and stream chunks, adding the sampler's extra fields (`token_ids`,
`prompt_token_ids`, `routing`, `policy_version`, `policy_versions`, `prompt_routing`) next to the
OpenAI ones; `usage_json` the usage of both endpoints.

Why strict: RL clients and users both send to this endpoint; an unknown or mistyped field is far
more often a bug than an intent, so it is rejected (400) rather than silently ignored.
"""

from __future__ import annotations

import reprlib
from typing import Any, Optional

from rollout.sampling import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 128
# Default cap on prompts x n of one request (rollout.server.Server's max_completions_per_request):
# one request must not hold every slot and the whole queue, nor build a response of tens of MB.
MAX_COMPLETIONS_PER_REQUEST = 256
MAX_STOP_STRINGS = 16  # OpenAI allows 4; the coding environments send 5 (envs.harness.single_turn.STOP)

# Fields the OpenAI client may send that we accept (with their meaning below) and our extras.
_OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
                  "logprobs", "stop", "seed", "user", "echo", "presence_penalty",
                  "frequency_penalty", "best_of", "logit_bias", "suffix", "stream_options"}
_EXTRA_FIELDS = {"top_k", "stop_token_ids", "ignore_eos", "timeout", "return_routing",
                 "return_prompt_routing"}


class BadRequest(ValueError):
  """A client error; the message is returned in the 400 response."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlong = 24


def show(value) -> str:
  """A short repr of a client's value for an error message (a 1 MB string stays ~40 chars)."""
  return _REPR.repr(value)


def _int(body, name, default, lo=None, hi=None):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    raise BadRequest(f"'{name}' must be an integer, got {type(v).__name__} {show(v)}")
  if lo is not None and v < lo:
    raise BadRequest(f"'{name}' must be >= {lo}, got {show(v)}")
  if hi is not None and v > hi:
    raise BadRequest(f"'{name}' must be <= {hi}, got {show(v)}")
  return v


def _num(body, name, default, lo, hi):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
    raise BadRequest(f"'{name}' must be a number, got {show(v)}")
  if not lo <= v <= hi:
    raise BadRequest(f"'{name}' must lie in [{lo}, {hi}], got {show(v)}")
  return float(v)


def _bool(body, name, default):
  v = body.get(name, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise BadRequest(f"'{name}' must be true or false, got {show(v)}")
  return v


def token_list(x, vocab_size: int, where: str) -> list:
  """`x` as a non-empty list of token ids in the vocabulary (BadRequest naming `where`)."""
  if not x:
    raise BadRequest(f"{where} is empty")
  for i, t in enumerate(x):
    if isinstance(t, bool) or not isinstance(t, int):
      raise BadRequest(f"{where}[{i}] must be an integer token id, got {show(t)}")
    if not 0 <= t < vocab_size:
      raise BadRequest(f"{where}[{i}] = {show(t)} is outside the vocabulary (size {vocab_size})")
  return list(x)


def parse_prompts(prompt: Any, tokenizer, vocab_size: int) -> list:
  """'prompt' as text, token ids, or a list of either -> list of token-id lists."""
  def text(s, where):
    if tokenizer is None:
      raise BadRequest(f"{where} is text but this model has no tokenizer; send token ids")
    try:
      s.encode("utf-8")  # JSON can carry lone surrogates ("\ud800"), which no tokenizer takes
    except UnicodeEncodeError as e:
      raise BadRequest(f"{where} is not valid Unicode: a lone surrogate at character "
                       f"{e.start}") from None
    ids = tokenizer.encode(s)
    return token_list(ids, vocab_size, f"{where} (encoded)")

  if isinstance(prompt, str):
    return [text(prompt, "'prompt'")]
  if isinstance(prompt, list) and prompt:
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      return [token_list(prompt, vocab_size, "'prompt'")]
    out = []
    for i, p in enumerate(prompt):
      where = f"'prompt'[{i}]"
      if isinstance(p, str):
        out.append(text(p, where))
      elif isinstance(p, list):
        out.append(token_list(p, vocab_size, where))
      else:
        raise BadRequest(f"{where} must be a string or a list of token ids, got {show(p)}")
    return out
  if isinstance(prompt, list):
    raise BadRequest("'prompt' is empty")
  raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those; "
                   f"got {type(prompt).__name__}")


def _count_prompts(prompt: Any) -> int:
  """How many prompts 'prompt' holds (without tokenizing any)."""
  if isinstance(prompt, list) and prompt and not all(
      isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    return len(prompt)
  return 1


def check_fields(body: Any, accepted: set) -> None:
  """The body is a JSON object with no field outside `accepted` (BadRequest naming them)."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  unknown = sorted(set(body) - accepted)
  if unknown:
    names = ", ".join(show(k) for k in unknown[:5]) + (
        f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    raise BadRequest(f"unknown field(s) {names}; accepted: {sorted(accepted)}")


def parse_n(body: dict) -> int:
  return _int(body, "n", 1, 1, MAX_N)


def parse_max_tokens(body: dict, name: str, default: Optional[int], limit: int) -> Optional[int]:
  """`body[name]`, an integer in [1, limit] (the context less one prompt token)."""
  return _int(body, name, default, 1, limit)


def parse_sampling(body: dict, tokenizer, vocab_size: int, *, n: int, max_tokens: int,
                   logprobs: int) -> dict:
  """The fields completions and chat completions share: sampling settings, stop strings and ids,
  streaming, timeout and the sampler's extras.

  Args:
    body: the request (its fields already checked against the endpoint's accepted set).
    n, max_tokens, logprobs: parsed by the endpoint (their spelling differs between the two).

  Returns:
    dict(params=SamplingParams, stream=bool, include_usage=bool, timeout=float or None,
    return_routing=bool, return_prompt_routing=bool, model=str or None).
  """
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise BadRequest("'model' must be a string")
  for name in ("presence_penalty", "frequency_penalty"):
    if _num(body, name, 0.0, -2.0, 2.0) != 0.0:
      raise BadRequest(f"'{name}' is not supported (only 0)")
  if body.get("logit_bias"):
    raise BadRequest("'logit_bias' is not supported")
  so = body.get("stream_options")
  if so is not None and not isinstance(so, dict):
    raise BadRequest("'stream_options' must be an object")
  so = so or {}
  if set(so) - {"include_usage"}:
    raise BadRequest(f"'stream_options' takes only 'include_usage', got "
                     f"{show(sorted(so, key=str))}")
  include_usage = _bool(so, "include_usage", False)
  stop = body.get("stop")
  if stop is None:
    stop = []
  elif isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise BadRequest("'stop' must be a non-empty string or a list of them")
  if len(stop) > MAX_STOP_STRINGS:
    raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings")
  if stop and tokenizer is None:
    raise BadRequest("'stop' strings need a tokenizer; use 'stop_token_ids'")
  stop_ids = body.get("stop_token_ids")
  if stop_ids is None:
    stop_ids = []
  if not isinstance(stop_ids, list):
    raise BadRequest(f"'stop_token_ids' must be a list of token ids, got {show(stop_ids)}")
  if stop_ids:
    token_list(stop_ids, vocab_size, "'stop_token_ids'")
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise BadRequest(f"'seed' must be an integer, got {show(seed)}")
  if seed is not None and not -2**63 <= seed < 2**64:
    raise BadRequest("'seed' is out of range")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise BadRequest("'user' must be a string")
  timeout = body.get("timeout")
  if timeout is not None:
    timeout = _num(body, "timeout", None, 0.001, 24 * 3600)
  try:
    params = SamplingParams(
        n=n, max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1.0), top_k=_int(body, "top_k", 0, 0),
        stop_token_ids=tuple(stop_ids), stop=tuple(stop), seed=seed,
        ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs)
  except ValueError as e:
    msg = str(e)  # names the field; kept short should it quote a client's value
    raise BadRequest(msg if len(msg) <= 300 else msg[:300] + "...") from None
  return {"params": params, "stream": _bool(body, "stream", False),
          "include_usage": include_usage, "timeout": timeout,
          "return_routing": _bool(body, "return_routing", True),
          "return_prompt_routing": _bool(body, "return_prompt_routing", False), "model": model}


def parse_completion_request(body: Any, tokenizer, vocab_size: int,
                             max_tokens_limit: int,
                             max_completions: int = MAX_COMPLETIONS_PER_REQUEST) -> dict:
  """Validates a completions request.

  `max_completions` caps prompts x n; it is checked before any text prompt is tokenized.

  Returns:
    `parse_sampling`'s dict and prompts=[token-id lists].

  Raises:
    BadRequest: with a message naming the field.
  """
  check_fields(body, _OPENAI_FIELDS | _EXTRA_FIELDS)
  if "prompt" not in body:
    raise BadRequest("'prompt' is required")
  n = parse_n(body)
  count = _count_prompts(body["prompt"]) * n
  if count > max_completions:
    raise BadRequest(f"'prompt' x 'n' asks for {count} completions; at most {max_completions} "
                     "per request (send several requests)")
  prompts = parse_prompts(body["prompt"], tokenizer, vocab_size)
  best_of = _int(body, "best_of", None, 1)
  if best_of is not None and best_of != n:
    raise BadRequest("'best_of' is not supported (it must equal 'n' when given)")
  max_tokens = parse_max_tokens(body, "max_tokens", 16, max_tokens_limit)
  logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
  if _bool(body, "echo", False):
    raise BadRequest("'echo' is not supported")
  if body.get("suffix") is not None:
    raise BadRequest("'suffix' is not supported")
  req = parse_sampling(body, tokenizer, vocab_size, n=n, max_tokens=max_tokens,
                       logprobs=logprobs or 0)
  req["prompts"] = prompts
  return req


def _token_str(tokenizer, t: int) -> str:
  return tokenizer.decode([t]) if tokenizer is not None else str(t)


def logprobs_json(tokenizer, token_ids, logprobs, top=None, offset: int = 0) -> dict:
  """OpenAI completions `logprobs` object.

  `top` is a list (per token) of {token id: logprob}; in the JSON each becomes
  {token string: logprob} as OpenAI does (ids that decode to the same string collapse to one
  entry; `top_logprob_ids` keeps them by id).
  """
  toks = [_token_str(tokenizer, t) for t in token_ids]
  offsets, pos = [], offset
  for s in toks:
    offsets.append(pos)
    pos += len(s)
  out = {"tokens": toks, "token_logprobs": list(logprobs), "top_logprobs": None,
         "text_offset": offsets}
  if top is not None:
    out["top_logprobs"] = [{_token_str(tokenizer, i): v for i, v in d.items()} for d in top]
    out["top_logprob_ids"] = [[[i, v] for i, v in d.items()] for d in top]
  return out


def choice_json(index: int, completion, tokenizer, *, return_routing: bool,
                return_prompt_routing: bool, prompt_token_ids=None) -> dict:
  """One `choices[i]` entry with the sampler's extra fields (logprobs are always included).

  `prompt_token_ids`: the ids the choice's prompt was sampled from (a text prompt as the
  server's tokenizer encoded it), so a client can record exactly what the model saw (vLLM's
  field of the same name); left out when None.
  """
  versions = list(completion.policy_versions)
  out = {"index": index, "text": completion.text,
         "logprobs": logprobs_json(tokenizer, completion.token_ids, completion.logprobs,
                                   completion.top_logprobs),
         "finish_reason": completion.finish_reason,
         "token_ids": list(completion.token_ids),
         "policy_version": versions[-1] if versions else None,
         "policy_versions": versions}
  if prompt_token_ids is not None:
    out["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
  if return_routing:
    out["routing"] = (completion.routing.tolist()
                      if completion.routing is not None else None)
  if return_prompt_routing:
    out["prompt_routing"] = (completion.prompt_routing.tolist()
                             if completion.prompt_routing is not None else None)
  return out


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
  """OpenAI's `usage`. `prompt_tokens` counts a request's prompt once per completion, and
  `cached_tokens` (of those, the ones the prefix cache served) the same way."""
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _versions(completion) -> dict:
  versions = list(completion.policy_versions) if completion is not None else []
  return {"policy_version": versions[-1] if versions else None, "policy_versions": versions}


class CompletionsFormat:
  """How `/v1/completions` shapes its answers (`rollout.server` and `rollout.streaming` build
  every response through such a format; `rollout.chat_protocol.ChatFormat` is the chat one).

  Streaming: `token_chunk` per engine chunk of a choice, `final_chunk` once per choice (the rest
  of its text, finish reason, versions and routing; `completion` None when the engine failed or
  timed out). `first` is true for the first chunk sent for a choice.
  """
  object = "text_completion"
  chunk_object = "text_completion"
  id_prefix = "cmpl"

  def choice(self, index: int, completion, tokenizer, req: dict, prompt_token_ids) -> dict:
    return choice_json(index, completion, tokenizer, return_routing=req["return_routing"],
                       return_prompt_routing=req["return_prompt_routing"],
                       prompt_token_ids=prompt_token_ids)

  def token_chunk(self, index: int, text: str, token_ids: list, logprobs: list, tokenizer,
                  req: dict, first: bool, top=None) -> dict:
    """A chunk of new tokens; `top`: their alternatives (None: not asked for)."""
    del req, first  # the same for every chunk
    return {"index": index, "text": text, "token_ids": token_ids,
            "logprobs": logprobs_json(tokenizer, token_ids, logprobs, top),
            "finish_reason": None}

  def final_chunk(self, index: int, text: str, finish_reason: str, completion, req: dict,
                  first: bool) -> dict:
    del first
    out = {"index": index, "text": text, "token_ids": [], "logprobs": None,
           "finish_reason": finish_reason, **_versions(completion)}
    if req["return_routing"]:
      out["routing"] = (completion.routing.tolist()
                        if completion is not None and completion.routing is not None else None)
    return out


def error_json(message: str, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
  return {"error": {"message": message, "type": kind, "param": None, "code": code}}
