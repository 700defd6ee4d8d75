"""A `Policy` that calls an OpenAI-compatible `POST /v1/completions` endpoint.

Works with the project's sampling server and with any OpenAI-compatible server (vLLM, SGLang,
llama.cpp, a hosted API). The project's server adds, per choice: `token_ids` (list[int]),
`routing` ([moe_layers][tokens][k]), `policy_version` (int) or `policy_versions` (per token), and
`logprobs.token_logprobs`. When a server omits token ids, the text is tokenized with the given
tokenizer and logprobs are kept only if their count matches.

Prompts are sent as token ids (the completions API accepts a list of ints) so the server sees
exactly the harness's tokens; `send_token_ids=False` sends text for servers that do not.
Servers drop the matched stop string from the text unless asked
(`include_stop_str_in_output`); when it is missing anyway it is re-appended from the request
so the parser sees it (those tokens are then not the model's: they have no logprobs).

Plain `urllib` on purpose: the harness runs episodes in threads, and this keeps the runtime
dependencies to the standard library.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np

from envs import policy as policy_lib


class OpenAIPolicy:
  """Policy over an OpenAI-compatible completions endpoint.

  Args:
    base_url: e.g. "http://127.0.0.1:8000" (the "/v1/completions" path is appended).
    model: the model name sent in requests.
    tokenizer: encode/decode matching the server's model.
    api_key: sent as a bearer token if given.
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
            "include_stop_str_in_output": True, **self.extra_body}
    if seed is not None:
      body["seed"] = seed
    data = self._post(body)
    choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
    if len(choices) != n:
      raise policy_lib.PolicyError(f"asked for {n} choices, got {len(choices)}")
    return [self._convert(c, stop) for c in choices]

  def _convert(self, c: dict, stop: Sequence[str]) -> policy_lib.Completion:
    text = c.get("text", "")
    finish = c.get("finish_reason") or "stop"
    ids = c.get("token_ids")
    own = [int(t) for t in ids] if ids is not None else self.encode(text)
    lp = (c.get("logprobs") or {}).get("token_logprobs")
    logprobs = [float(x) if x is not None else 0.0 for x in lp] if lp is not None else None
    if logprobs is not None and len(logprobs) != len(own):
      logprobs = None
    versions = c.get("policy_versions")
    if versions is None and c.get("policy_version") is not None:
      versions = [int(c["policy_version"])] * len(own)
    routing = c.get("routing")
    routing = np.asarray(routing, np.int32) if routing is not None else None
    if routing is not None and (routing.ndim != 3 or routing.shape[1] != len(own)):
      routing = None
    comp = policy_lib.Completion(token_ids=own, text=self.decode(own) if ids is not None
                                 else text, logprobs=logprobs, routing=routing,
                                 policy_versions=versions, finish_reason=finish)
    if finish == "stop" and stop and not any(comp.text.endswith(s) for s in stop):
      comp.stop_appended = self._missing_stop(comp.text, stop)
    return comp

  @staticmethod
  def _missing_stop(text: str, stop: Sequence[str]) -> str:
    """Which stop string the server swallowed: an open tool call closes with its tag."""
    if "<tool_call>" in text and "</tool_call>" in stop and \
        text.rfind("<tool_call>") > text.rfind("</tool_call>"):
      return "</tool_call>"
    return stop[-1]
