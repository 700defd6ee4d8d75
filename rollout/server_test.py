"""The HTTP server against a live instance on 127.0.0.1 (free port): the official openai client,
streaming, bad inputs, backpressure, timeouts, disconnects and metrics (the admin app:
admin_test.py). The engine is built as `bazel run //tools:serve -- --hf_checkpoint=DIR` builds it
(rollout.loading.load_engine).
"""

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
  srv = testing.LiveServer(engine, model_name="tiny", request_timeout=60.0)
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
  """The streamed chunks add up to the plain answer: ids, text, logprobs and (`logprobs: 2`)
  each token's two alternatives."""
  kw = dict(model="tiny", prompt="Hi there", max_tokens=9, temperature=0, logprobs=2)
  plain = client.completions.create(**kw).choices[0]
  toks, text, reasons, lps, top_ids = [], "", [], [], []
  for chunk in client.completions.create(stream=True, **kw):
    c = chunk.choices[0]
    toks += c.model_extra.get("token_ids") or []
    text += c.text
    reasons.append(c.finish_reason)
    if c.logprobs is not None:
      lps += c.logprobs.token_logprobs
      top_ids += c.logprobs.model_extra["top_logprob_ids"]
  assert toks == plain.model_extra["token_ids"]
  assert text == plain.text
  assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
  np.testing.assert_allclose(lps, plain.logprobs.token_logprobs, atol=testing.ATOL)
  want = plain.logprobs.model_extra["top_logprob_ids"]
  assert [[i for i, _ in t] for t in top_ids] == [[i for i, _ in t] for t in want]
  assert all(len(t) == 2 for t in top_ids) and len(top_ids) == 9
  np.testing.assert_allclose([[v for _, v in t] for t in top_ids],
                             [[v for _, v in t] for t in want], atol=testing.ATOL)


def test_streamed_usage_when_asked(client):
  """`stream_options.include_usage`: one last event with no choices and the plain answer's
  usage (token ids counted as streamed)."""
  kw = dict(model="tiny", prompt=["Hi there", "Bye"], max_tokens=7, n=2, temperature=1.0,
            seed=4, extra_body={"ignore_eos": True})
  plain = client.completions.create(**kw)
  chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                          **kw))
  assert chunks[-1].choices == [] and all(c.choices for c in chunks[:-1])
  assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens == 2 * (8 + 3)
  assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 4 * 7
  assert all(c.usage is None for c in client.completions.create(stream=True, **kw))


def test_chat_on_a_model_without_a_chat_template_is_400(live):
  """The byte-level model has no chat template: chat requests are refused, saying so."""
  status, out, _ = _post(live.port, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})
  assert status == 400 and "this model has no chat template" in out["error"]["message"]


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
    ({"prompt": [1], "stop_token_ids": 0}, "'stop_token_ids'"),
    ({"prompt": [1], "stop_token_ids": {}}, "'stop_token_ids'"),
    ({"prompt": [1], "stop_token_ids": False}, "'stop_token_ids'"),
    ({"prompt": "a\ud800b"}, "'prompt' is not valid Unicode"),
    ({"prompt": ["ok", "\udfff"]}, "'prompt'[1] is not valid Unicode"),
    ({"prompt": [[1]] * 129, "n": 2}, "at most 256 per request"),
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


@pytest.mark.parametrize("raw,fragment", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than"),
    (b'{"prompt": [1], "max_tokens": ' + b"7" * 5000 + b"}", "too many digits"),
    (b'{"prompt": [1], "user": "\xc3\x28"}', "not UTF-8"),
])
def test_bodies_json_cannot_take_are_400_without_internals(live, raw, fragment):
  status, out, _ = _post(live.port, "/v1/completions", None, raw=raw)
  assert status == 400, out
  message = out["error"]["message"]
  assert fragment in message and "Error" not in message and len(message) < 200, message


def test_messages_quoting_client_values_are_short(live):
  status, out, _ = _post(live.port, "/v1/completions",
                         {"prompt": [1], "temperature": "x" * 1_000_000})
  assert status == 400 and "'temperature'" in out["error"]["message"]
  assert len(out["error"]["message"]) < 300


