"""The admin app (rollout.admin) against live servers on 127.0.0.1: weight swaps by delta and by
checkpoint, and what it refuses -- requests without the (generated) token, foreign Host/Origin
headers, wrong content types, over-long bodies before they are read, versions outside
[0, 2^63), and checkpoints outside the checkpoint root, without telling what exists there.
"""

import asyncio
import http.client
import json
import os
import socket
import stat
import sys

import numpy as np
import pytest

from moe import hf
from rollout import admin as admin_lib
from rollout import server as server_lib
from rollout import testing

WAIT_S = 120  # generous under load; every wait fails loudly when it runs out


def _live(engine, **kw):
  """A LiveServer with the admin app, its waits bounded by WAIT_S."""
  return testing.LiveServer(engine, admin=True, timeout_s=WAIT_S, **kw)


def _request(port, method, path, body=None, headers=None):
  """(status, decoded JSON body) of one request; `headers` may set Host itself."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
  try:
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, json.loads(r.read())
  finally:
    conn.close()


def _swap(live, body, headers=None):
  return _request(live.admin_port, "POST", "/admin/swap", json.dumps(body).encode(),
                  headers if headers is not None else
                  live.admin_auth(**{"Content-Type": "application/json"}))


def _message(out):
  return out["error"]["message"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """The checkpoint root: a tiny HF checkpoint under it (`ckpt`)."""
  r = tmp_path_factory.mktemp("root")
  hf.save_pretrained(testing.tiny_model(seed=3), str(r / "ckpt"),
                     architecture="MixtralForCausalLM")
  return r


@pytest.fixture(scope="module")
def engine(root):
  from rollout import loading
  from rollout.engine import EngineConfig
  eng = loading.load_engine(EngineConfig(max_slots=4, max_len=64, decode_steps=4, max_queue=4),
                            hf_checkpoint=str(root / "ckpt"), max_seq_len=64)
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def live(engine, root, tmp_path_factory):
  """No token given: one is generated and written to a token file."""
  from rollout import loading
  token_file = tmp_path_factory.mktemp("secret") / "admin_token"
  token_file.write_text("stale\n")
  os.chmod(token_file, 0o644)  # an old, readable file: must come back 0600 with the new token
  srv = _live(engine, admin_token_file=str(token_file), checkpoint_root=str(root),
              load_flat=lambda p: loading.load_flat(p, engine.model_config))
  srv.token_file = token_file
  yield srv
  srv.close()


def test_swaps_by_delta_and_by_checkpoint(live, root):
  from sync import delta
  eng = live.server.engine
  base = {k: v.copy() for k, v in eng.current_flat().items()}
  new = {k: (v * 1.01).astype(v.dtype) for k, v in base.items()}
  blob = delta.encode(base, new)
  url = f"/admin/swap_delta?version={eng.version + 1}"
  octet = {"Content-Type": "application/octet-stream"}
  status, _ = _request(live.admin_port, "POST", url, blob, octet)
  assert status == 401  # no token
  status, out = _request(live.admin_port, "POST", url, blob[:-5], live.admin_auth(**octet))
  assert status == 400 and "delta" in _message(out)
  v = eng.version + 1
  status, out = _request(live.admin_port, "POST", url, blob, live.admin_auth(**octet))
  assert status == 200 and out["version"] == v and eng.version == v
  status, out = _request(live.port, "POST", "/v1/completions",
                         json.dumps({"prompt": [3, 4], "max_tokens": 2}).encode(),
                         {"Content-Type": "application/json"})
  assert status == 200 and out["choices"][0]["policy_version"] == v
  # A path relative to the root, and an absolute one under it.
  status, out = _swap(live, {"checkpoint": "ckpt", "version": v + 1})
  assert status == 200 and eng.version == v + 1
  for k in base:
    np.testing.assert_array_equal(eng.current_flat()[k], base[k])
  status, out = _swap(live, {"checkpoint": str(root / "ckpt"), "version": v + 2})
  assert status == 200 and eng.version == v + 2
  status, _ = _request(live.admin_port, "GET", "/admin/status", headers=live.admin_auth())
  assert status == 200


def test_generated_token_is_required_and_written_0600(live):
  assert live.server.admin.token_generated and len(live.admin_token) >= 32
  assert live.token_file.read_text().strip() == live.admin_token
  assert stat.S_IMODE(os.stat(live.token_file).st_mode) == 0o600
  for headers in ({}, {"Authorization": "Bearer stale"}, {"Authorization": live.admin_token},
                  {"Authorization": f"Bearer {live.admin_token}x"},
                  {"Authorization": "Bearer \u00e9t\u00e9"}):
    status, out = _request(live.admin_port, "GET", "/admin/status", headers=headers)
    assert status == 401 and out["error"]["type"] == "authentication_error", headers
  assert _request(live.admin_port, "GET", "/admin/status", headers=live.admin_auth())[0] == 200
  assert "in " + str(live.token_file) in live.server.admin.token_notice()
  # Without a file the generated token is what the start-up line shows; "" is no token.
  other = admin_lib.Admin(live.server.engine, token="")
  assert other.token_generated and other.token in other.token_notice()
  assert admin_lib.Admin(live.server.engine, token="given").token_notice().count("given") == 1


def test_foreign_host_or_origin_is_refused(live):
  eng = live.server.engine
  v = eng.version
  p = live.admin_port
  # What a web page open in a browser on this machine sends after rebinding its DNS name to
  # 127.0.0.1: a "simple" text/plain POST; refused even with the right token.
  for headers in ({"Host": f"evil.example:{p}", "Origin": f"http://evil.example:{p}"},
                  {"Host": f"evil.example:{p}"},
                  {"Origin": "http://evil.example"},
                  {"Origin": "null"},
                  {"Origin": f"https://127.0.0.1:{p}"},
                  {"Host": f"127.0.0.1:{p + 1}"},
                  {"Host": "127.0.0.1"}):
    status, out = _request(p, "POST", "/admin/swap",
                           json.dumps({"checkpoint": "ckpt", "version": v + 1}).encode(),
                           live.admin_auth(**{"Content-Type": "text/plain"}, **headers))
    assert status == 403 and out["error"]["type"] == "forbidden", headers
  assert eng.version == v
  for headers in ({"Host": f"localhost:{p}"}, {"Host": f"[::1]:{p}"},
                  {"Host": f"LOCALHOST:{p}", "Origin": f"http://localhost:{p}"},
                  {"Origin": f"http://127.0.0.1:{p}"}):
    assert _request(p, "GET", "/admin/status", headers=live.admin_auth(**headers))[0] == 200, headers


def test_host_check_when_bound_to_all_interfaces(engine):
  live = _live(engine, admin_host="0.0.0.0", admin_allowed_hosts=["sampler-3.cluster"])
  try:
    p = live.admin_port
    for host in (f"127.0.0.1:{p}", f"10.1.2.3:{p}", f"sampler-3.cluster:{p}"):
      assert _request(p, "GET", "/admin/status", headers=live.admin_auth(Host=host))[0] == 200, host
    for host in (f"evil.example:{p}", f"sampler-3.cluster:{p + 1}"):
      assert _request(p, "GET", "/admin/status", headers=live.admin_auth(Host=host))[0] == 403, host
  finally:
    live.close()


def test_admin_binds_loopback_whatever_the_public_host(engine):
  srv = server_lib.Server(engine)
  loop = asyncio.new_event_loop()
  try:
    _, admin_port = loop.run_until_complete(srv.start("0.0.0.0", 0, 0))
    addrs = [s.getsockname()[0] for r in srv._runners[1:] for site in r.sites
             for s in site._server.sockets]
    assert addrs == ["127.0.0.1"] and admin_port
  finally:
    loop.run_until_complete(srv.stop())
    loop.close()


def test_wrong_content_types_are_refused(live):
  p = live.admin_port
  body = json.dumps({"checkpoint": "ckpt", "version": 1}).encode()
  for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                None):
    headers = live.admin_auth(**({"Content-Type": ctype} if ctype else {}))
    status, out = _request(p, "POST", "/admin/swap", body, headers)
    assert status == 415 and "application/json" in _message(out), ctype
    status, out = _request(p, "POST", "/admin/swap_delta?version=1", b"x" * 10, headers)
    assert status == 415 and "application/octet-stream" in _message(out), ctype
  # Parameters such as a charset are fine: the request reaches validation.
  status, out = _swap(live, {"version": 1, "x": 2},
                      live.admin_auth(**{"Content-Type": "application/json; charset=utf-8"}))
  assert status == 400 and "body must be" in _message(out)


def test_body_limit_fits_a_delta_and_long_bodies_are_refused_unread(live):
  from sync import delta
  eng = live.server.engine
  flat = eng.current_flat()
  limit = live.server.admin.max_delta_bytes
  weight_bytes = sum(v.nbytes for v in flat.values())
  assert limit == admin_lib.delta_body_limit(flat) < 2 * weight_bytes + (2 << 20)
  # A delta that rewrites every bit of every weight fits.
  rng = np.random.default_rng(0)
  scrambled = {k: rng.integers(0, 256, v.nbytes, dtype=np.uint8).view(v.dtype).reshape(v.shape)
               for k, v in flat.items()}
  assert len(delta.encode(flat, scrambled)) < limit
  # A Content-Length over the limit is answered before a byte of the body is sent.
  with socket.create_connection(("127.0.0.1", live.admin_port), timeout=WAIT_S) as s:
    s.sendall((f"POST /admin/swap_delta?version={eng.version + 1} HTTP/1.1\r\n"
               f"Host: 127.0.0.1:{live.admin_port}\r\n"
               f"Authorization: Bearer {live.admin_token}\r\n"
               "Content-Type: application/octet-stream\r\n"
               f"Content-Length: {limit + 1}\r\n\r\n").encode())
    head = s.recv(4096).decode("latin-1")
  assert head.startswith("HTTP/1.1 413"), head
  with socket.create_connection(("127.0.0.1", live.admin_port), timeout=WAIT_S) as s:
    s.sendall((f"POST /admin/swap HTTP/1.1\r\nHost: 127.0.0.1:{live.admin_port}\r\n"
               f"Authorization: Bearer {live.admin_token}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {admin_lib.MAX_SWAP_JSON_BYTES + 1}\r\n\r\n").encode())
    head = s.recv(4096).decode("latin-1")
  assert head.startswith("HTTP/1.1 413"), head


def test_chunked_body_over_the_limit_is_cut_off(engine):
  live = _live(engine, admin_token="t0ken", max_delta_bytes=1000)
  try:
    def chunks():
      for _ in range(100):
        yield b"x" * 100
    v = engine.version
    status, out = _request(live.admin_port, "POST", f"/admin/swap_delta?version={v + 1}",
                           chunks(), live.admin_auth(**{"Content-Type": "application/octet-stream"}))
    assert status == 413 and "1000" in _message(out) and engine.version == v
  finally:
    live.close()


@pytest.mark.parametrize("version", [10**30, 1e30, -5, True, 1.5, 2**63, "1e30", "-5", "5" * 5000,
                                     "\u00b2", None, [1]])
def test_versions_outside_0_to_2_63_are_400s_naming_version(live, version):
  eng = live.server.engine
  v = eng.version
  status, out = _swap(live, {"checkpoint": "ckpt", "version": version})
  assert status == 400 and "'version'" in _message(out), out
  assert len(_message(out)) < 200
  if isinstance(version, str):
    q = version.encode("utf-8").decode("latin-1") if version.isascii() else "%C2%B2"
    status, out = _request(live.admin_port, "POST", f"/admin/swap_delta?version={q}", b"x",
                           live.admin_auth(**{"Content-Type": "application/octet-stream"}))
    assert status == 400 and "'version'" in _message(out), out
  assert eng.version == v


def test_hostile_json_bodies_are_400s(live):
  v = live.server.engine.version
  headers = live.admin_auth(**{"Content-Type": "application/json"})
  for raw in (b"[" * 20_000 + b"]" * 20_000, b'{"version": ' + b"7" * 5000 + b"}",
              b"\xff\xfe", b"{"):
    status, out = _request(live.admin_port, "POST", "/admin/swap", raw, headers)
    assert status == 400 and ("malformed JSON body" in _message(out)
                              or "not UTF-8" in _message(out)), out
    assert "Traceback" not in _message(out)
  assert live.server.engine.version == v


def test_checkpoints_outside_the_root_or_unloadable_reveal_nothing(live, root, tmp_path):
  eng = live.server.engine
  v = eng.version
  (root / "empty").mkdir(exist_ok=True)
  os.symlink(tmp_path, root / "link_out", target_is_directory=True)
  outside = set()
  for path in ("/root", "/etc", "/", "..", "../..", "ckpt/../..", str(tmp_path),
               "link_out", "link_out/x"):
    status, out = _swap(live, {"checkpoint": path, "version": v + 1})
    assert status == 400, (path, out)
    outside.add(_message(out))
  assert outside == {"'checkpoint' must be a directory under the server's checkpoint root"}
  # Under the root, a missing directory and one that is not a checkpoint answer alike.
  unloadable = set()
  for path in ("missing", "empty", "ckpt/config.json", str(root / "nope")):
    status, out = _swap(live, {"checkpoint": path, "version": v + 1})
    assert status == 400, (path, out)
    unloadable.add(_message(out))
  assert unloadable == {"cannot load checkpoint: see the server log"}
  for bad in ("", "a\0b", "x" * 5000, 3, None, "ckpt\ud800"):
    status, out = _swap(live, {"checkpoint": bad, "version": v + 1})
    assert status == 400 and "'checkpoint'" in _message(out), bad
  assert eng.version == v


def test_swaps_by_path_are_off_without_a_root(engine, root):
  from rollout import loading
  live = _live(engine, load_flat=lambda p: loading.load_flat(p, engine.model_config))
  try:
    status, out = _swap(live, {"checkpoint": str(root / "ckpt"), "version": engine.version + 1})
    assert status == 403 and "--checkpoint_root" in _message(out)
  finally:
    live.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
