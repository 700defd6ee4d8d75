"""`POST /v1/chat/completions` against a live server on a checkpoint saved by transformers (a tiny
Qwen3-MoE with a BPE tokenizer and a Qwen3-style chat template), through the official openai
client: the prompt ids the server used are transformers' `apply_chat_template` ids, the answer's
fields (content, logprobs, usage, the sampler's extras), tools and earlier tool calls rendered
through the template, streaming (deltas and logprobs with their alternatives that add up to the
plain answer, usage, chunks sent while the request still runs) and the 400s.
"""

import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import transformers

from moe import tokenizer as tokenizer_lib
from moe.hf import testutil
from rollout import loading
from rollout import testing
from rollout.engine import EngineConfig
from testlib import waiting

# Room for a conversation with tools (this tiny tokenizer writes ~1.4 characters per token).
MAX_LEN = 512

CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "print('hello world') 🙂"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """The checkpoint's directory and transformers' tokenizer of it (the reference)."""
  d = testutil.save_with_tokenizer(tmp_path_factory.mktemp("qwen3_chat"), seed=1,
                                   max_position_embeddings=MAX_LEN)
  return d, transformers.AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def live(ckpt):
  engine = loading.load_engine(EngineConfig(max_slots=4, max_len=MAX_LEN, decode_steps=4,
                                            max_queue=8),
                               hf_checkpoint=ckpt[0], max_seq_len=MAX_LEN)
  srv = testing.LiveServer(engine, model_name="qwen3_chat", request_timeout=120.0)
  yield srv
  srv.close()
  engine.stop()