def test_a_json_content_type_is_required(live):
  body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
  for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    try:
      conn.request("POST", "/v1/completions", body, {"Content-Type": ctype} if ctype else {})
      r = conn.getresponse()
      assert r.status == 415, ctype
      assert "application/json" in json.loads(r.read())["error"]["message"]
    finally:
      conn.close()
  status, _, _ = _post(live.port, "/v1/completions", None, raw=body,
                       headers={"Content-Type": "application/json; charset=utf-8"})
  assert status == 200


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
  eng = live.server.engine
  before = eng.stats["cancelled_total"]
  disconnects = live.server.http_stats["client_disconnects_total"]
  # The engine's first decode call for the request waits on `gate`, so the request cannot
  # finish before the server notices the disconnect, however fast or slow this machine is.
  entered, gate = testing.hold_decode(eng, monkeypatch)
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


def test_usage_and_metrics_report_the_prefix_cache(ckpt):
  from rollout import loading
  from rollout.engine import EngineConfig
  engine = loading.load_engine(
      EngineConfig(max_slots=4, max_len=64, decode_steps=4, prefix_cache_blocks=16,
                   prefix_block_size=4), hf_checkpoint=ckpt, max_seq_len=64)
  srv = testing.LiveServer(engine, model_name="tiny", request_timeout=60.0)
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 255, 18)]
    ask = lambda n: client.completions.create(model="tiny", prompt=prompt, max_tokens=2, n=n,
                                              temperature=0).usage
    first, again, two = ask(1), ask(1), ask(2)
    assert first.prompt_tokens_details.cached_tokens == 0
    # 16 = four whole blocks of the 18-token prompt (the last token is always computed);
    # counted per completion, as prompt_tokens is.
    assert again.prompt_tokens_details.cached_tokens == 16 and again.prompt_tokens == 18
    assert two.prompt_tokens_details.cached_tokens == 32 and two.prompt_tokens == 36
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics") as r:
      text = "\n" + r.read().decode()
    m = engine.metrics()
    assert m["prefix_cache_hit_tokens_total"] == 32 and m["prefix_cache_lookups_total"] == 3
    for key in ("hits_total", "hit_tokens_total", "lookups_total", "hit_rate", "blocks",
                "evictions_total", "invalidations_total"):
      assert f"\nrollout_prefix_cache_{key} {float(m['prefix_cache_' + key]):g}\n" in text, key
    assert "\nrollout_prefix_cache_hit_rate 0.592593\n" in text  # 32 of 54 tokens looked up
  finally:
    srv.close()
    engine.stop()


def test_health_reports_failing_checks(live):
  state = {"problem": None}

  def weights_fresh():
    return state["problem"]

  def broken():
    raise RuntimeError("boom")

  other = testing.LiveServer(live.server.engine, health_checks=[weights_fresh])
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
  other = testing.LiveServer(live.server.engine, health_checks=[broken])
  try:
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(f"http://127.0.0.1:{other.port}/health")
    assert e.value.code == 503
    assert "broken failed: RuntimeError" in json.loads(e.value.read())["problems"][0]
  finally:
    other.close()


