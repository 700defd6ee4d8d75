"""The HTTP server against a live instance on 127.0.0.1 (free port): the official openai client,
streaming, bad inputs, backpressure, timeouts, disconnects and metrics (the admin app:
admin_test.py). The engine is built as `bazel run //tools:serve -- --hf_checkpoint=DIR` builds it
(rollout.loading.load_engine).
"""

import asyncio
import http.client
import json
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from moe import hf
from rollout import server as server_lib
from rollout import testing
from rollout.sampling import SamplingParams
from testlib import waiting

TOKEN = "s3cret"


class _Live:
  """A Server on its own event loop thread."""

  def __init__(self, engine, **kw):
    self.loop = asyncio.new_event_loop()
    self.server = server_lib.Server(engine, admin_token=TOKEN, **kw)
    threading.Thread(target=self.loop.run_forever, daemon=True).start()
    self.port, self.admin_port = asyncio.run_coroutine_threadsafe(
        self.server.start("127.0.0.1", 0, 0), self.loop).result(60)

  def close(self):
    asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
    self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf")
  hf.save_pretrained(testing.tiny_model(seed=3), str(d), architecture="MixtralForCausalLM")
  return str(d)


@pytest.fixture(scope="module")
def live(ckpt):
  from rollout import loading
  from rollout.engine import EngineConfig
  engine = loading.load_engine(EngineConfig(max_slots=4, max_len=64, decode_steps=4, max_queue=4),
                               hf_checkpoint=ckpt, max_seq_len=64)
  srv = _Live(engine, model_name="tiny", request_timeout=60.0,
              load_flat=lambda p: loading.load_flat(p, engine.model_config))
  yield srv
  srv.close()
  engine.stop()


@pytest.fixture(scope="module")
def client(live):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key="unused",
                       max_retries=0, timeout=120)


def _post(port, path, body, headers=None, raw=None):
  data = raw if raw is not None else json.dumps(body).encode()
  req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                               headers={"Content-Type": "application/json", **(headers or {})})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, json.loads(r.read()), r.headers
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), e.headers


def test_openai_client_completions(client, live):
  eng = live.server.engine
  r = client.completions.create(model="tiny", prompt=[5, 17, 200, 3], max_tokens=6,
                                temperature=0, logprobs=0)
  ch = r.choices[0]
  ref = eng.generate([5, 17, 200, 3], max_tokens=6, temperature=0.0)[0]
  assert ch.model_extra["token_ids"] == ref.token_ids
  np.testing.assert_allclose(ch.logprobs.token_logprobs, ref.logprobs, atol=0)
  assert ch.finish_reason == "length"
  routing = np.asarray(ch.model_extra["routing"])
  assert routing.shape == (eng.model_config.num_moe_layers, 6, 2)
  assert ch.model_extra["policy_version"] == eng.version
  assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 4
  # Without 'logprobs' the sampled-token logprobs still come back; with 'logprobs': 2 also the
  # two most likely alternatives (greedy: the sampled token is the first of them).
  plain = client.completions.create(model="tiny", prompt=[5, 17, 200, 3], max_tokens=6,
                                    temperature=0)
  assert plain.choices[0].logprobs.token_logprobs == ch.logprobs.token_logprobs
  top = client.completions.create(model="tiny", prompt=[5, 17, 200, 3], max_tokens=6,
                                  temperature=0, logprobs=2).choices[0]
  ids = top.logprobs.model_extra["top_logprob_ids"]
  assert [len(t) for t in ids] == [2] * 6
  assert [t[0][0] for t in ids] == ref.token_ids
  np.testing.assert_allclose([t[0][1] for t in ids], ref.logprobs, atol=1e-6)
  assert all(t[0][1] >= t[1][1] for t in ids)
  r = client.completions.create(model="tiny", prompt=["Hello", "Bye"], max_tokens=3, n=2,
                                seed=7, temperature=1.0, extra_body={"top_k": 10})
  assert [c.index for c in r.choices] == [0, 1, 2, 3]
  assert all(len(c.model_extra["token_ids"]) == 3 for c in r.choices)
  again = client.completions.create(model="tiny", prompt=["Hello", "Bye"], max_tokens=3, n=2,
                                    seed=7, temperature=1.0, extra_body={"top_k": 10})
  assert [c.model_extra["token_ids"] for c in r.choices] == \
      [c.model_extra["token_ids"] for c in again.choices]


def test_streaming_matches_plain(client):
  plain = client.completions.create(model="tiny", prompt="Hi there", max_tokens=9, temperature=0)
  toks, text, reasons = [], "", []
  for chunk in client.completions.create(model="tiny", prompt="Hi there", max_tokens=9,
                                         temperature=0, stream=True):
    c = chunk.choices[0]
    toks += c.model_extra.get("token_ids") or []
    text += c.text
    reasons.append(c.finish_reason)
  assert toks == plain.choices[0].model_extra["token_ids"]
  assert text == plain.choices[0].text
  assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


