"""A small real HTTP server that speaks the OpenAI completions protocol, replaying scripted text.

For tests of the HTTP path (`openai_policy`) that a model cannot drive: multi-turn
tool-using episodes that solve a task, and the behaviour of other OpenAI-compatible servers
(vLLM-style `include_stop_str_in_output`, stop strings dropped, no extra fields, text prompts).
Real sockets, real JSON; it does not pretend to be a model: responses are scripted. With
`with_extras` it adds the project server's field names (`token_ids`, `routing`,
`policy_version`) in the contract's shapes, so routing and versions flow through an episode;
the project's server itself is tested in `tests/openai_policy_server_test.py`. It honours
`stop` (and `include_stop_str_in_output`), `max_tokens` and `n`, and records requests.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

from aiohttp import web


class ReplayServer:
  """Serves POST /v1/completions from a script, on 127.0.0.1 in a background thread.

  Args:
    responses: texts returned in order, or a function (prompt text, call index) -> text.
    tokenizer: encode/decode for prompts given as token ids and for `token_ids` in answers.
    moe_layers, top_k: shape of the scripted routing.
    policy_version: reported per choice.
    with_extras: include token_ids / routing / policy_version (False mimics a plain server).
    drop_stop: leave matched stop strings out even when asked to keep them (as many servers do).
  """

  def __init__(self, responses: Sequence[str] | Callable[[str, int], str], tokenizer: Any, *,
               moe_layers: int = 2, top_k: int = 2, policy_version: int = 7,
               with_extras: bool = True, drop_stop: bool = False):
    self.responses = responses
    self.tokenizer = tokenizer
    self.moe_layers, self.top_k = moe_layers, top_k
    self.policy_version = policy_version
    self.with_extras = with_extras
    self.drop_stop = drop_stop
    self.requests: list[dict] = []
    self._loop = asyncio.new_event_loop()
    self._started = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self.port = None

  def _next_text(self, prompt: str) -> str:
    i = len(self.requests) - 1
    if callable(self.responses):
      return self.responses(prompt, i)
    return self.responses[i] if i < len(self.responses) else "<|im_end|>"

  async def _complete(self, request: web.Request) -> web.Response:
    body = await request.json()
    self.requests.append(body)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
      prompt = self.tokenizer.decode(prompt)
    stops = body.get("stop") or []
    keep_stop = bool(body.get("include_stop_str_in_output")) and not self.drop_stop
    choices = []
    for index in range(int(body.get("n", 1))):
      text = self._next_text(prompt) if index == 0 else choices[0]["text"]
      finish = "length"
      hits = [(text.find(s), s) for s in stops if s in text]
      if hits:
        pos, s = min(hits)
        text = text[:pos + (len(s) if keep_stop else 0)]
        finish = "stop"
      ids = self.tokenizer.encode(text)
      if len(ids) > body.get("max_tokens", 16):
        ids = ids[:body["max_tokens"]]
        text, finish = self.tokenizer.decode(ids), "length"
      choice = {"index": index, "text": text, "finish_reason": finish,
                "logprobs": {"token_logprobs": [-0.25] * len(ids)}}
      if self.with_extras:
        choice["token_ids"] = ids
        choice["routing"] = [[[(t + layer + j) % 8 for j in range(self.top_k)] for t in ids]
                             for layer in range(self.moe_layers)]
        choice["policy_version"] = self.policy_version
      choices.append(choice)
    return web.json_response({"id": f"cmpl-{len(self.requests)}", "object": "text_completion",
                              "model": body.get("model", ""), "choices": choices})

  def _run(self) -> None:
    asyncio.set_event_loop(self._loop)
    app = web.Application()
    app.router.add_post("/v1/completions", self._complete)
    self._runner = web.AppRunner(app)
    self._loop.run_until_complete(self._runner.setup())
    site = web.TCPSite(self._runner, "127.0.0.1", 0)
    self._loop.run_until_complete(site.start())
    self.port = site._server.sockets[0].getsockname()[1]  # pylint: disable=protected-access
    self._started.set()
    self._loop.run_forever()

  @property
  def base_url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def __enter__(self) -> "ReplayServer":
    self._thread.start()
    self._started.wait(10)
    return self

  def __exit__(self, *exc) -> None:
    async def stop():
      await self._runner.cleanup()
    asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(10)
