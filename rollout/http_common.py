"""What the public and admin HTTP apps share: JSON error bodies and the last-resort middleware.

Also, on import: aiohttp's server logs a malformed HTTP message as one line, not a traceback
(`quiet_bad_http_logs`), so junk sent to either port cannot flood the log.

Split out so that `rollout.server` (public endpoints) and `rollout.admin` (weight swaps) answer
errors the same way without importing each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Optional

import aiohttp.http_exceptions
from aiohttp import web

from rollout import protocol

log = logging.getLogger(__name__)


def json_error(status: int, message: str, kind: str = "invalid_request_error",
               headers: Optional[dict] = None) -> web.Response:
  """An OpenAI-style error body with `status`."""
  return web.json_response(protocol.error_json(message, kind), status=status, headers=headers)


@web.middleware
async def errors(request, handler):
  """Turns stray exceptions into JSON errors so one bad request never stops the server."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.content_type == "application/json" or e.status < 400:
      raise
    return json_error(e.status, e.reason or str(e), "http_error")
  except asyncio.CancelledError:
    raise
  except Exception:  # noqa: BLE001 -- the last line of defence
    # The client gets an id to quote, never the exception's text (paths, values, internals);
    # the log has both.
    error_id = uuid.uuid4().hex[:16]
    log.exception("unhandled error %s on %s %s", error_id, request.method, request.path)
    return json_error(500, f"internal error (id {error_id})", "server_error")


class _OneLineBadHttp(logging.Filter):
  """Logs a malformed HTTP message (aiohttp's "Error handling request") as one line.

  aiohttp's server logs every unparsable request with a full traceback; a client sending junk
  would fill the log with them. The line keeps the peer and the parser's reason (truncated).
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, aiohttp.http_exceptions.HttpProcessingError):
      peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
      record.msg = "malformed HTTP request from %s: %s"
      record.args = (peer, protocol.show(f"{type(exc).__name__}: {exc.message}"))
      record.exc_info = record.exc_text = None
      record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def quiet_bad_http_logs() -> None:
  """Installs `_OneLineBadHttp` on aiohttp's server logger (once)."""
  logger = logging.getLogger("aiohttp.server")
  if not any(isinstance(f, _OneLineBadHttp) for f in logger.filters):
    logger.addFilter(_OneLineBadHttp())


quiet_bad_http_logs()


MAX_JSON_DEPTH = 32


def _depth_ok(value, limit: int) -> bool:
  """Whether `value` nests at most `limit` containers deep (iterative: no recursion limit)."""
  stack = [(value, 1)]
  while stack:
    v, d = stack.pop()
    if isinstance(v, (list, dict)):
      if d > limit:
        return False
      stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
  return True


def parse_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH):
  """Decodes a JSON request body, or raises `protocol.BadRequest` with a message for the client.

  Bodies that Python's `json` cannot take safely are refused, not crashed on: nesting deeper
  than `max_depth` (deeper ones would exhaust the recursion limit here or in later reprs), and
  integers too long to convert (Python caps integer strings at 4,300 digits). No exception text
  of ours reaches the client.
  """
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise protocol.BadRequest(f"the body is not UTF-8 (byte {e.start})") from None
  try:
    value = json.loads(text)
  except RecursionError:
    raise protocol.BadRequest(f"malformed JSON body: nested more than {max_depth} deep") from None
  except json.JSONDecodeError as e:
    raise protocol.BadRequest(f"malformed JSON body: {e.msg} at line {e.lineno} column "
                              f"{e.colno}") from None
  except ValueError:  # int_max_str_digits
    raise protocol.BadRequest("malformed JSON body: an integer has too many digits") from None
  if not _depth_ok(value, max_depth):
    raise protocol.BadRequest(f"malformed JSON body: nested more than {max_depth} deep")
  return value