@pytest.mark.parametrize("body,fragment", [
    ({"prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "8"}, "max_tokens"),
    ({"prompt": [1, 2], "bogus": 1}, "unknown field"),
    ({"prompt": [1, 99999]}, "outside the vocabulary"),
    ({"prompt": [1, -1]}, "outside the vocabulary"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [1] * 70, "max_tokens": 2}, "context length"),
    ({"prompt": []}, "empty"),
    ({"max_tokens": 2}, "'prompt' is required"),
    ({"prompt": [1], "temperature": "hot"}, "temperature"),
    ({"prompt": [1], "n": 0}, "'n'"),
    ({"prompt": [1], "n": 5}, "slots"),
    ({"prompt": [1], "top_p": 0}, "top_p"),
    ({"prompt": [1], "stop": [""]}, "stop"),
    ({"prompt": [1], "logprobs": 6}, "logprobs"),
    ({"prompt": [1], "stream": "yes"}, "stream"),
    ([1, 2], "JSON object"),
])
def test_bad_input_is_400_and_server_keeps_serving(live, body, fragment):
  status, out, _ = _post(live.port, "/v1/completions", body)
  assert status == 400, out
  assert fragment in out["error"]["message"]
  status, _, _ = _post(live.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
  assert status == 200


def test_malformed_json_is_400(live):
  status, out, _ = _post(live.port, "/v1/completions", None, raw=b"{not json")
  assert status == 400 and "malformed JSON" in out["error"]["message"]


def test_backpressure_429_and_timeout_504(live):
  eng = live.server.engine
  # The busy request's stream callback runs on the engine thread and waits on `gate`, so the
  # engine holds all 4 slots until the test lets it go: the queue cannot drain however fast or
  # slow this machine is.
  entered, gate = threading.Event(), threading.Event()

  def hold(*_):
    entered.set()
    gate.wait(60)

  busy = eng.submit([1, 2, 3], SamplingParams(n=4, max_tokens=55, ignore_eos=True),
                    on_tokens=hold)
  try:
    assert entered.wait(60)
    assert eng.metrics()["active_slots"] == 4
    queued = eng.submit([1, 2], SamplingParams(n=4, max_tokens=2))
    status, out, headers = _post(live.port, "/v1/completions", {"prompt": [1], "max_tokens": 2})
    assert status == 429 and headers["Retry-After"] == "1"
  finally:
    busy.cancel()
    gate.set()
  assert len(queued.result(timeout=60)) == 4
  status, out, _ = _post(live.port, "/v1/completions",
                         {"prompt": [1], "max_tokens": 50, "timeout": 0.001, "ignore_eos": True})
  assert status == 504 and "timed out" in out["error"]["message"]


def test_client_disconnect_cancels_the_request(live, monkeypatch):
  from rollout import device_programs
  eng = live.server.engine
  before = eng.stats["cancelled_total"]
  disconnects = live.server.http_stats["client_disconnects_total"]

  def idle():
    m = eng.metrics()
    return m["active_slots"] == 0 and m["queue_depth"] == 0

  # So that the first decode call after the patch below is this test's request's.
  waiting.wait_until(idle, "the engine to finish the earlier tests' requests")
  # The engine's first decode call for the request waits on `gate`, so the request cannot
  # finish before the server notices the disconnect, however fast or slow this machine is.
  entered, gate = threading.Event(), threading.Event()
  real = device_programs.decode_chunk

  def held(*a, **kw):
    entered.set()
    gate.wait(60)
    return real(*a, **kw)

  monkeypatch.setattr(device_programs, "decode_chunk", held)
  conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
  try:
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 60,
                                                        "n": 4, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    waiting.wait_event(entered, "the request's first decode call")
    conn.close()
    waiting.wait_until(
        lambda: live.server.http_stats["client_disconnects_total"] != disconnects,
        "the server to notice the disconnect")
  finally:
    gate.set()
    conn.close()
  waiting.wait_until(lambda: eng.stats["cancelled_total"] != before,
                     "the engine to cancel the request")
  assert live.server.http_stats["client_disconnects_total"] == disconnects + 1
  assert eng.stats["cancelled_total"] == before + 1


def test_health_and_metrics(live):
  with urllib.request.urlopen(f"http://127.0.0.1:{live.port}/health") as r:
    assert json.loads(r.read())["status"] == "ok"
  with urllib.request.urlopen(f"http://127.0.0.1:{live.port}/metrics") as r:
    text = r.read().decode()
  for name in ("rollout_queue_depth", "rollout_tokens_per_second", "rollout_batch_occupancy",
               "rollout_policy_version", "rollout_generated_tokens_total"):
    assert f"\n{name} " in "\n" + text


def test_health_reports_failing_checks(live):
  state = {"problem": None}

  def weights_fresh():
    return state["problem"]

  def broken():
    raise RuntimeError("boom")

  other = _Live(live.server.engine, health_checks=[weights_fresh])
  try:
    url = f"http://127.0.0.1:{other.port}/health"
    with urllib.request.urlopen(url) as r:
      assert json.loads(r.read())["status"] == "ok"
    state["problem"] = "weights are 3 versions behind the published 7"
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(url)
    assert e.value.code == 503
    assert json.loads(e.value.read())["problems"] == [state["problem"]]
  finally:
    other.close()
  other = _Live(live.server.engine, health_checks=[broken])
  try:
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(f"http://127.0.0.1:{other.port}/health")
    assert e.value.code == 503
    assert "broken failed: RuntimeError" in json.loads(e.value.read())["problems"][0]
  finally:
    other.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
