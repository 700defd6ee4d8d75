"""A `Policy` that calls an OpenAI-compatible `POST /v1/completions` endpoint.

Works with the project's sampling server (`rollout.server`) and with any OpenAI-compatible server
(vLLM, SGLang, llama.cpp, a hosted API). The project's server adds, per choice: `token_ids`
(list[int]), `routing` ([moe_layers][tokens][k], one row per token id), `policy_version` (int)
and `policy_versions` (per token), next to `logprobs.token_logprobs`. A server that omits token
ids has its text tokenized with the given tokenizer; logprobs and per-token versions are then
kept only if their count matches (they belong to the server's tokens, which are unknown).

A choice that breaks this contract -- token ids given but routing, logprobs or versions of
another length, ragged routing -- raises `MalformedResponse` (a `PolicyError`, so the episode
ends as an infrastructure failure) rather than being dropped: training on a completion whose
routing was silently lost would replay the wrong experts, or none. A choice without `routing`
(a dense model, a plain server) is legitimate and gives `routing=None`.

Prompts are sent as token ids (the completions API accepts a list of ints) so the server sees
exactly the harness's tokens; `send_token_ids=False` sends text for servers that do not.

Stop strings: servers leave the matched stop string out of `text`. Nothing non-standard is sent
to keep it, because strict servers (the project's, OpenAI's) refuse unknown fields; vLLM and
SGLang keep it when given `extra_body={"include_stop_str_in_output": True}`. The project's
server keeps, in `token_ids`, every token up to the one that completes the stop string, so the
whole stop string is in the decoded ids (with any text its last token carries after it). Whatever
part is missing (from servers that return less) is reported as
`Completion.stop_appended` so that the harness adds it as template tokens (not the model's:
they have no logprobs) and the parser sees the whole stop string.

Plain `urllib` on purpose: the harness runs episodes in threads, and this keeps the runtime
dependencies to the standard library.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np

from envs.harness import policy as policy_lib


class MalformedResponse(policy_lib.PolicyError):
  """The server answered, but a choice does not follow the completions contract."""


class OpenAIPolicy:
  """Policy over an OpenAI-compatible completions endpoint.

  Args:
    base_url: e.g. "http://127.0.0.1:8000" (the "/v1/completions" path is appended).
    model: the model name sent in requests.
    tokenizer: encode/decode matching the server's model.
    api_key: sent as a bearer token if given.
    timeout_s: per-request HTTP timeout.
    send_token_ids: send the prompt as token ids (default) rather than text.
    extra_body: merged into every request (e.g. {"top_p": 0.95}).
  """

  def __init__(self, base_url: str, model: str, tokenizer: Any, *, api_key: str | None = None,
               timeout_s: float = 120.0, send_token_ids: bool = True,
               extra_body: dict | None = None):
    self.url = base_url.rstrip("/") + "/v1/completions"
    self.model = model
    self.tokenizer = tokenizer
    self.api_key = api_key
    self.timeout_s = timeout_s
    self.send_token_ids = send_token_ids
    self.extra_body = extra_body or {}

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def _post(self, body: dict) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
      with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
        return json.loads(resp.read())
    except urllib.error.HTTPError as e:
      raise policy_lib.PolicyError(f"{self.url}: HTTP {e.code}: {e.read()[:300]!r}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
      raise policy_lib.PolicyError(f"{self.url}: {e}") from e

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1):
    prompt: Any = list(prompt_ids) if self.send_token_ids else self.decode(prompt_ids)
    body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "n": n, "logprobs": 1, "stop": list(stop) or None,
            **self.extra_body}
    if seed is not None:
      body["seed"] = seed
    data = self._post(body)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
      raise MalformedResponse(f"{self.url}: 'choices' must be a list of objects, got "
                              f"{str(choices)[:200]}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    if len(choices) != n:
      raise policy_lib.PolicyError(f"asked for {n} choices, got {len(choices)}")
    return [parse_choice(c, self.tokenizer, stop) for c in choices]


def parse_choice(c: dict, tokenizer: Any, stop: Sequence[str] = ()) -> policy_lib.Completion:
  """One `choices[i]` object of a completions response -> Completion (see the module docstring).

  Args:
    c: the decoded JSON choice.
    tokenizer: encode/decode of the server's model.
    stop: the stop strings the request sent.

  Raises:
    MalformedResponse: the choice breaks the contract (the message says which field, what shape
      was expected and what came).
  """
  where = f"choice {c.get('index', 0)}"
  server_text = c.get("text") or ""
  finish = c.get("finish_reason") or "stop"
  ids = c.get("token_ids")
  if ids is not None and (not isinstance(ids, list) or
                          not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
    raise MalformedResponse(f"{where}: 'token_ids' must be a list of integers, got "
                            f"{str(ids)[:200]}")
  exact = ids is not None  # per-token fields are aligned with tokens we hold
  own = list(ids) if exact else tokenizer.encode(server_text)
  n = len(own)

  lp = (c.get("logprobs") or {}).get("token_logprobs")
  logprobs = [float(x) if x is not None else 0.0 for x in lp] if lp is not None else None
  if logprobs is not None and len(logprobs) != n:
    if exact:
      raise MalformedResponse(f"{where}: {len(logprobs)} token_logprobs for {n} token_ids")
    logprobs = None

  versions = c.get("policy_versions")
  if versions is not None:
    versions = [int(v) for v in versions]
    if len(versions) != n:
      if exact:
        raise MalformedResponse(f"{where}: {len(versions)} policy_versions for {n} token_ids")
      versions = None
  if versions is None and c.get("policy_version") is not None:
    versions = [int(c["policy_version"])] * n

  routing = c.get("routing")
  if routing is not None:
    try:
      routing = np.asarray(routing, np.int32)
    except (ValueError, TypeError) as e:
      raise MalformedResponse(f"{where}: 'routing' is not a [moe_layers][tokens][k] array of "
                              f"expert ids: {e}") from e
    if routing.ndim != 3 or routing.shape[1] != n:
      raise MalformedResponse(
          f"{where}: 'routing' has shape {routing.shape}, expected (moe_layers, {n}, k): one "
          f"row of k experts per layer for each of the {n} completion tokens")

  text = tokenizer.decode(own) if exact else server_text
  comp = policy_lib.Completion(token_ids=own, text=text, logprobs=logprobs, routing=routing,
                               policy_versions=versions, finish_reason=finish)
  if finish == "stop" and stop and not any(text.endswith(s) for s in stop):
    # What the model wrote of the stop string: the decoded ids beyond the server's text. A
    # whole stop string there (its last token went on past it) needs nothing added.
    written = text[len(server_text):] if exact and text.startswith(server_text) else ""
    if not any(s in written for s in stop):
      comp.stop_appended = _missing_stop(text, stop, written)
  return comp


def _missing_stop(text: str, stop: Sequence[str], written: str = "") -> str:
  """The rest of the stop string the server matched, given the part of it the ids hold.

  Among the stop strings that begin with `written`, an open tool call closes with its tag;
  otherwise the last one is taken (the chat end in the harness's lists).
  """
  fits = [s for s in stop if len(s) > len(written) and s.startswith(written)] or list(stop)
  if written and not any(s.startswith(written) for s in stop):
    written = ""
  if "</tool_call>" in fits and "<tool_call>" in text and \
      text.rfind("<tool_call>") > text.rfind("</tool_call>"):
    return "</tool_call>"[len(written):]
  return fits[-1][len(written):]