@pytest.fixture(scope="module")
def client(live):
  return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _template_ids(ref, messages) -> list:
  out = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def _post(live, body):
  req = urllib.request.Request(f"{live.url}/v1/chat/completions", data=json.dumps(body).encode(),
                               method="POST", headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_the_prompt_is_the_chat_template_encoded_and_the_answer_is_greedy(client, live, ckpt):
  _, ref = ckpt
  want = _template_ids(ref, CHAT)
  text = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  assert text.endswith("<|im_start|>assistant\n")
  r = client.chat.completions.create(model="qwen3_chat", messages=CHAT, max_tokens=8,
                                     temperature=0, logprobs=True, top_logprobs=2,
                                     extra_body={"ignore_eos": True})
  assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
  ch = r.choices[0]
  assert ch.model_extra["prompt_token_ids"] == want
  # The same prompt through the engine directly, greedy: the same tokens and logprobs.
  eng = live.engine
  direct = eng.generate(want, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
  ids = ch.model_extra["token_ids"]
  assert ids == direct.token_ids and len(ids) == 8 and ch.finish_reason == "length"
  assert ch.message.role == "assistant"
  assert ch.message.content == ref.decode(ids, skip_special_tokens=True) == direct.text
  content = ch.logprobs.content
  assert [c.model_extra["token_id"] for c in content] == ids
  assert [c.token for c in content] == [ref.decode([t]) for t in ids]
  # The prefix cache serves the second prefill: float32 rounding apart (testing.ATOL).
  np.testing.assert_allclose([c.logprob for c in content], direct.logprobs, atol=testing.ATOL)
  # Greedy: the sampled token is the most likely one, first of the two alternatives.
  assert all(len(c.top_logprobs) == 2 for c in content)
  assert [c.top_logprobs[0].model_extra["token_id"] for c in content] == ids
  assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
  assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 8
  assert r.usage.total_tokens == len(want) + 8
  routing = np.asarray(ch.model_extra["routing"])
  assert routing.shape == (eng.model_config.num_moe_layers, 8, 2)
  assert ch.model_extra["policy_version"] == eng.version
  assert ch.model_extra["policy_versions"] == [eng.version] * 8
  # Without 'logprobs' none come back (OpenAI's chat API); the extras still do.
  plain = client.chat.completions.create(model="qwen3_chat", messages=CHAT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
  assert plain.choices[0].logprobs is None
  assert plain.choices[0].model_extra["token_ids"] == ids


def test_n_seed_stop_and_max_completion_tokens(client, ckpt):
  _, ref = ckpt
  messages = [{"role": "user", "content": [{"type": "text", "text": "fix"},
                                           {"type": "text", "text": "the bug"}]}]
  # Text parts are joined with newlines before rendering.
  want = _template_ids(ref, [{"role": "user", "content": "fix\nthe bug"}])
  kw = dict(model="m", messages=messages, n=3, seed=5, temperature=1.0,
            max_completion_tokens=6, extra_body={"ignore_eos": True})
  r = client.chat.completions.create(**kw)
  assert [c.index for c in r.choices] == [0, 1, 2]
  assert all(c.model_extra["prompt_token_ids"] == want for c in r.choices)
  assert all(len(c.model_extra["token_ids"]) == 6 for c in r.choices)
  assert r.usage.prompt_tokens == 3 * len(want) and r.usage.completion_tokens == 18
  again = client.chat.completions.create(**kw)
  assert [c.model_extra["token_ids"] for c in r.choices] == \
      [c.model_extra["token_ids"] for c in again.choices]
  # A stop string cuts the content before it; the ids keep the token that completed it.
  text = r.choices[0].message.content
  # (The model and seed are fixed: the first completion has such a character.)
  stop = next(ch for ch in text[1:] if ch.strip())
  cut = client.chat.completions.create(**{**kw, "n": 1}, stop=[stop]).choices[0]
  assert cut.finish_reason == "stop" and stop not in cut.message.content
  assert text.startswith(cut.message.content)


def test_without_max_tokens_a_completion_may_fill_the_context(client, ckpt):
  _, ref = ckpt
  messages = [{"role": "user", "content": "hi"}]
  r = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                     extra_body={"ignore_eos": True})
  assert r.usage.completion_tokens == MAX_LEN - len(_template_ids(ref, messages))
  assert r.choices[0].finish_reason == "length"


def test_streaming_adds_up_to_the_plain_answer(client, ckpt):
  _, ref = ckpt
  kw = dict(model="qwen3_chat", messages=CHAT, max_tokens=24, n=2, seed=3, temperature=1.0,
            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
  plain = client.chat.completions.create(**kw)
  chunks = list(client.chat.completions.create(stream=True,
                                               stream_options={"include_usage": True}, **kw))
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
  # The last event has no choices and the usage, equal to the plain answer's.
  assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
  want = _template_ids(ref, CHAT)
  for idx, choice in enumerate(plain.choices):
    mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == idx]
    assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
    assert mine[0].model_extra["prompt_token_ids"] == want
    assert "".join(c.delta.content or "" for c in mine) == choice.message.content
    toks = [t for c in mine for t in c.model_extra["token_ids"]]
    assert toks == choice.model_extra["token_ids"]
    entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
    expected = choice.logprobs.content
    assert [e.model_extra["token_id"] for e in entries] == toks
    np.testing.assert_allclose([e.logprob for e in entries], [e.logprob for e in expected],
                               atol=testing.ATOL)
    # Each streamed token carries its three alternatives, as the plain answer's does.
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert [[a.token for a in e.top_logprobs] for e in entries] == \
        [[a.token for a in e.top_logprobs] for e in expected]
    assert [[a.model_extra["token_id"] for a in e.top_logprobs] for e in entries] == \
        [[a.model_extra["token_id"] for a in e.top_logprobs] for e in expected]
    np.testing.assert_allclose([[a.logprob for a in e.top_logprobs] for e in entries],
                               [[a.logprob for a in e.top_logprobs] for e in expected],
                               atol=testing.ATOL)
    assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert mine[-1].model_extra["policy_versions"] == choice.model_extra["policy_versions"]
    assert mine[-1].model_extra["routing"] == choice.model_extra["routing"]


TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "Runs a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
# A conversation with earlier tool use: the assistant called the tool (arguments as OpenAI sends
# them, a JSON string) and the tool answered.
TOOL_CHAT = [{"role": "system", "content": "You fix bugs."},
             {"role": "user", "content": "fix a.py"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "run", "arguments": '{"path": "a.py"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "1 failed"}]


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tools_and_tool_calls_go_through_the_template(client, ckpt, tool_choice):
  """`tools` reach the template as transformers' apply_chat_template(tools=...) passes them, and
  an earlier assistant turn's `tool_calls` and the `tool` answer render through it (arguments
  parsed into the object transformers' templates take): the prompt ids are transformers'. The
  answer is plain content (tool calls are not parsed out of it)."""
  _, ref = ckpt
  extra = {"tool_choice": tool_choice} if tool_choice else {}
  r = client.chat.completions.create(model="m", messages=TOOL_CHAT, tools=TOOLS, max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True}, **extra)
  expected = [dict(m) for m in TOOL_CHAT]
  expected[2] = {"role": "assistant", "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "run", "arguments": {"path": "a.py"}}}]}
  want = ref.apply_chat_template(expected, tools=TOOLS, tokenize=True, add_generation_prompt=True)
  want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
  ch = r.choices[0]
  assert ch.model_extra["prompt_token_ids"] == want
  text = ref.decode(want)
  assert '"description": "Runs a file."' in text and "<tool_response>\n1 failed" in text
  assert '<tool_call>\n{"name": "run", "arguments": {"path": "a.py"}}' in text
  assert ch.message.tool_calls is None and isinstance(ch.message.content, str)
  # Without the tools, the same conversation renders without their listing.
  plain = client.chat.completions.create(model="m", messages=TOOL_CHAT, max_tokens=1)
  assert plain.choices[0].model_extra["prompt_token_ids"] == _template_ids(ref, expected)
  assert plain.choices[0].model_extra["prompt_token_ids"] != want


def test_chunks_are_sent_while_the_request_runs(client, live, monkeypatch):
  """Every decode call waits on `gate` (the first token comes from the prefill): the client
  must receive that token's chunk while the engine is held inside a decode call, before the
  request can finish. A server that sent chunks only at the end would deliver it after the
  hold runs out, with the request over."""
  eng = live.engine
  entered, gate = testing.hold_decode(eng, monkeypatch)
  stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=20,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
  received = []
  try:
    for chunk in stream:
      received += chunk.choices[0].model_extra["token_ids"]
      if received:
        break
    # The first chunk may come from the prefill before the first decode call starts; once that
    # call is held, the request is still running, with most of its tokens unsent.
    waiting.wait_event(entered, "the request's first decode call")
    running = eng.metrics()["active_slots"]
    assert not gate.is_set() and running == 1, running
    assert len(received) < 20
  finally:
    gate.set()
  for chunk in stream:
    if chunk.choices:
      received += chunk.choices[0].model_extra["token_ids"]
  assert len(received) == 20


def test_a_request_the_template_refuses_is_400_with_its_reason(client, live):
  late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="m", messages=late_system, max_tokens=2)
  assert e.value.status_code == 400
  assert "the system message must come first" in e.value.body["message"]
  # The server goes on serving.
  assert _post(live, {"messages": CHAT, "max_tokens": 1})[0] == 200


@pytest.mark.parametrize("body,fragment", [
    ({"max_tokens": 2}, "'messages' is required"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, r"'messages'\[0\] must be an object"),
    ({"messages": [{"content": "hi"}]}, r"'messages'\[0\].role must be one of"),
    ({"messages": [{"role": "critic", "content": "hi"}]}, r"'messages'\[0\].role"),
    ({"messages": [{"role": "user"}]}, r"'messages'\[0\].content is required"),
    ({"messages": [{"role": "user", "content": 3}]}, r"'messages'\[0\].content must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     r"'messages'\[0\].content\[0\] must be a text part"),
    ({"messages": [{"role": "user", "content": "hi", "function_call": {}}]},
     r"'messages'\[0\] has unknown field"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     r"'messages'\[0\].tool_calls: only an assistant message"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "x"}}]},
     r"'messages'\[0\].tool_calls must be a list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"},
                                                         "index": 0}]}]},
     r"'messages'\[0\].tool_calls\[0\] has unknown field.*'index'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}]},
     r"'messages'\[0\].tool_calls\[0\].type must be 'function'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     r"'messages'\[0\].tool_calls\[0\].function.name must be a string"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{'a': 1}"}}]}]},
     r"'messages'\[0\].tool_calls\[0\].function.arguments is not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]},
     r"'messages'\[0\].tool_calls\[0\].function.arguments must be a JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 3, "function": {
        "name": "f", "arguments": {}}}]}]}, r"'messages'\[0\].tool_calls\[0\].id must be"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "not valid Unicode"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"type": "function"}},
     "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "code_interpreter"}]},
     r"'tools'\[0\].type must be 'function'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     r"'tools'\[0\].function must be an object"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"description": "no name"}}]},
     r"'tools'\[0\].function.name must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     r"'tools'\[0\].function.parameters must be an object"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     r"'tools'\[0\].function has unknown field.*'returns'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "'tool_choice' must be one of \\['auto', 'none'\\].*neither forces"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'tool_choice' must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
     "'functions' is OpenAI's deprecated form of 'tools'"),
    ({"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"},
     "'function_call' is OpenAI's deprecated form of 'tool_choice'"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "unknown field.*'prompt'"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "'logprobs' must be true"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "'top_logprobs' needs 'logprobs': true"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 9},
     "'top_logprobs' must be an integer in"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "'max_tokens' must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
     "'max_completion_tokens' must be <="),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
      "max_completion_tokens": 4}, "'max_tokens' and 'max_completion_tokens' differ"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_LEN - 5},
     "exceeds the context length"),
    ({"messages": [{"role": "user", "content": "print('hello world') " * (MAX_LEN // 3)}]},
     "'messages' fill the context"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "'n' must be >= 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"usage": True}},
     "'stream_options' takes only 'include_usage'"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "'stop' must be"),
])
def test_bad_input_is_400_naming_the_field(live, body, fragment):
  status, out = _post(live, body)
  assert status == 400, out
  assert out["error"]["type"] == "invalid_request_error"
  assert re.search(fragment, out["error"]["message"]), out["error"]["message"]


def test_a_model_without_a_chat_template_is_400_saying_so(live, ckpt, tmp_path):
  """The same checkpoint with its chat_template.jinja left out: completions work, chat is a 400
  that says why and where to go."""
  d, _ = ckpt
  bare = tmp_path / "no_template"
  bare.mkdir()
  for name in os.listdir(d):
    if name != "chat_template.jinja":
      os.symlink(os.path.join(d, name), bare / name)
  tok = tokenizer_lib.for_model(str(bare), live.engine.model_config.vocab_size)
  assert tok.chat_template is None
  other = testing.LiveServer(live.engine)
  other.server.tokenizer = tok
  try:
    status, out = _post(other, {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "this model has no chat template" in out["error"]["message"]
    assert "/v1/completions" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", other.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}),
                 {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()
  finally:
    other.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
