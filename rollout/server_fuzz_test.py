"""The sampling server fuzzed as a hostile client would (issue #16): bounded, seeded, repeatable.

Every class of bad input the issue lists is sent a few hundred times with seeded variations:
numeric fields out of their tables' range, wrong JSON types, bodies that break Python's `json`
(deep nesting, over-long integers, lone surrogates, non-UTF-8, NaN/Infinity literals), wrong
content types, requests too large for their share of the server, malformed HTTP messages, and on
the admin port bad tokens, foreign Origin/Host, bad versions, checkpoint paths and delta blobs
(damaged ones and well-formed ones carrying NaN weights).

The assertions are the issue's: no 5xx, no answer later than its bound, no stack trace or Python
exception text in any body, and afterwards a server that still answers correctly: the same
greedy tokens and logprobs as before the fuzz, the same version and weights, no slot or queue
entry left behind.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import socket
import sys

import numpy as np
import pytest

from moe import hf
from rollout import loading
from rollout import testing
from rollout.engine import EngineConfig
from testlib import waiting

TOKEN = "fuzz-admin-token"
SEED = 20261201
PER_CLASS = 240  # requests per input class
ANSWER_S = 60.0  # a generous bound on any one answer on a loaded 2-core machine
REFERENCE = {"prompt": [5, 17, 200, 3], "max_tokens": 6, "temperature": 0}

# Python's own exception names and traceback lines: none of these may reach a client.
_LEAK = re.compile(r"Traceback|File \"|\b(UnicodeEncodeError|UnicodeDecodeError|RecursionError|"
                   r"ValueError|TypeError|KeyError|OverflowError|AttributeError|IndexError|"
                   r"AssertionError|ZeroDivisionError|RuntimeError|JSONDecodeError)\b")

FIELDS_INT = ["max_tokens", "n", "top_k", "logprobs", "seed", "best_of"]
FIELDS_NUM = ["temperature", "top_p", "timeout", "presence_penalty", "frequency_penalty"]
FIELDS_OTHER = ["stop", "stop_token_ids", "stream", "ignore_eos", "return_routing",
                "return_prompt_routing", "model", "user", "echo", "logit_bias", "suffix",
                "stream_options", "prompt"]
# Raw JSON number spellings, including ones Python's json turns into inf/nan or cannot convert.
NUMBERS = ["2147483648", "2147483647", "4294967296", "9223372036854775808", "18446744073709551616",
           "-9223372036854775809", "-1", "0", "1", "1e30", "-1e30", "1e308", "1e400", "-1e400",
           "NaN", "Infinity", "-Infinity", "0.5", "-0.0", "1" * 5000, "-" + "7" * 4400, "3.0",
           "1e-400", "123456789012345678901234567890"]
JUNK = ["{}", "[]", "\"x\"", "true", "false", "null", "[[]]", "{\"a\": 1}", "\"\"", "[1, \"a\"]",
        "[true]", "[0]", "[-1]", "[1e30]", "\"\\ud800\"", "[\"\\udfff\"]", "0"]


# Versions an admin swap accepts (integers in [0, 2^63)): left out of the bad-version class.
_VALID_VERSIONS = {"0", "1", "2147483647", "2147483648", "4294967296"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  good = tmp_path_factory.mktemp("good")
  model = testing.tiny_model(seed=3)
  hf.save_pretrained(model, str(good), architecture="MixtralForCausalLM")
  bad = tmp_path_factory.mktemp("nan")
  from moe import params as moe_params
  flat = moe_params.flatten(model)
  moe_params.load_flat(model, {k: np.full_like(v, np.nan) for k, v in flat.items()})
  hf.save_pretrained(model, str(bad), architecture="MixtralForCausalLM")
  return str(good), str(bad)


@pytest.fixture(scope="module")
def live(ckpts):
  engine = loading.load_engine(EngineConfig(max_slots=4, max_len=64, decode_steps=4,
                                            max_queue=16),
                               hf_checkpoint=ckpts[0], max_seq_len=64)
  # Every shape compiled first, as //tools:serve does at start-up: a fuzzed request's first
  # top-logprobs call must not wait out the 30 s request timeout compiling on a loaded machine.
  engine.warm_up(threads=2)
  srv = testing.LiveServer(engine, admin=True, model_name="tiny", request_timeout=30.0,
                           admin_token=TOKEN, checkpoint_root=os.path.dirname(ckpts[0]),
                           load_flat=lambda p: loading.load_flat(p, engine.model_config))
  yield srv
  srv.close()
  engine.stop()


class _Client:
  """Keep-alive HTTP to one port that checks every answer against the issue's rules."""

  def __init__(self, port: int):
    self.port = port
    self.conn = None
    self.statuses: dict = {}

  def send(self, method: str, path: str, body: bytes = b"", headers=None, what: str = ""):
    headers = {"Content-Type": "application/json", **(headers or {})}
    headers = {k: v for k, v in headers.items() if v is not None}
    for attempt in (0, 1):  # the server may close a kept-alive connection after an error
      if self.conn is None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_S)
      try:
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        break
      except socket.timeout:
        raise AssertionError(f"no answer within {ANSWER_S} s to {what}: {body[:200]!r}")
      except (ConnectionError, http.client.HTTPException):
        self.conn.close()
        self.conn = None
        if attempt:
          raise
    if r.getheader("Connection", "").lower() == "close":
      self.conn.close()
      self.conn = None
    self.check(r.status, data, what, body)
    return r.status, data

  def check(self, status: int, data: bytes, what: str, body: bytes) -> None:
    self.statuses[status] = self.statuses.get(status, 0) + 1
    assert status < 500, f"{status} for {what}: {body[:200]!r} -> {data[:500]!r}"
    text = data.decode("utf-8", "replace")
    assert not _LEAK.search(text), f"exception text leaked for {what}: {text[:500]}"
    if status >= 400:
      err = json.loads(data)["error"]
      assert err["message"], f"empty error message for {what}"
      assert len(err["message"]) < 2000, f"over-long error message for {what}"


