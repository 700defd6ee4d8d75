"""`rollout.http_common`: the last-resort middleware, `parse_json`, and one-line logs of
malformed HTTP messages, against a real aiohttp server on a free port."""

import asyncio
import json
import logging
import re
import sys

import pytest
from aiohttp import test_utils, web

from rollout import http_common
from rollout import protocol


def _app():
  async def boom(request):
    raise RuntimeError("secret detail /root/weights.npz")

  async def ok(request):
    return web.json_response({"ok": True})

  app = web.Application(middlewares=[http_common.errors])
  app.router.add_get("/boom", boom)
  app.router.add_get("/ok", ok)
  return app


async def _with_server(fn):
  server = test_utils.TestServer(_app())
  await server.start_server()
  try:
    return await fn(server)
  finally:
    await server.close()


def test_unhandled_error_is_a_generic_500_with_a_logged_id(caplog):
  async def go(server):
    async with test_utils.TestClient(server) as client:
      r = await client.get("/boom")
      return r.status, await r.json()

  with caplog.at_level(logging.ERROR, logger=http_common.log.name):
    status, body = asyncio.run(_with_server(go))
  assert status == 500
  message = body["error"]["message"]
  assert "secret" not in message and "RuntimeError" not in message, message
  error_id = re.fullmatch(r"internal error \(id ([0-9a-f]{16})\)", message).group(1)
  logged = [r for r in caplog.records if error_id in r.getMessage()]
  assert len(logged) == 1 and logged[0].exc_info is not None
  assert "secret detail" in caplog.text  # the log keeps what the client is not told


def test_malformed_http_message_logs_one_line(caplog):
  async def go(server):
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nno colon in this header line\r\n\r\n")
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    async with test_utils.TestClient(server) as client:  # the server still serves
      r = await client.get("/ok")
      return reply, r.status

  with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
    reply, status = asyncio.run(_with_server(go))
  assert re.match(rb"HTTP/1\.[01] 400 ", reply) and status == 200
  records = [r for r in caplog.records if r.name == "aiohttp.server"]
  assert records, "aiohttp logged nothing for the malformed request"
  for r in records:
    assert r.exc_info is None and r.exc_text is None, r.getMessage()
    assert r.getMessage().startswith("malformed HTTP request from ")
    assert "\n" not in r.getMessage()
  assert "Traceback" not in caplog.text


@pytest.mark.parametrize("raw,fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "nested more than"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
    (b'{"prompt": "\xff"}', "not UTF-8"),
    (b"{nope", "malformed JSON"),
])
def test_parse_json_refuses_what_json_cannot_take(raw, fragment):
  with pytest.raises(protocol.BadRequest, match=fragment) as e:
    http_common.parse_json(raw)
  assert len(str(e.value)) < 200
  assert http_common.parse_json(json.dumps({"a": [[1]]}).encode()) == {"a": [[1]]}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
