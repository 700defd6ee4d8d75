"""The sampler's admin endpoints: weight swaps by checkpoint or by delta, and swap status.

What: `Admin(engine, token=..., load_flat=..., checkpoint_root=...).app()` is the aiohttp app
served on the admin port: `POST /admin/swap` {"checkpoint": DIR, "version": N} (JSON),
`POST /admin/swap_delta?version=N` (body: a `sync.delta` blob, application/octet-stream),
`GET /admin/status`. Swaps are serialised; a bad checkpoint or delta is refused with the old
weights serving.

Why its own module and port: these endpoints change what every client is served, so they are
kept apart from the public completions app (`rollout.server`), which never imports this.

Secure by default, because whoever can swap the weights decides what every client is served:
  * a token is always required (`Authorization: Bearer TOKEN`, compared in constant time).
    Without one given, one is generated (`secrets.token_urlsafe`); `token_file` writes it to a
    file of mode 0600 for clients on the same machine, and `rollout.server.serve` prints where
    it is (or the token itself, once, when there is no file). There is no unauthenticated mode.
  * DNS rebinding and browser pages: a request whose `Host` is not the bound address (or, bound
    to loopback, a loopback alias: localhost, 127.0.0.1, [::1]; bound to all interfaces, an IP
    literal; or one of `allowed_hosts`) is refused 403, and so is one whose `Origin` header is
    present and not that same origin. A browser page can only reach the port under a name its
    own DNS resolves; its Host header then names that page's domain.
  * content types: /admin/swap takes only application/json, /admin/swap_delta only an explicit
    application/octet-stream (neither is a type a page may POST across origins without a CORS
    preflight, which this app never grants): 415 otherwise.
  * body size: a delta is at most about the served weights' size (see `delta_body_limit`), so
    the limit derives from them (`max_delta_bytes` overrides); a longer Content-Length is
    refused 413 before any of the body is read, and a chunked body is cut off at the limit.
  * checkpoint swaps read only directories under `checkpoint_root` (after resolving `..` and
    symlinks); without a root, /admin/swap by path is off (403). A checkpoint that cannot be
    loaded is answered with one generic sentence; what went wrong is logged here, so a caller
    learns neither directory listings nor which files exist.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import re
import secrets
from typing import Callable, Optional, Sequence
import urllib.parse

from aiohttp import web

from rollout import http_common
from rollout import protocol
from rollout.engine import Engine

log = logging.getLogger(__name__)

json_error = http_common.json_error

MAX_VERSION = 2**63  # versions are in [0, 2^63): they travel as int64 in metrics and manifests
MAX_SWAP_JSON_BYTES = 64 * 1024  # {"checkpoint": DIR, "version": N} is a few hundred bytes
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
_VERSION_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only; 2^63 has 19 digits
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def delta_body_limit(flat: dict) -> int:
  """The largest `sync.delta` blob accepted for weights `flat`: twice their bytes plus 1 MiB.

  Why this bound: a blob is a JSON header (name, dtype, shape per tensor), one 56-byte record
  per chunk of `sync.weights.CHUNK_ELEMS` elements with a zstd payload, and an 84-byte trailer.
  The encoder picks, per chunk, the smallest of its forms; the dense ones are the byte planes
  of every element (zstd never grows data by more than 1/256 plus a frame header), so a
  delta of fully rewritten weights is about their size (measured: 1.0001x for random bf16 and
  float32 bits, 0.98x when the changed-fraction estimate is wrong on purpose). Twice the bytes
  leaves room for the per-tensor header and the sparse forms' worst case without admitting the
  16 GiB that an unbounded read would buffer.
  """
  weight_bytes = sum(int(v.nbytes) for v in flat.values())
  return 2 * weight_bytes + 128 * len(flat) + (1 << 20)


def write_token_file(path: str, token: str) -> None:
  """Writes `token` to `path` readable by this user only (mode 0600, symlinks not followed)."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
  try:
    os.fchmod(fd, 0o600)  # a file that existed keeps its mode under O_CREAT: narrow it first
    os.write(fd, (token + "\n").encode())
  finally:
    os.close(fd)


def _is_loopback(host: str) -> bool:
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _is_ip(host: str) -> bool:
  try:
    ipaddress.ip_address(host)
    return True
  except ValueError:
    return False


def _split_host(value: str) -> tuple:
  """(hostname lowercased without brackets, port or 80) of a Host header or origin netloc."""
  parts = urllib.parse.urlsplit("//" + value)
  if parts.username is not None or parts.password is not None or parts.path or parts.query:
    raise ValueError(value)
  if not parts.hostname:
    raise ValueError(value)
  return parts.hostname, (parts.port if parts.port is not None else 80)