def _completion_body(rng: random.Random, cls: str) -> bytes:
  """One malformed (or edge-valid) completions body of input class `cls`, as raw JSON text."""
  base = {"prompt": "[1, 2, 3]", "max_tokens": "2"}
  if cls == "numeric":
    field = rng.choice(FIELDS_INT + FIELDS_NUM + ["prompt_id", "stop_token_id"])
    v = rng.choice(NUMBERS)
    if field == "prompt_id":
      base["prompt"] = f"[1, {v}]"
    elif field == "stop_token_id":
      base["stop_token_ids"] = f"[{v}]"
    else:
      base[field] = v
  elif cls == "types":
    for field in rng.sample(FIELDS_INT + FIELDS_NUM + FIELDS_OTHER, rng.randint(1, 3)):
      base[field] = rng.choice(JUNK + NUMBERS[:6])
  elif cls == "structure":
    kind = rng.randrange(6)
    depth = rng.choice([33, 100, 1000, 100_000])
    if kind == 0:
      base["prompt"] = "[" * depth + "1" + "]" * depth
    elif kind == 1:
      base["stop"] = "[" * depth + "]" * depth
    elif kind == 2:
      return ("[" * depth + "]" * depth).encode()
    elif kind == 3:
      base["prompt"] = rng.choice(["\"a\\ud800b\"", "[\"\\udc00\", \"ok\"]", "\"\\ud83d\"",
                                   "\"x\\udfff\\ud800y\""])
    elif kind == 4:
      base["seed"] = "9" * rng.choice([4301, 5000, 20000])
    else:
      return rng.choice([b"", b"{", b"{\"prompt\": [1, 2", b"\xff\xfe{}", b"nul\x00l",
                         bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
                         b"[1, 2]", b"\"text\"", b"{\"prompt\": [1] } trailing"])
  elif cls == "size":
    kind = rng.randrange(3)
    if kind == 0:  # many prompts in one request
      base["prompt"] = json.dumps([[1, 2]] * rng.choice([300, 1000, 4090]))
      base["n"] = str(rng.choice([1, 2, 4]))
    elif kind == 1:  # a long text prompt, past the context
      base["prompt"] = json.dumps("y" * rng.choice([100, 10_000, 200_000]))
    else:
      base["stop"] = json.dumps(["s" * rng.choice([1, 1000, 100_000])] * rng.choice([1, 17]))
  elif cls == "edge_valid":  # accepted requests at the edges of the ranges, answered quickly
    base = {"prompt": json.dumps(rng.choice([[1], [258] * 3, "h\u00e9llo \u4e16\u754c"])),
            "max_tokens": str(rng.randint(1, 3)), "n": str(rng.randint(1, 2)),
            "temperature": rng.choice(["0", "2", "1e-9", "0.7"]),
            "top_k": rng.choice(["0", "1", "258", "259", "100000"]),
            "top_p": rng.choice(["1", "1e-9", "0.5"]),
            "seed": rng.choice(["0", "-1", "18446744073709551615", "-9223372036854775808"]),
            "logprobs": rng.choice(["0", "5"]), "stream": rng.choice(["true", "false"]),
            "stop": rng.choice(["null", "\"\u00e9\"", "[\"a\", \"b\"]"])}
  return ("{" + ", ".join(f"\"{k}\": {v}" for k, v in base.items()) + "}").encode()


