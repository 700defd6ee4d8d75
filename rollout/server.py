"""HTTP front end of the sampler: OpenAI-compatible completions, health, metrics, admin swaps.

What:
  * public app: `POST /v1/completions` (plain or `stream: true` server-sent events),
    `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text);
  * admin app, on its own port and optionally token-protected (`Authorization: Bearer TOKEN`):
    `POST /admin/swap` {"checkpoint": DIR, "version": N}, `POST /admin/swap_delta?version=N`
    (body: a `sync.delta` blob), `GET /admin/status`.

Load handling: the engine's queue is bounded -- a full queue answers 429 with Retry-After; each
request may carry a `timeout` (default --request_timeout) after which it is ended and answered
504; a client that disconnects cancels its request (aiohttp handler cancellation), freeing its
slots. Every accepted request gets exactly one answer. Bad input is a 400 naming the field.

Threading: the engine runs its own thread; handlers submit and await `concurrent.futures`
through asyncio, and streaming receives per-chunk callbacks via `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Callable, Optional

from aiohttp import web

from rollout import metrics as metrics_lib
from rollout import protocol
from rollout.engine import Engine, EngineStopped, QueueFull

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def _json_error(status: int, message: str, kind: str = "invalid_request_error",
                headers: Optional[dict] = None) -> web.Response:
  return web.json_response(protocol.error_json(message, kind), status=status, headers=headers)


@web.middleware
async def _errors(request, handler):
  """Turns stray exceptions into JSON errors so one bad request never stops the server."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.content_type == "application/json" or e.status < 400:
      raise
    return _json_error(e.status, e.reason or str(e), "http_error")
  except asyncio.CancelledError:
    raise
  except Exception as e:  # noqa: BLE001 -- the last line of defence
    log.exception("unhandled error")
    return _json_error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class Server:
  """Serves one engine over HTTP (see the module docstring)."""

  def __init__(self, engine: Engine, *, model_name: str = "moe", admin_token: Optional[str] = None,
               request_timeout: Optional[float] = 600.0,
               load_flat: Optional[Callable[[str], dict]] = None):
    """Args:
      engine: a started Engine (its tokenizer encodes text prompts and decodes completions).
      model_name: reported by /v1/models and in responses.
      admin_token: if set, admin requests must send `Authorization: Bearer <admin_token>`.
      request_timeout: default per-request timeout in seconds (None: none).
      load_flat: path -> flat weights, for `/admin/swap` (e.g. rollout.loading.load_flat).
    """
    self.engine = engine
    self.tokenizer = engine.tokenizer
    self.model_name = model_name
    self.admin_token = admin_token
    self.request_timeout = request_timeout
    self.load_flat = load_flat
    self._runners: list = []
    self._swap_lock = asyncio.Lock()
    self.http_stats = {"http_400_total": 0, "http_429_total": 0, "http_504_total": 0,
                       "client_disconnects_total": 0}

  # ------------------------------------------------------------------ apps
  def app(self) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/health", self.health)
    app.router.add_get("/metrics", self.metrics)
    return app

  def admin_app(self) -> web.Application:
    app = web.Application(middlewares=[_errors, self._auth], client_max_size=16 * 1024**3)
    app.router.add_post("/admin/swap", self.admin_swap)
    app.router.add_post("/admin/swap_delta", self.admin_swap_delta)
    app.router.add_get("/admin/status", self.admin_status)
    return app

  async def start(self, host: str = "127.0.0.1", port: int = 0,
                  admin_port: Optional[int] = 0) -> tuple:
    """Starts listening; returns (port, admin_port) actually bound (0 picks a free port)."""
    ports = []
    for app, p in ((self.app(), port), (self.admin_app(), admin_port)):
      if p is None:
        ports.append(None)
        continue
      runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
      await runner.setup()
      site = web.TCPSite(runner, host, p)
      await site.start()
      self._runners.append(runner)
      ports.append(site._server.sockets[0].getsockname()[1])
    return tuple(ports)

  async def stop(self) -> None:
    for r in self._runners:
      await r.cleanup()
    self._runners = []

  # ------------------------------------------------------------------ public endpoints
  async def health(self, request) -> web.Response:
    ok = self.engine._thread is not None and self.engine._thread.is_alive()
    return web.json_response({"status": "ok" if ok else "stopped",
                              "policy_version": self.engine.version}, status=200 if ok else 503)

  async def models(self, request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout"}]})

  async def metrics(self, request) -> web.Response:
    extra = {f"rollout_{k}": ("counter", k.replace("_", " "), v)
             for k, v in self.http_stats.items()}
    return web.Response(text=metrics_lib.render(self.engine.metrics(), extra),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})

  def _bad(self, message: str) -> web.Response:
    self.http_stats["http_400_total"] += 1
    return _json_error(400, message)

  async def completions(self, request) -> web.StreamResponse:
    raw = await request.read()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return self._bad(f"malformed JSON body: {e}")
    eng = self.engine
    try:
      req = protocol.parse_completion_request(body, self.tokenizer, eng.model_config.vocab_size,
                                              max_tokens_limit=eng.max_len - 1)
    except protocol.BadRequest as e:
      return self._bad(str(e))
    timeout = req["timeout"] if req["timeout"] is not None else self.request_timeout
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    on_tokens = None
    if req["stream"]:
      def on_tokens(h, i, toks, lps, reason):  # engine thread
        loop.call_soon_threadsafe(events.put_nowait, (h.id, i, list(toks), list(lps), reason))
    handles = []
    try:
      for p in req["prompts"]:
        handles.append(eng.submit(p, req["params"], timeout=timeout, on_tokens=on_tokens))
    except ValueError as e:
      for h in handles:
        h.cancel()
      return self._bad(str(e))
    except QueueFull as e:
      for h in handles:
        h.cancel()
      self.http_stats["http_429_total"] += 1
      return _json_error(429, f"server busy: {e}; retry later", "rate_limit_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    except EngineStopped as e:
      for h in handles:
        h.cancel()
      return _json_error(503, str(e), "server_error")
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
      if req["stream"]:
        return await self._stream(request, req, handles, events, rid, created)
      results = await asyncio.gather(*(asyncio.wrap_future(h.future) for h in handles))
    except (asyncio.CancelledError, ConnectionResetError):
      self.http_stats["client_disconnects_total"] += 1
      for h in handles:
        h.cancel()
      raise
    if any(c.finish_reason == "timeout" for r in results for c in r):
      self.http_stats["http_504_total"] += 1
      return _json_error(504, f"request timed out after {timeout} s", "timeout_error")
    n = req["params"].n
    choices = [protocol.choice_json(pi * n + c.index, c, self.tokenizer,
                                    return_routing=req["return_routing"],
                                    return_prompt_routing=req["return_prompt_routing"])
               for pi, r in enumerate(results) for c in r]
    prompt_tokens = sum(len(p) for p in req["prompts"]) * n
    completion_tokens = sum(len(c.token_ids) for r in results for c in r)
    return web.json_response({
        "id": rid, "object": "text_completion", "created": created,
        "model": req["model"] or self.model_name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})

  async def _stream(self, request, req, handles, events, rid, created) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    n = req["params"].n
    order = {h.id: pi for pi, h in enumerate(handles)}
    tokens = {}  # choice index -> tokens so far
    sent_text = {}
    hold = bool(req["params"].stop)  # stop strings: text is final only once a choice ends
    model = req["model"] or self.model_name
    ended = 0
    total = len(handles) * n

    async def send(choice: dict) -> None:
      payload = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [choice]}
      await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

    while ended < total:
      hid, i, toks, lps, reason = await events.get()
      idx = order[hid] * n + i
      all_toks = tokens.setdefault(idx, [])
      all_toks.extend(toks)
      text = ""
      if self.tokenizer is not None and not hold:
        full = self.tokenizer.decode(all_toks)
        prev = sent_text.get(idx, "")
        text = full[len(prev):] if full.startswith(prev) else ""
        sent_text[idx] = prev + text
      if toks:
        await send({"index": idx, "text": text, "token_ids": toks,
                    "logprobs": protocol.logprobs_json(self.tokenizer, toks, lps),
                    "finish_reason": None})
      if reason is not None:
        ended += 1
    results = await asyncio.gather(*(asyncio.wrap_future(h.future) for h in handles))
    for pi, r in enumerate(results):
      for c in r:
        idx = pi * n + c.index
        prev = sent_text.get(idx, "")
        rest = c.text[len(prev):] if c.text.startswith(prev) else ""
        final = {"index": idx, "text": rest, "token_ids": [], "logprobs": None,
                 "finish_reason": c.finish_reason,
                 "policy_version": c.policy_versions[-1] if c.policy_versions else None,
                 "policy_versions": c.policy_versions}
        if req["return_routing"]:
          final["routing"] = c.routing.tolist() if c.routing is not None else None
        await send(final)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp

  # ------------------------------------------------------------------ admin
  @web.middleware
  async def _auth(self, request, handler):
    if self.admin_token is not None:
      if request.headers.get("Authorization") != f"Bearer {self.admin_token}":
        return _json_error(401, "missing or wrong admin token", "authentication_error")
    return await handler(request)

  def _version(self, value) -> int:
    if isinstance(value, str) and value.lstrip("-").isdigit():
      value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
      raise protocol.BadRequest(f"'version' must be an integer, got {value!r}")
    return value

  async def admin_status(self, request) -> web.Response:
    return web.json_response({"policy_version": self.engine.version,
                              "last_swap": self.engine.last_swap})

  async def admin_swap(self, request) -> web.Response:
    try:
      body = json.loads(await request.read())
      if not isinstance(body, dict) or set(body) - {"checkpoint", "version"}:
        raise protocol.BadRequest("body must be {\"checkpoint\": DIR, \"version\": N}")
      if not isinstance(body.get("checkpoint"), str):
        raise protocol.BadRequest("'checkpoint' must be a directory path")
      version = self._version(body.get("version"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return _json_error(400, f"malformed JSON body: {e}")
    except protocol.BadRequest as e:
      return _json_error(400, str(e))
    if self.load_flat is None:
      return _json_error(501, "this server was started without a checkpoint loader")
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        flat = await loop.run_in_executor(None, self.load_flat, body["checkpoint"])
        out = await loop.run_in_executor(None, self.engine.swap_weights, flat, version)
      except ValueError as e:  # missing/corrupt checkpoint, or weights of another model
        return _json_error(400, f"cannot swap to {body['checkpoint']!r}: {e}")
    return web.json_response(out)

  async def admin_swap_delta(self, request) -> web.Response:
    try:
      version = self._version(request.query.get("version"))
    except protocol.BadRequest as e:
      return _json_error(400, str(e))
    blob = await request.read()
    if not blob:
      return _json_error(400, "empty delta body")
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        out = await loop.run_in_executor(None, self.engine.swap_delta, blob, version)
      except ValueError as e:  # sync.delta.DeltaError is a ValueError
        return _json_error(400, f"cannot apply delta: {type(e).__name__}: {e}")
    return web.json_response(out)


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000,
          admin_port: Optional[int] = None, **server_kw) -> None:
  """Runs the server until interrupted (blocking)."""
  async def main():
    server = Server(engine, **server_kw)
    bound = await server.start(host, port, admin_port)
    log.info("serving on %s:%s (admin %s)", host, bound[0], bound[1])
    print(f"rollout server listening on http://{host}:{bound[0]} (admin port {bound[1]})",
          flush=True)
    try:
      await asyncio.Event().wait()
    finally:
      await server.stop()

  try:
    asyncio.run(main())
  except KeyboardInterrupt:
    pass