@pytest.mark.parametrize("stop", [None, ["a", "e", "o", " ", "\n", "\x00"]])
def test_streamed_text_equals_plain_text_with_multibyte_text(client, live, stop):
  """The tiny random model samples bytes, so chunk boundaries split multi-byte characters (and
  invalid UTF-8 turns up); the streamed pieces must still add up to the plain text exactly."""
  tok = live.server.tokenizer
  splits, reasons = 0, set()
  for seed in range(8):
    kw = dict(model="tiny", prompt=f"hé{seed} 日本 🙂", max_tokens=40,  # 15 bytes + 40 <= 64
              temperature=1.0, seed=seed, stop=stop)
    plain = client.completions.create(**kw).choices[0]
    toks, text, seen = [], "", []
    for chunk in client.completions.create(stream=True, **kw):
      c = chunk.choices[0]
      toks += c.model_extra.get("token_ids") or []
      text += c.text
      seen.append(list(toks))
    assert toks == plain.model_extra["token_ids"], seed
    assert text == plain.text, (seed, text, plain.text)
    reasons.add(plain.finish_reason)
    # A boundary inside a character: the prefix decodes to a trailing U+FFFD that the whole
    # text does not have there.
    splits += any(tok.decode(p).endswith("\ufffd") and
                  plain.text[len(tok.decode(p)) - 1:len(tok.decode(p))] != "\ufffd"
                  for p in seen)
  # The cases the test is for did happen (the model and seeds are fixed: this is not luck).
  if stop:
    assert "stop" in reasons, "no stop string ended a completion"
  else:
    assert splits, "no chunk boundary split a character"


def test_a_multi_token_stop_string_streams_the_ids_that_wrote_it(client, live):
  """A stop string the model writes over several tokens: plain and streamed choices both return
  the ids up to the one that completes it (decoding to the text plus the stop string), and the
  streamed ids and text add up to the plain ones. Seeded sampling, so stops land anywhere in
  the engine's 4-token chunks."""
  tok = live.server.tokenizer
  checked = 0
  for seed in range(10):
    kw = dict(model="tiny", prompt="Hi there", max_tokens=40, temperature=1.0, seed=seed)
    free = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    text = tok.decode(free)
    at = next((i for i in range(1, len(free) - 3) if all(t < 128 for t in free[i:i + 3]) and
               text.find(tok.decode(free[i:i + 3])) == len(tok.decode(free[:i]))), None)
    if at is None:
      continue
    checked += 1
    stop = tok.decode(free[at:at + 3])
    plain = client.completions.create(stop=[stop], **kw).choices[0]
    ids = plain.model_extra["token_ids"]
    assert plain.finish_reason == "stop" and ids == free[:at + 3], (seed, stop)
    assert tok.decode(ids) == plain.text + stop
    assert len(plain.logprobs.token_logprobs) == len(plain.model_extra["policy_versions"]) == 3 + at
    assert len(plain.model_extra["routing"][0]) == len(ids)
    toks, streamed = [], ""
    for chunk in client.completions.create(stream=True, stop=[stop], **kw):
      toks += chunk.choices[0].model_extra.get("token_ids") or []
      streamed += chunk.choices[0].text
    assert toks == ids and streamed == plain.text, seed
  assert checked >= 3, "too few seeds wrote a usable stop string (the model and seeds are fixed)"


