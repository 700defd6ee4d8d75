"""HTTP front end of the sampler: OpenAI-compatible completions and chat completions, health,
metrics, admin swaps.

What:
  * public app: `POST /v1/completions` and `POST /v1/chat/completions` (plain or `stream: true`
    server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text);
  * admin app (`rollout.admin`), on its own port: weight swaps and swap status. Streaming is
    `rollout.streaming`; the error bodies both apps share are `rollout.http_common`.

One path for both endpoints: each parses its body into prompt ids and sampling settings
(`protocol.parse_completion_request`; `chat_protocol.parse_chat_request` renders the messages
through the checkpoint's chat template first), then `_generate` queues, awaits or streams, and
answers through the endpoint's format (`protocol.CompletionsFormat`, `chat_protocol.ChatFormat`).

Load handling: the engine's queue is bounded -- a full queue answers 429 with Retry-After; each
request may carry a `timeout` (default --request_timeout) after which it is ended and answered
504; a client that disconnects cancels its request (aiohttp handler cancellation), freeing its
slots. Every accepted request gets exactly one answer. Bad input is a 400 naming the field.

Warm-up (`warmup=True`, what //tools:serve does unless told `--no_warmup`): once listening,
the server compiles every device program a request can reach (`Engine.warm_up`) in a thread of
its own, logging a progress line per program; until that is done `/health` answers 503
("warming_up", with the count), so a load balancer or a waiting client holds off. Requests sent
meanwhile are served, each compiling what it needs. With the admin app listening, the warm-up
also readies the numba kernels `/admin/swap_delta` decodes with (`sync.delta.warm_up`), so the
first delta costs what later ones do.

Threading: the engine runs its own thread; handlers submit and await `concurrent.futures`
through asyncio, and streaming receives per-chunk callbacks via `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

from aiohttp import web

from rollout import admin as admin_lib
from rollout import chat_protocol
from rollout import http_common
from rollout import metrics as metrics_lib
from rollout import protocol
from rollout import streaming
from rollout.engine import Engine, EngineStopped, QueueFull

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# How long past a request's timeout the handler waits for the engine before answering 504
# itself: the engine ends timed-out requests on its own, unless its loop is stuck.
TIMEOUT_GRACE_S = 2.0


_json_error = http_common.json_error


class Server:
  """Serves one engine over HTTP (see the module docstring)."""

  def __init__(self, engine: Engine, *, model_name: str = "moe", admin_token: Optional[str] = None,
               request_timeout: Optional[float] = 600.0,
               max_completions_per_request: int = protocol.MAX_COMPLETIONS_PER_REQUEST,
               load_flat: Optional[Callable[[str], dict]] = None,
               health_checks: Sequence[Callable[[], Optional[str]]] = (),
               admin_token_file: Optional[str] = None, checkpoint_root: Optional[str] = None,
               max_delta_bytes: Optional[int] = None, admin_allowed_hosts: Sequence[str] = (),
               warmup: bool = False, warmup_threads: int = 1):
    """Args:
      engine: a started Engine, or a `rollout.replicas.ReplicaSet` of them (requests spread over
        the replicas, swaps reach all, /metrics adds each replica's series); its tokenizer
        encodes text prompts and decodes completions.
      model_name: reported by /v1/models and in responses.
      admin_token: the token admin requests must send as `Authorization: Bearer <token>`; None
        generates one (`self.admin.token`): the admin app never runs without a token.
      request_timeout: default per-request timeout in seconds (None: none).
      max_completions_per_request: most completions (prompts x n) one request may ask for; more
        is a 400 naming the limit.
      load_flat: path -> flat weights, for `/admin/swap` (e.g. rollout.loading.load_flat).
      health_checks: callables polled by `/health`; each returns None when its part is fine or a
        sentence saying what is wrong (e.g. a weight-sync thread that died, weights stale beyond
        a bound), which makes `/health` answer 503 with those sentences under "problems".
      admin_token_file: written with the admin token (mode 0600) when the admin app starts.
      checkpoint_root: the only directory `/admin/swap` reads checkpoints under (None: off).
      max_delta_bytes: body limit of `/admin/swap_delta` (default: from the weights' size).
      admin_allowed_hosts: extra names accepted in the admin requests' Host/Origin headers.
      warmup: compile the engine's programs once listening (`start`); `/health` answers 503
        until that is done, or names its error if it failed.
      warmup_threads: programs compiled at once.
    """
    self.engine = engine
    self.tokenizer = engine.tokenizer
    self.model_name = model_name
    self.request_timeout = request_timeout
    self.max_completions_per_request = max_completions_per_request
    self.health_checks = tuple(health_checks)
    self.admin = admin_lib.Admin(engine, token=admin_token, token_file=admin_token_file,
                                 load_flat=load_flat, checkpoint_root=checkpoint_root,
                                 max_delta_bytes=max_delta_bytes,
                                 allowed_hosts=admin_allowed_hosts)
    self._runners: list = []
    self.warmup_threads = warmup_threads
    # While set, /health is not ready: {"done", "total", "error"} of the warm-up under way.
    self.warmup_state: Optional[dict] = ({"done": 0, "total": None, "error": None} if warmup
                                         else None)
    self.warmup_result: Optional[asyncio.Future] = None  # its counts (Engine.warm_up)
    self._warmup_stop = threading.Event()
    self._accepts_deltas = False  # the admin app listens: /admin/swap_delta may come
    self.http_stats = {"http_400_total": 0, "http_429_total": 0, "http_504_total": 0,
                       "client_disconnects_total": 0}

  # ------------------------------------------------------------------ apps
  def app(self) -> web.Application:
    app = web.Application(middlewares=[http_common.errors], client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_post("/v1/chat/completions", self.chat_completions)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/health", self.health)
    app.router.add_get("/metrics", self.metrics)
    return app

  def admin_app(self) -> web.Application:
    return self.admin.app()

  async def start(self, host: str = "127.0.0.1", port: int = 0,
                  admin_port: Optional[int] = 0, admin_host: str = "127.0.0.1") -> tuple:
    """Starts listening; returns (port, admin_port) actually bound (0 picks a free port).

    The admin app (unless `admin_port` is None) listens on `admin_host`, loopback unless told
    otherwise, whatever `host` the public app is on; its token file is written before it listens.
    With `warmup`, the warm-up starts once both listen; `warmup_result` then resolves to its
    counts (or its error).
    """
    ports = []
    for is_admin, h, p in ((False, host, port), (True, admin_host, admin_port)):
      if p is None:
        ports.append(None)
        continue
      if is_admin:
        self.admin.publish_token()
      app = self.admin_app() if is_admin else self.app()
      runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
      await runner.setup()
      site = web.TCPSite(runner, h, p)
      await site.start()
      self._runners.append(runner)
      ports.append(site._server.sockets[0].getsockname()[1])
      if is_admin:
        self.admin.bind(h, ports[-1])
        self._accepts_deltas = True
    if self.warmup_state is not None and self.warmup_result is None:
      self.warmup_result = self._start_warmup()
    return tuple(ports)

  def _start_warmup(self) -> asyncio.Future:
    """Runs `Engine.warm_up` in a daemon thread (a process that exits does not wait for it);
    returns a future of its counts, resolved on this loop."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()
    state = self.warmup_state

    def progress(done: int, total: int, what: str) -> None:
      state["done"], state["total"] = done, total
      if done == 0:
        log.info("warm-up: compiling %d device programs (%s), %d at a time", total, what,
                 self.warmup_threads)
      else:
        log.info("warm-up: compiled %d/%d: %s", done, total, what)

    def settle(value, error) -> None:
      if result.done():
        return
      if error is None:
        result.set_result(value)
      else:
        result.set_exception(error)

    def run() -> None:
      try:
        out, err = self.engine.warm_up(progress, threads=self.warmup_threads,
                                       stop=self._warmup_stop), None
      except Exception as e:  # noqa: BLE001 -- reported by /health and the log, not raised here
        log.exception("warm-up failed")
        state["error"] = f"{type(e).__name__}: {e}"
        out, err = None, e
      else:
        if out["done"] == out["programs"]:
          if self._accepts_deltas:
            # /admin/swap_delta decodes with numba kernels: ready them now (loaded from their
            # on-disk cache, or compiled), so the first delta swaps as fast as later ones.
            from sync import delta  # pylint: disable=g-import-not-at-top
            out["delta_kernels_s"] = delta.warm_up()
            log.info("warm-up: delta kernels ready in %.2f s", out["delta_kernels_s"])
          log.info("warm-up done: %d programs in %.1f s (%d compiled, %d loaded from the "
                   "persistent compilation cache)", out["programs"], out["seconds"],
                   out["compiled"], out["cache_hits"])
          self.warmup_state = None
      try:
        loop.call_soon_threadsafe(settle, out, err)
      except RuntimeError:  # the loop is closed: nobody waits any more
        pass

    # Its error is reported by /health and the log; a server nobody awaits it on is no fault.
    result.add_done_callback(lambda f: f.cancelled() or f.exception())
    threading.Thread(target=run, name="rollout-warm-up", daemon=True).start()
    return result

  async def stop(self) -> None:
    self._warmup_stop.set()  # a warm-up under way ends after its current compilations
    for r in self._runners:
      await r.cleanup()
    self._runners = []

  # ------------------------------------------------------------------ public endpoints
  async def health(self, request) -> web.Response:
    problems = [] if self.engine.running else ["the engine loop is not running"]
    warming = self.warmup_state
    if warming is not None:
      problems.append(f"warm-up failed: {warming['error']}" if warming["error"] else
                      f"warming up: compiled {warming['done']} of "
                      f"{warming['total'] if warming['total'] is not None else '?'} programs")
    for check in self.health_checks:
      try:
        p = check()
      except Exception as e:  # noqa: BLE001 -- a failing check is itself a problem to report
        log.exception("health check failed")
        p = f"health check {getattr(check, '__name__', check)!s} failed: {type(e).__name__}"
      if p:
        problems.append(p)
    status = "ok" if not problems else "unhealthy"
    if warming is not None and not warming["error"] and len(problems) == 1:
      status = "warming_up"
    body = {"status": status, "policy_version": self.engine.version}
    if warming is not None:
      body["warmup"] = {"done": warming["done"], "total": warming["total"]}
    if problems:
      body["problems"] = problems
    return web.json_response(body, status=200 if not problems else 503)

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

  def _parse(self, raw: bytes) -> dict:
    """The validated completions request (protocol.BadRequest otherwise); runs in an executor
    thread."""
    eng = self.engine
    return protocol.parse_completion_request(
        http_common.parse_json(raw), self.tokenizer, eng.model_config.vocab_size,
        max_tokens_limit=eng.max_len - 1, max_completions=self.max_completions_per_request)

  def _parse_chat(self, raw: bytes) -> dict:
    """The validated chat request, its messages rendered and encoded (protocol.BadRequest
    otherwise); runs in an executor thread."""
    eng = self.engine
    return chat_protocol.parse_chat_request(
        http_common.parse_json(raw), self.tokenizer, eng.model_config.vocab_size,
        max_tokens_limit=eng.max_len - 1, max_completions=self.max_completions_per_request)

  async def completions(self, request) -> web.StreamResponse:
    return await self._generate(request, self._parse, protocol.CompletionsFormat())

  async def chat_completions(self, request) -> web.StreamResponse:
    return await self._generate(request, self._parse_chat, chat_protocol.ChatFormat())

  async def _generate(self, request, parse: Callable[[bytes], dict],
                      fmt) -> web.StreamResponse:
    """Parses (`parse`), queues, then answers through `fmt`, streamed or not."""
    if request.content_type != "application/json":
      return _json_error(415, "the body must be JSON sent as Content-Type: application/json, "
                              f"got {protocol.show(request.content_type)}")
    raw = await request.read()
    eng = self.engine
    loop = asyncio.get_running_loop()
    try:
      # Off the event loop: decoding and tokenizing megabytes of JSON and text (and rendering a
      # chat template) takes long enough to stall every other request and /health, even when
      # the request is then refused.
      req = await loop.run_in_executor(None, parse, raw)
    except protocol.BadRequest as e:
      return self._bad(str(e))
    timeout = req["timeout"] if req["timeout"] is not None else self.request_timeout
    events: asyncio.Queue = asyncio.Queue()
    on_tokens = None
    if req["stream"]:
      def on_tokens(h, i, toks, lps, reason):  # engine thread
        loop.call_soon_threadsafe(events.put_nowait, (h.id, i, list(toks), list(lps), reason))
    try:
      # One call for all prompts: queued together or not at all, and scheduled as one request.
      handles = eng.submit_batch(req["prompts"], req["params"], timeout=timeout,
                                 on_tokens=on_tokens)
    except ValueError as e:
      return self._bad(str(e))
    except QueueFull as e:
      self.http_stats["http_429_total"] += 1
      return _json_error(429, f"server busy: {e}; retry later", "rate_limit_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    except EngineStopped as e:
      return _json_error(503, str(e), "server_error")
    rid = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req["model"] or self.model_name
    # The engine answers a request by its timeout; this bound holds even if its loop is stuck.
    deadline = None if timeout is None else loop.time() + timeout + TIMEOUT_GRACE_S
    futures = [asyncio.wrap_future(h.future) for h in handles]
    try:
      if req["stream"]:
        return await streaming.stream(request, self.tokenizer, req, handles, events, rid,
                                      created, model, deadline, fmt)
      # asyncio.wait, not gather/wait_for: it never cancels the engine's futures, which the
      # engine thread completes itself once the handles are cancelled.
      _, pending = await asyncio.wait(
          futures, timeout=None if deadline is None else max(0.0, deadline - loop.time()))
    except (asyncio.CancelledError, ConnectionResetError):
      self.http_stats["client_disconnects_total"] += 1
      for h in handles:
        h.cancel()
      raise
    if pending:
      for h in handles:
        h.cancel()
      log.warning("%s: no answer from the engine %.1f s past its %s s timeout; answered 504",
                  rid, TIMEOUT_GRACE_S, timeout)
      self.http_stats["http_504_total"] += 1
      return _json_error(504, f"request timed out after {timeout} s", "timeout_error")
    failed = [f for f in futures if f.cancelled() or f.exception() is not None]
    if failed:
      log.error("%s: the engine failed the request: %r", rid,
                "cancelled" if failed[0].cancelled() else failed[0].exception())
      return _json_error(500, f"internal error (request id {rid})", "server_error")
    results = [f.result() for f in futures]
    if any(c.finish_reason == "timeout" for r in results for c in r):
      self.http_stats["http_504_total"] += 1
      return _json_error(504, f"request timed out after {timeout} s", "timeout_error")
    n = req["params"].n
    choices = [fmt.choice(pi * n + c.index, c, self.tokenizer, req, req["prompts"][pi])
               for pi, r in enumerate(results) for c in r]
    # OpenAI's cached_tokens is counted like prompt_tokens, once per completion (its request's
    # prompt tokens that the prefix cache served).
    usage = protocol.usage_json(sum(len(p) for p in req["prompts"]) * n,
                                sum(len(c.token_ids) for r in results for c in r),
                                sum(c.cached_tokens for r in results for c in r))
    return web.json_response({"id": rid, "object": fmt.object, "created": created,
                              "model": model, "choices": choices, "usage": usage})


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000,
          admin_port: Optional[int] = None, admin_host: str = "127.0.0.1",
          **server_kw) -> None:
  """Runs the server until interrupted (blocking); `server_kw` go to `Server`.

  The start-up line says where the admin app listens and where its token is (the token itself,
  once, only if it was generated and no token file was given). With `warmup=True` a second
  line, "rollout server ready: ...", follows when the warm-up is done (how long, how many
  programs, how many were compiled and how many loaded from the persistent compilation cache).

  Warm-up is off unless asked for: this is also how other processes (pipeline samplers) and
  tests serve an engine, and they start many servers; //tools:serve asks for it by default.
  """
  async def main():
    server = Server(engine, **server_kw)
    bound = await server.start(host, port, admin_port, admin_host)
    log.info("serving on %s:%s (admin %s:%s)", host, bound[0], admin_host, bound[1])
    admin = ("admin off" if bound[1] is None else
             f"admin on http://{admin_host}:{bound[1]}, {server.admin.token_notice()}")
    print(f"rollout server listening on http://{host}:{bound[0]} ({admin})", flush=True)
    try:
      if server.warmup_result is not None:
        try:
          r = await server.warmup_result
        except Exception:  # noqa: BLE001 -- logged by the warm-up; /health reports it
          pass
        else:
          print(f"rollout server ready: warm-up took {r['seconds']:.1f} s for {r['programs']} "
                f"programs ({r['compiled']} compiled, {r['cache_hits']} loaded from the "
                f"persistent compilation cache)", flush=True)
      await asyncio.Event().wait()
    finally:
      await server.stop()

  try:
    asyncio.run(main())
  except KeyboardInterrupt:
    pass
