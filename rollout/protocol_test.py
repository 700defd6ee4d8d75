"""Request validation and response shaping of the OpenAI completions protocol (no model)."""

import sys

import numpy as np
import pytest

from rollout import protocol
from rollout.engine import Completion
from moe.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def parse(body):
  return protocol.parse_completion_request(body, TOK, 300, max_tokens_limit=100)


def test_prompt_forms():
  assert parse({"prompt": "ab"})["prompts"] == [[97, 98]]
  assert parse({"prompt": [1, 2]})["prompts"] == [[1, 2]]
  assert parse({"prompt": ["a", [3]]})["prompts"] == [[97], [3]]
  assert parse({"prompt": [[1], [2, 3]]})["prompts"] == [[1], [2, 3]]
  with pytest.raises(protocol.BadRequest, match="no tokenizer"):
    protocol.parse_completion_request({"prompt": "a"}, None, 300, max_tokens_limit=10)


def test_fields_map_to_sampling_params():
  r = parse({"prompt": [1], "n": 3, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
             "top_k": 4, "seed": 11, "stop": "x", "stop_token_ids": [5], "logprobs": 2,
             "ignore_eos": True, "stream": True, "timeout": 3, "model": "m", "user": "u"})
  p = r["params"]
  assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 7, 0.5, 0.9, 4, 11)
  assert p.stop == ("x",) and p.stop_token_ids == (5,) and p.logprobs == 2 and p.ignore_eos
  assert r["stream"] and r["timeout"] == 3.0 and r["model"] == "m"


@pytest.mark.parametrize("body,fragment", [
    ({"prompt": [1], "echo": True}, "echo"),
    ({"prompt": [1], "best_of": 3}, "best_of"),
    ({"prompt": [1], "logit_bias": {"1": 2}}, "logit_bias"),
    ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [1], "seed": "1"}, "seed"),
    ({"prompt": [1], "stop": ["a"] * (protocol.MAX_STOP_STRINGS + 1)}, "stop strings"),
    ({"prompt": [1], "stop_token_ids": [400]}, "outside the vocabulary"),
    ({"prompt": [1], "timeout": -1}, "timeout"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
])
def test_rejections_name_the_field(body, fragment):
  with pytest.raises(protocol.BadRequest, match=fragment):
    parse(body)


@pytest.mark.parametrize("value", [0, {}, False, "1", 5])
def test_stop_token_ids_must_be_a_list(value):
  with pytest.raises(protocol.BadRequest, match="'stop_token_ids' must be a list"):
    parse({"prompt": [1], "stop_token_ids": value})
  assert parse({"prompt": [1], "stop_token_ids": []})["params"].stop_token_ids == ()


def test_a_lone_surrogate_in_a_text_prompt_is_a_bad_request():
  with pytest.raises(protocol.BadRequest, match=r"'prompt'\[1\] is not valid Unicode.*character 1"):
    parse({"prompt": ["ok", "a\ud800b"]})


def test_prompts_times_n_is_capped_before_tokenizing():
  class Counting(ByteTokenizer):
    calls = 0

    def encode(self, text):
      Counting.calls += 1
      return super().encode(text)

  tok = Counting()
  body = {"prompt": ["x"] * 9, "n": 3}
  with pytest.raises(protocol.BadRequest, match="27 completions; at most 26 per request"):
    protocol.parse_completion_request(body, tok, 300, max_tokens_limit=100, max_completions=26)
  assert Counting.calls == 0
  assert len(protocol.parse_completion_request(body, tok, 300, max_tokens_limit=100,
                                               max_completions=27)["prompts"]) == 9
  # A flat token-id list is one prompt, however long.
  assert len(parse({"prompt": [1] * 50, "n": 2})["prompts"]) == 1
  with pytest.raises(protocol.BadRequest, match="at most 256"):
    parse({"prompt": [[1]] * 129, "n": 2})


@pytest.mark.parametrize("body", [
    {"prompt": [1], "temperature": "x" * 1_000_000},
    {"prompt": [1], "max_tokens": 10**4000},
    {"prompt": ["a", {"k": "v" * 1_000_000}]},
    {"prompt": [1, "y" * 1_000_000]},
    {"prompt": [1], "stream": ["z" * 1_000_000]},
    {"prompt": [1], "stop_token_ids": "s" * 1_000_000},
    {"prompt": [1], **{"f" * 100_000 + str(i): 1 for i in range(1000)}},
])
def test_messages_that_quote_a_client_value_stay_short(body):
  with pytest.raises(protocol.BadRequest) as e:
    parse(body)
  assert len(str(e.value)) < 600, str(e.value)[:1000]


def test_choice_json_carries_sampler_fields():
  c = Completion(token_ids=[104, 105], logprobs=[-0.5, -1.0],
                 routing=np.array([[[0, 1], [2, 3]]], np.uint8), policy_versions=[3, 4],
                 finish_reason="length", text="hi", prompt_routing=np.zeros((1, 2, 2), np.uint8),
                 top_logprobs=[{104: -0.5, 7: -2.0}, {105: -1.0, 8: -1.5}])
  j = protocol.choice_json(2, c, TOK, return_routing=True, return_prompt_routing=True,
                          prompt_token_ids=[72, 105])
  assert j["index"] == 2 and j["text"] == "hi" and j["token_ids"] == [104, 105]
  assert j["prompt_token_ids"] == [72, 105]
  assert "prompt_token_ids" not in protocol.choice_json(0, c, TOK, return_routing=False,
                                                        return_prompt_routing=False)
  assert j["routing"] == [[[0, 1], [2, 3]]] and j["prompt_routing"] == [[[0, 0], [0, 0]]]
  assert j["policy_version"] == 4 and j["policy_versions"] == [3, 4]
  lp = j["logprobs"]
  assert lp["tokens"] == ["h", "i"] and lp["token_logprobs"] == [-0.5, -1.0]
  assert lp["text_offset"] == [0, 1]
  assert lp["top_logprobs"][0] == {"h": -0.5, "\x07": -2.0}
  assert lp["top_logprob_ids"][1] == [[105, -1.0], [8, -1.5]]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
