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

This is the project's one completions client: the RL pipeline's HTTP samplers
(pipeline.samplers.HttpSampler) send their requests through `OpenAIPolicy.complete` and tell a
refused request (`ServerRejected`, not retried) from an unavailable server (`ServerUnavailable`,
retried elsewhere). `require` turns a field the caller cannot train without (routing, logprobs)
into a clear `MissingField` error when a server leaves it out.

Plain `urllib` on purpose: the harness runs episodes in threads, and this keeps the runtime
dependencies to the standard library.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np

from envs.harness import policy as policy_lib


class MalformedResponse(policy_lib.PolicyError):
  """The server answered, but a choice does not follow the completions contract."""


class MissingField(MalformedResponse):
  """A choice lacks a field the caller requires (e.g. routing the learner replays)."""


class ServerRejected(policy_lib.PolicyError):
  """The server refused the request itself (HTTP 4xx other than 429): another try, or another
  server of the same kind, would refuse it too. `status` is the HTTP code."""

  def __init__(self, message: str, status: int):
    super().__init__(message)
    self.status = status


class ServerUnavailable(policy_lib.PolicyError):
  """The server could not answer: connection refused or reset, a timeout, a body cut short,
  HTTP 429 or 5xx. Another try or another server may succeed."""


# What `require` may name, and why a learner needs each.
REQUIRABLE = {
    "token_ids": "the sampled token ids (token-in/token-out training)",
    "logprobs": "per-token log-probabilities (the off-policy correction)",
    "policy_versions": "per-token policy versions (the staleness bound)",
    "routing": "per-token MoE routing (router replay)",
    "prompt_routing": "the prompt's MoE routing (router replay over the whole sequence)",
}


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
    require: fields of REQUIRABLE every choice must carry; a server that leaves one out gets a
      `MissingField` naming it and why it is needed (e.g. an RL learner with router replay
      requires "token_ids", "logprobs" and "routing"), instead of training without it.
    bos_id: the model's BOS token, put at the head of every context (`start_ids`), or None.
  """

  def __init__(self, base_url: str, model: str, tokenizer: Any, *, api_key: str | None = None,
               timeout_s: float = 120.0, send_token_ids: bool = True,
               extra_body: dict | None = None, require: Sequence[str] = (),
               bos_id: int | None = None):
    unknown = sorted(set(require) - set(REQUIRABLE))
    if unknown:
      raise ValueError(f"require: unknown fields {unknown}; known: {sorted(REQUIRABLE)}")
    self.url = base_url.rstrip("/") + "/v1/completions"
    self.model = model
    self.tokenizer = tokenizer
    self.api_key = api_key
    self.timeout_s = timeout_s
    self.send_token_ids = send_token_ids
    self.extra_body = extra_body or {}
    self.require = tuple(require)
    self.bos_id = bos_id

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def start_ids(self) -> list[int]:
    return [] if self.bos_id is None else [int(self.bos_id)]

  def _post(self, body: dict, timeout_s: float | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
      with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
        raw = resp.read()
    except urllib.error.HTTPError as e:
      msg = f"{self.url}: HTTP {e.code}: {e.read()[:300]!r}"
      if e.code == 429 or e.code >= 500:
        raise ServerUnavailable(msg) from e
      raise ServerRejected(msg, e.code) from e
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
      raise ServerUnavailable(f"{self.url}: {e!r}") from e
    try:
      return json.loads(raw)
    except ValueError as e:  # a body cut short by a dying server
      raise ServerUnavailable(f"{self.url}: unreadable response ({e})") from e

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1,
               top_p=1.0, stop_token_ids=(), extra: dict | None = None,
               timeout_s: float | None = None):
    """`n` completions of `prompt_ids`; `extra` adds request fields (e.g. the project server's
    "return_routing"), `timeout_s` replaces the HTTP timeout for this request.
    `stop_token_ids` go as the request's "stop_token_ids" (the project's server and vLLM take
    it; the field is sent only when there are some, since strict servers refuse it)."""
    prompt: Any = list(prompt_ids) if self.send_token_ids else self.decode(prompt_ids)
    body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "n": n, "logprobs": 1, "stop": list(stop) or None,
            **self.extra_body, **(extra or {})}
    if top_p != 1.0:
      body["top_p"] = top_p
    if stop_token_ids:  # with any the caller's extra fields name
      body["stop_token_ids"] = list(dict.fromkeys(
          [*(body.get("stop_token_ids") or []), *(int(t) for t in stop_token_ids)]))
    if seed is not None:
      body["seed"] = seed
    data = self._post(body, timeout_s)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
      raise MalformedResponse(f"{self.url}: 'choices' must be a list of objects, got "
                              f"{str(choices)[:200]}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    if len(choices) != n:
      raise MalformedResponse(f"asked for {n} choices, got {len(choices)}")
    out = []
    for c in choices:
      for field in self.require:
        if c.get(field) is None and not (field == "logprobs" and
                                         (c.get("logprobs") or {}).get("token_logprobs")):
          raise MissingField(
              f"{self.url}: choice {c.get('index', 0)} has no {field!r}: the caller needs "
              f"{REQUIRABLE[field]}. Use a server that returns it (the project's rollout server "
              "does), or run without what needs it.")
      out.append(parse_choice(c, self.tokenizer, stop,
                              prompt_len=len(prompt_ids) if self.send_token_ids else None))
    return out


def parse_choice(c: dict, tokenizer: Any, stop: Sequence[str] = (),
                 prompt_len: int | None = None) -> policy_lib.Completion:
  """One `choices[i]` object of a completions response -> Completion (see the module docstring).

  Args:
    c: the decoded JSON choice.
    tokenizer: encode/decode of the server's model.
    stop: the stop strings the request sent.
    prompt_len: tokens of the prompt sent, to check `prompt_routing` covers positions
      0..prompt_len-2 (None: not checked).

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

  prompt_routing = c.get("prompt_routing")
  if prompt_routing is not None:
    try:
      prompt_routing = np.asarray(prompt_routing, np.int32)
    except (ValueError, TypeError) as e:
      raise MalformedResponse(f"{where}: 'prompt_routing' is not a [moe_layers][positions][k] "
                              f"array of expert ids: {e}") from e
    want = None if prompt_len is None else max(prompt_len - 1, 0)
    if prompt_routing.ndim != 3 or (want is not None and prompt_routing.shape[1] != want):
      raise MalformedResponse(
          f"{where}: 'prompt_routing' has shape {prompt_routing.shape}, expected "
          f"(moe_layers, {want if want is not None else 'prompt tokens - 1'}, k)")

  text = tokenizer.decode(own) if exact else server_text
  comp = policy_lib.Completion(token_ids=own, text=text, logprobs=logprobs, routing=routing,
                               policy_versions=versions, finish_reason=finish,
                               prompt_routing=prompt_routing)
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
