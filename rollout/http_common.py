"""What the public and admin HTTP apps share: JSON error bodies and the last-resort middleware.

Split out so that `rollout.server` (public endpoints) and `rollout.admin` (weight swaps) answer
errors the same way without importing each other.
"""

from __future__ import annotations

import asyncio
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