def _check_still_serving(live, client, reference, flat0, version0):
  eng = live.server.engine
  waiting.wait_until(lambda: eng.metrics()["active_slots"] == 0
                     and eng.metrics()["queue_depth"] == 0,
                     "the fuzzed requests to leave the engine (a slot or queue entry leaked)",
                     timeout_s=ANSWER_S)
  status, data = client.send("POST", "/v1/completions", json.dumps(REFERENCE).encode(),
                             what="the reference request")
  assert status == 200
  got = json.loads(data)["choices"][0]
  assert got["token_ids"] == reference["token_ids"]
  np.testing.assert_allclose(got["logprobs"]["token_logprobs"],
                             reference["logprobs"]["token_logprobs"], rtol=0, atol=1e-6)
  assert all(np.isfinite(got["logprobs"]["token_logprobs"]))
  assert eng.version == version0
  for k, v in flat0.items():
    np.testing.assert_array_equal(eng.current_flat()[k], v)
  status, data = client.send("GET", "/health", headers={"Content-Type": None}, what="/health")
  assert status == 200 and json.loads(data)["status"] == "ok"


@pytest.fixture(scope="module")
def baseline(live):
  client = _Client(live.port)
  status, data = client.send("POST", "/v1/completions", json.dumps(REFERENCE).encode(),
                             what="the reference request")
  assert status == 200
  eng = live.server.engine
  return json.loads(data)["choices"][0], {k: v.copy() for k, v in eng.current_flat().items()}, \
      eng.version


@pytest.mark.parametrize("cls", ["numeric", "types", "structure", "size", "edge_valid"])
def test_completions_fuzz(live, baseline, cls):
  reference, flat0, version0 = baseline
  rng = random.Random(f"{SEED}-{cls}")
  client = _Client(live.port)
  for i in range(PER_CLASS):
    body = _completion_body(rng, cls)
    client.send("POST", "/v1/completions", body, what=f"{cls} #{i}")
  if cls != "edge_valid":
    assert client.statuses.get(200, 0) < PER_CLASS // 4, client.statuses  # mostly refused
  else:
    assert client.statuses.get(200, 0) > PER_CLASS // 2, client.statuses  # mostly served
  _check_still_serving(live, client, reference, flat0, version0)


def test_content_types_fuzz(live, baseline):
  reference, flat0, version0 = baseline
  rng = random.Random(f"{SEED}-ctype")
  client = _Client(live.port)
  types = ["text/plain", None, "multipart/form-data; boundary=x", "application/xml",
           "application/x-www-form-urlencoded", "application/jsonx", "text/html; charset=utf-8",
           ""]
  for i in range(PER_CLASS):
    ctype = rng.choice(types)
    status, _ = client.send("POST", "/v1/completions", json.dumps(REFERENCE).encode(),
                            headers={"Content-Type": ctype}, what=f"content type {ctype!r}")
    assert status in (400, 415), f"{ctype!r} was accepted as JSON ({status})"
  _check_still_serving(live, client, reference, flat0, version0)


def _raw_http(port: int, data: bytes) -> bytes:
  with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    try:
      while chunk := s.recv(65536):
        out += chunk
    except ConnectionResetError:
      pass
    return out


def test_malformed_http_fuzz(live, baseline):
  reference, flat0, version0 = baseline
  rng = random.Random(f"{SEED}-http")
  messages = [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/9.9\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
              b"GET /health HTTP/1.1\r\nHost: " + b"h" * 20000 + b"\r\n\r\n",
              b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
              b"GET /\x00 HTTP/1.1\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Le"]
  for i in range(PER_CLASS):
    msg = rng.choice(messages + [bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))])
    out = _raw_http(live.port, msg)
    if out:
      status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/") else 0
      assert status < 500, f"{status} for malformed message {msg[:80]!r}: {out[:300]!r}"
      assert not _LEAK.search(out.decode("latin-1")), out[:500]
  _check_still_serving(live, _Client(live.port), reference, flat0, version0)


