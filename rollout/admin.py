"""The sampler's admin endpoints: weight swaps by checkpoint or by delta, and swap status.

What: `Admin(engine, token=..., load_flat=...).app()` is the aiohttp app served on the admin
port: `POST /admin/swap` {"checkpoint": DIR, "version": N}, `POST /admin/swap_delta?version=N`
(body: a `sync.delta` blob), `GET /admin/status`. With a token, requests must send
`Authorization: Bearer TOKEN`. Swaps are serialised; a bad checkpoint or delta is refused with
the old weights serving.

Why its own module and port: these endpoints change what every client is served, so they are
kept apart from the public completions app (`rollout.server`), which never imports this.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional

from aiohttp import web

from rollout import http_common
from rollout import protocol
from rollout.engine import Engine

json_error = http_common.json_error


class Admin:
  """Admin endpoints for one engine (see the module docstring)."""

  def __init__(self, engine: Engine, *, token: Optional[str] = None,
               load_flat: Optional[Callable[[str], dict]] = None):
    """Args:
      engine: the served engine.
      token: if set, requests must send `Authorization: Bearer <token>`.
      load_flat: path -> flat weights, for `/admin/swap` (e.g. rollout.loading.load_flat).
    """
    self.engine = engine
    self.token = token
    self.load_flat = load_flat
    self._swap_lock = asyncio.Lock()

  def app(self) -> web.Application:
    app = web.Application(middlewares=[http_common.errors, self._auth],
                          client_max_size=16 * 1024**3)
    app.router.add_post("/admin/swap", self.swap)
    app.router.add_post("/admin/swap_delta", self.swap_delta)
    app.router.add_get("/admin/status", self.status)
    return app

  @web.middleware
  async def _auth(self, request, handler):
    if self.token is not None:
      if request.headers.get("Authorization") != f"Bearer {self.token}":
        return json_error(401, "missing or wrong admin token", "authentication_error")
    return await handler(request)

  def _version(self, value) -> int:
    if isinstance(value, str) and value.lstrip("-").isdigit():
      value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
      raise protocol.BadRequest(f"'version' must be an integer, got {value!r}")
    return value

  async def status(self, request) -> web.Response:
    return web.json_response({"policy_version": self.engine.version,
                              "last_swap": self.engine.last_swap})

  async def swap(self, request) -> web.Response:
    try:
      body = json.loads(await request.read())
      if not isinstance(body, dict) or set(body) - {"checkpoint", "version"}:
        raise protocol.BadRequest("body must be {\"checkpoint\": DIR, \"version\": N}")
      if not isinstance(body.get("checkpoint"), str):
        raise protocol.BadRequest("'checkpoint' must be a directory path")
      version = self._version(body.get("version"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return json_error(400, f"malformed JSON body: {e}")
    except protocol.BadRequest as e:
      return json_error(400, str(e))
    if self.load_flat is None:
      return json_error(501, "this server was started without a checkpoint loader")
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        flat = await loop.run_in_executor(None, self.load_flat, body["checkpoint"])
        out = await loop.run_in_executor(None, self.engine.swap_weights, flat, version)
      except ValueError as e:  # missing/corrupt checkpoint, or weights of another model
        return json_error(400, f"cannot swap to {body['checkpoint']!r}: {e}")
    return web.json_response(out)

  async def swap_delta(self, request) -> web.Response:
    try:
      version = self._version(request.query.get("version"))
    except protocol.BadRequest as e:
      return json_error(400, str(e))
    blob = await request.read()
    if not blob:
      return json_error(400, "empty delta body")
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        out = await loop.run_in_executor(None, self.engine.swap_delta, blob, version)
      except ValueError as e:  # sync.delta.DeltaError is a ValueError
        return json_error(400, f"cannot apply delta: {type(e).__name__}: {e}")
    return web.json_response(out)
