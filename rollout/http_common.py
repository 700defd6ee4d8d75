"""What the public and admin HTTP apps share: JSON error bodies and the last-resort middleware.

Split out so that `rollout.server` (public endpoints) and `rollout.admin` (weight swaps) answer
errors the same way without importing each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

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
  except Exception as e:  # noqa: BLE001 -- the last line of defence
    log.exception("unhandled error")
    return json_error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


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