def test_health_answers_while_a_prompt_is_tokenized(live):
  """Tokenizing (and parsing) runs off the event loop: a slow one does not block /health."""
  entered, gate = threading.Event(), threading.Event()
  real = live.server.tokenizer

  class Slow:
    eos_id = real.eos_id

    def encode(self, text):
      entered.set()
      gate.wait(120)
      return real.encode(text)

    def decode(self, ids):
      return real.decode(ids)

  other = testing.LiveServer(live.server.engine)
  other.server.tokenizer = Slow()
  out = {}
  sender = threading.Thread(target=lambda: out.update(r=_post(
      other.port, "/v1/completions", {"prompt": "hello", "max_tokens": 1})))
  try:
    sender.start()
    waiting.wait_event(entered, "the server to start tokenizing the prompt")
    with urllib.request.urlopen(f"http://127.0.0.1:{other.port}/health", timeout=30) as r:
      assert r.status == 200
    assert not gate.is_set() and sender.is_alive()
  finally:
    gate.set()
    sender.join(120)
    other.close()
  assert out["r"][0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_stuck_engine_loop_still_gets_an_answer_by_the_timeout(live, monkeypatch, stream):
  """The engine thread is held inside a decode call, so it can neither finish nor expire the
  request: the handler answers by itself (504, or a stream ending in "timeout")."""
  entered, gate = testing.hold_decode(live.server.engine, monkeypatch)
  body = {"prompt": [1, 2], "max_tokens": 30, "ignore_eos": True, "timeout": 0.5,
          "stream": stream}
  out = {}

  def send():
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    try:
      conn.request("POST", "/v1/completions", json.dumps(body),
                   {"Content-Type": "application/json"})
      r = conn.getresponse()
      out["status"], out["body"] = r.status, r.read().decode()
    finally:
      conn.close()

  sender = threading.Thread(target=send)
  try:
    sender.start()
    waiting.wait_event(entered, "the engine to enter a decode call")
    sender.join(0.5 + server_lib.TIMEOUT_GRACE_S + 60)
    assert not sender.is_alive(), "no answer while the engine loop is stuck"
    assert not gate.is_set()
  finally:
    gate.set()
    sender.join(120)
  if not stream:
    assert out["status"] == 504 and "timed out" in json.loads(out["body"])["error"]["message"]
  else:
    events = [e[len("data: "):] for e in out["body"].split("\n\n") if e]
    assert out["status"] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "timeout"


def test_a_small_request_is_served_while_a_huge_one_runs(ckpt, monkeypatch):
  """One request at the completions cap must not hold the server: a 1-token request sent while
  it runs finishes long before it (the engine schedules submissions fairly; the handler submits
  each HTTP request as one submission). Order-based: the engine is held on its first decode call
  until the small request is queued, and the order the engine completes prompts in is recorded,
  so the machine's speed does not matter."""
  from rollout import device_programs
  from rollout import loading
  from rollout.engine import EngineConfig
  cap = 24
  eng = loading.load_engine(EngineConfig(max_slots=4, max_len=64, decode_steps=4, max_queue=64),
                            hf_checkpoint=ckpt, max_seq_len=64)
  srv = testing.LiveServer(eng, max_completions_per_request=cap)
  order, real_submit = [], eng.submit_batch

  def recording_submit(prompts, *a, **kw):
    tag = "huge" if len(prompts) == cap else "small"
    handles = real_submit(prompts, *a, **kw)
    for h in handles:  # done callbacks run on the engine thread as each prompt completes
      h.future.add_done_callback(lambda _, tag=tag: order.append(tag))
    return handles

  monkeypatch.setattr(eng, "submit_batch", recording_submit)
  entered, gate = threading.Event(), threading.Event()
  real_decode = device_programs.decode_chunk

  def held(*a, **kw):
    entered.set()
    gate.wait(120)
    return real_decode(*a, **kw)

  monkeypatch.setattr(device_programs, "decode_chunk", held)
  out = {}
  huge = threading.Thread(target=lambda: out.update(huge=_post(srv.port, "/v1/completions", {
      "prompt": [[1, 2, 3]] * cap, "max_tokens": 20, "ignore_eos": True, "temperature": 0})))
  small = threading.Thread(target=lambda: out.update(small=_post(
      srv.port, "/v1/completions", {"prompt": [[4, 5]], "max_tokens": 1})))
  try:
    status, body, _ = _post(srv.port, "/v1/completions", {"prompt": [[1]] * (cap + 1)})
    assert status == 400 and f"at most {cap} per request" in body["error"]["message"]
    requests_before = eng.stats["requests_total"]
    huge.start()
    waiting.wait_event(entered, "the huge request's first decode call")
    small.start()
    waiting.wait_until(lambda: eng.stats["requests_total"] == requests_before + cap + 1,
                       "the small request to be queued behind the huge one")
    gate.set()
    for t in (small, huge):
      t.join(300)
      assert not t.is_alive(), "a request got no answer"
  finally:
    gate.set()
    srv.close()
    eng.stop()
  assert out["small"][0] == 200 and out["huge"][0] == 200
  assert len(out["huge"][1]["choices"]) == cap
  assert sorted(order) == ["huge"] * cap + ["small"]
  # Fair: admitted with the next wave of free slots (index <= 2 waves of 4). In arrival order it
  # would wait for all of the huge request's prompts to be admitted (index >= cap - 4).
  assert order.index("small") < cap // 2, order


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