class Admin:
  """Admin endpoints for one engine (see the module docstring)."""

  def __init__(self, engine: Engine, *, token: Optional[str] = None,
               token_file: Optional[str] = None,
               load_flat: Optional[Callable[[str], dict]] = None,
               checkpoint_root: Optional[str] = None,
               max_delta_bytes: Optional[int] = None,
               allowed_hosts: Sequence[str] = ()):
    """Args:
      engine: the served engine.
      token: the bearer token admin requests must send; None or "" generates one
        (`self.token`, `self.token_generated`).
      token_file: where `publish_token` writes the token (mode 0600) when the app is served.
      load_flat: path -> flat weights, for `/admin/swap` (e.g. rollout.loading.load_flat).
      checkpoint_root: the directory `/admin/swap` may read checkpoints under (None: swaps by
        path are refused).
      max_delta_bytes: body limit of `/admin/swap_delta` (default: `delta_body_limit` of the
        served weights).
      allowed_hosts: extra host names accepted in `Host`/`Origin` (e.g. the machine's DNS name
        when the admin port is bound to all interfaces).
    """
    self.engine = engine
    self.token_generated = not token
    self.token = token or secrets.token_urlsafe(32)
    self.token_file = token_file
    self.load_flat = load_flat
    self.checkpoint_root = (None if checkpoint_root is None
                            else os.path.realpath(checkpoint_root))
    self.max_delta_bytes = max_delta_bytes
    self.allowed_hosts = tuple(h.lower().strip("[]") for h in allowed_hosts)
    self._bound: Optional[tuple] = None  # (host, port) once `bind` is called
    self._swap_lock = asyncio.Lock()

  # ------------------------------------------------------------------ setup
  def publish_token(self) -> None:
    """Writes the token to `token_file`, if one is set (before the admin port listens)."""
    if self.token_file is not None:
      write_token_file(self.token_file, self.token)

  def token_notice(self) -> str:
    """A sentence for the start-up message saying where the token is (the token itself only
    when it was generated and there is no file to find it in)."""
    if self.token_file is not None:
      return f"admin token in {self.token_file} (mode 0600)"
    if self.token_generated:
      return f"admin token (generated; --admin_token_file keeps it off the console): {self.token}"
    return "admin token as given (--admin_token or $ROLLOUT_ADMIN_TOKEN)"

  def bind(self, host: str, port: int) -> None:
    """Records the address the app listens on: requests must name it in `Host`."""
    self._bound = (host.lower().strip("[]"), port)

  def app(self) -> web.Application:
    """The aiohttp app. Until `bind` names the address it is served on, it refuses every
    request (403): the Host check needs it (`rollout.server.Server.start` calls both)."""
    if self.max_delta_bytes is None:
      self.max_delta_bytes = delta_body_limit(self.engine.current_flat())
    # aiohttp's own cap applies to bodies read with request.read(); the handlers read through
    # `_read_body`, which refuses long Content-Lengths before reading anything.
    app = web.Application(middlewares=[http_common.errors, self._guard],
                          client_max_size=self.max_delta_bytes)
    app.router.add_post("/admin/swap", self.swap)
    app.router.add_post("/admin/swap_delta", self.swap_delta)
    app.router.add_get("/admin/status", self.status)
    return app

  # ------------------------------------------------------------------ checks
  def _host_ok(self, value: str) -> bool:
    try:
      name, port = _split_host(value)
    except ValueError:
      return False
    if self._bound is None or port != self._bound[1]:
      return False
    bound = self._bound[0]
    if name == bound or name in self.allowed_hosts:
      return True
    if _is_loopback(bound):
      return name in _LOOPBACK_NAMES
    return bound in _WILDCARD_HOSTS and _is_ip(name)

  def _origin_ok(self, origin: str) -> bool:
    parts = urllib.parse.urlsplit(origin)
    return (parts.scheme == "http" and not parts.path and not parts.query
            and self._host_ok(parts.netloc))

  def _token_ok(self, request) -> bool:
    got = request.headers.get("Authorization", "").encode("utf-8", "backslashreplace")
    return hmac.compare_digest(got, f"Bearer {self.token}".encode())

  @web.middleware
  async def _guard(self, request, handler):
    host = request.headers.get("Host")
    if host is None or not self._host_ok(host):
      return json_error(403, "the Host header does not name this admin server", "forbidden")
    origin = request.headers.get("Origin")
    if origin is not None and not self._origin_ok(origin):
      return json_error(403, "cross-origin admin requests are refused", "forbidden")
    if not self._token_ok(request):
      return json_error(401, "missing or wrong admin token", "authentication_error")
    return await handler(request)

  @staticmethod
  def _content_type(request, want: str) -> Optional[web.Response]:
    """A 415 unless the request declares Content-Type `want` (parameters such as charset aside)."""
    if "Content-Type" in request.headers and request.content_type.lower() == want:
      return None
    got = request.headers.get("Content-Type", "none")
    return json_error(415, f"Content-Type must be {want}, got {got[:100]!r}",
                      "unsupported_media_type")

  @staticmethod
  async def _read_body(request, limit: int):
    """The body, or a 413 response: a Content-Length over `limit` is refused before reading."""
    too_long = json_error(413, f"request body over {limit} bytes", "request_too_large")
    if request.content_length is not None and request.content_length > limit:
      return None, too_long
    parts, size = [], 0
    async for part in request.content.iter_any():
      size += len(part)
      if size > limit:
        return None, too_long
      parts.append(part)
    return b"".join(parts), None

  @staticmethod
  def _version(value) -> int:
    """`value` as a version in [0, 2^63): an int or a string of ASCII digits, else BadRequest."""
    if isinstance(value, str) and _VERSION_DIGITS.fullmatch(value):
      value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_VERSION:
      shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else \
          f"a string of {len(value)} characters"
      raise protocol.BadRequest(f"'version' must be an integer in [0, 2^63), got {shown}")
    return value

  def _checkpoint_path(self, value) -> str:
    """The resolved checkpoint directory for `value`, or BadRequest if it is outside the root."""
    if not isinstance(value, str) or not value or len(value) > MAX_PATH_CHARS or "\0" in value:
      raise protocol.BadRequest("'checkpoint' must be a directory path")
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file system path can name it
      raise protocol.BadRequest("'checkpoint' is not valid Unicode") from None
    path = os.path.realpath(os.path.join(self.checkpoint_root, value))
    if os.path.commonpath([self.checkpoint_root, path]) != self.checkpoint_root:
      raise protocol.BadRequest("'checkpoint' must be a directory under the server's "
                                "checkpoint root")
    return path

  # ------------------------------------------------------------------ endpoints
  async def status(self, request) -> web.Response:
    return web.json_response({"policy_version": self.engine.version,
                              "last_swap": self.engine.last_swap})

  async def swap(self, request) -> web.Response:
    if (bad := self._content_type(request, "application/json")) is not None:
      return bad
    raw, bad = await self._read_body(request, MAX_SWAP_JSON_BYTES)
    if bad is not None:
      return bad
    try:
      body = http_common.parse_json(raw)
      if not isinstance(body, dict) or set(body) - {"checkpoint", "version"}:
        raise protocol.BadRequest("body must be {\"checkpoint\": DIR, \"version\": N}")
      version = self._version(body.get("version"))
      if self.load_flat is None or self.checkpoint_root is None:
        return json_error(403, "swaps by checkpoint path are off: start the server with a "
                          "checkpoint root (--checkpoint_root=DIR)", "forbidden")
      path = self._checkpoint_path(body.get("checkpoint"))
    except protocol.BadRequest as e:
      return json_error(400, str(e))
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        flat = await loop.run_in_executor(None, self.load_flat, path)
      except Exception:  # noqa: BLE001 -- any reader failure: the details stay in our log
        log.exception("admin swap: cannot load checkpoint %r", path)
        return json_error(400, "cannot load checkpoint: see the server log")
      try:
        out = await loop.run_in_executor(None, self.engine.swap_weights, flat, version)
      except ValueError as e:  # weights of another model, or weights refused by the engine
        return json_error(400, f"cannot swap to this checkpoint: {e}")
    return web.json_response(out)

  async def swap_delta(self, request) -> web.Response:
    if (bad := self._content_type(request, "application/octet-stream")) is not None:
      return bad
    try:
      version = self._version(request.query.get("version"))
    except protocol.BadRequest as e:
      return json_error(400, str(e))
    blob, bad = await self._read_body(request, self.max_delta_bytes)
    if bad is not None:
      return bad
    if not blob:
      return json_error(400, "empty delta body")
    loop = asyncio.get_running_loop()
    async with self._swap_lock:
      try:
        out = await loop.run_in_executor(None, self.engine.swap_delta, blob, version)
      except ValueError as e:  # sync.delta.DeltaError is a ValueError
        return json_error(400, f"cannot apply delta: {e}")  # our messages, for the client
    return web.json_response(out)