def _admin_requests(rng: random.Random, blob: bytes, nan_blob: bytes, ckpts, version: int):
  """(method, path, body, headers, what) for one bad admin request."""
  auth = {"Authorization": f"Bearer {TOKEN}"}
  kind = rng.randrange(7)
  if kind == 0:  # bad tokens
    bad = rng.choice([None, "", "Bearer", f"Bearer {TOKEN[:-1]}", f"bearer {TOKEN}",
                      f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer " + "A" * 5000,
                      f"Bearer  {TOKEN}", f"Bearer {TOKEN.upper()}"])
    body = json.dumps({"checkpoint": ckpts[0], "version": version + 1}).encode()
    return "POST", "/admin/swap", body, {"Authorization": bad}, f"token {bad!r}"[:80]
  if kind == 1:  # foreign Origin / Host, or a browser-style text/plain POST
    h = dict(auth)
    h.update(rng.choice([{"Origin": "http://evil.example"}, {"Host": "evil.example"},
                         {"Origin": "null"}, {"Content-Type": "text/plain"},
                         {"Host": "evil.example:80", "Origin": "http://evil.example",
                          "Content-Type": "text/plain"}]))
    body = json.dumps({"checkpoint": ckpts[0], "version": version + 1}).encode()
    return "POST", "/admin/swap", body, h, f"headers {h}"
  if kind == 2:  # versions
    v = rng.choice([x for x in NUMBERS + JUNK if x not in _VALID_VERSIONS])
    body = ("{\"checkpoint\": " + json.dumps(ckpts[0]) + ", \"version\": " + v + "}").encode()
    return "POST", "/admin/swap", body, auth, f"version {v[:40]}"
  if kind == 3:  # checkpoint paths
    p = rng.choice(["/root", "/etc", "/", "../../..", "", "/nonexistent", "\u0000", "x" * 5000,
                    "/proc/self", ckpts[1], ckpts[0] + "/../..", "~", "/dev/zero"])
    body = json.dumps({"checkpoint": p, "version": version + 1}).encode()
    return "POST", "/admin/swap", body, auth, f"checkpoint {p[:40]!r}"
  if kind == 4:  # broken swap bodies
    depth = rng.choice([33, 1000, 100_000])
    body = rng.choice([b"[" * depth + b"]" * depth, b"{", b"\xff", b"null", b"[]",
                       b"{\"checkpoint\": [" + b"[" * depth + b"]" * depth + b"]}",
                       b"{\"checkpoint\": \"\\ud800\", \"version\": 1}"])
    return "POST", "/admin/swap", body, auth, "swap body"
  h = {**auth, "Content-Type": "application/octet-stream"}
  if kind == 5:  # damaged deltas
    b = bytearray(blob)
    choice = rng.randrange(4)
    if choice == 0:
      b = b[:rng.randrange(len(b))]
    elif choice == 1:
      for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif choice == 2:
      b = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 4096)))
    else:
      b = b + b"\x00" * rng.randint(1, 64)
    return "POST", f"/admin/swap_delta?version={version + 1}", bytes(b), h, "damaged delta"
  v = rng.choice(["", "abc", "1e30", "-5", "9" * 5000, str(version + 1)])
  return "POST", f"/admin/swap_delta?version={v}", rng.choice([nan_blob, blob[:10]]), h, \
      f"NaN-weight or bad delta, version {v[:20]}"


def test_admin_fuzz(live, baseline, ckpts):
  from sync import delta
  reference, flat0, version0 = baseline
  eng = live.server.engine
  base = eng.current_flat()
  blob = delta.encode(base, {k: (v * 1.01).astype(v.dtype) for k, v in base.items()})
  nan_blob = delta.encode(base, {k: np.full_like(v, np.nan) for k, v in base.items()})
  rng = random.Random(f"{SEED}-admin")
  client = _Client(live.admin_port)
  for i in range(PER_CLASS * 7):  # 7 kinds of bad admin request, about PER_CLASS each
    method, path, body, headers, what = _admin_requests(rng, blob, nan_blob, ckpts, version0)
    status, data = client.send(method, path, body, headers, what=f"admin {what}")
    assert status >= 400, f"admin accepted {what}: {data[:300]!r}"
    text = data.decode("utf-8", "replace")
    assert "/root/" not in text and "bin" not in json.loads(data)["error"]["message"].split(), \
        f"admin revealed a listing for {what}: {text[:300]}"
  _check_still_serving(live, _Client(live.port), reference, flat0, version0)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
