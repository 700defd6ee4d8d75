"""Tests of evaluation.sources with a real tiny engine: the engine evaluation builds gets the
evaluation's tokenizer, and a request through InProcessPolicy (wired as evaluation.evaluate
wires it) ends at its stop string inside the engine instead of being decoded to max_tokens and
cut afterwards -- with the same tokens, logprobs and routing the cut after the fact kept."""

import sys

import numpy as np
import pytest

from envs.harness import inprocess_policy
from envs.harness import policy as policy_lib
from envs.harness import scripted_sampler
from evaluation import sources
from moe import checkpoint
from moe import tokenizer as tokenizer_lib
from rollout import testing as rollout_testing
from rollout.engine import Engine, EngineConfig

TOK = tokenizer_lib.ByteTokenizer()
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model():
  return rollout_testing.tiny_model(seed=0, max_seq_len=128)


@pytest.fixture(scope="module")
def sampler(model):
  with sources.open_sampler(model, context=128, tokenizer=TOK) as s:  # evaluate's default config
    yield s


def test_sources_say_which_take_stop_strings(model, sampler):
  assert sampler.engine.tokenizer is TOK and sampler.stop_strings
  assert sampler.engine.config.deterministic
  # A caller's engine keeps its own tokenizer, here none: it cannot match stop strings.
  bare = Engine(model, config=EngineConfig(max_slots=2, max_len=128), start=False)
  with sources.open_sampler(bare, context=128, tokenizer=TOK) as s:
    assert s.engine is bare and bare.tokenizer is None and not s.stop_strings
  gen = scripted_sampler.scripted_generate(["x"])
  with sources.open_sampler(gen, context=128, tokenizer=TOK) as s:
    assert s.generate is gen and not s.stop_strings


def test_policy_request_ends_at_its_stop_string_in_the_engine(sampler):
  prompt = [TOK.bos_id] + TOK.encode("def f():\n")
  full = sampler.generate(prompt, n=1, max_tokens=MAX_TOKENS, temperature=0.0,
                          stop_token_ids=[TOK.eos_id])[0]
  assert len(full.token_ids) == MAX_TOKENS  # greedy runs to max_tokens: no EOS on the way
  # A stop string the greedy completion contains: its first printable ASCII byte past the 8th.
  stop = next(TOK.decode([t]) for t in full.token_ids[8:] if 32 <= t < 127)
  cut, hit = policy_lib.truncate_at_stop(full.token_ids, TOK.decode, [stop])
  assert hit == stop and cut <= MAX_TOKENS // 2
  expected = inprocess_policy.convert(full, TOK, MAX_TOKENS, [stop])  # the cut after the fact

  calls = []

  def recording(prompt_token_ids, **kw):  # the engine's own completions, before convert
    out = sampler.generate(prompt_token_ids, **kw)
    calls.append((kw, out))
    return out

  policy = inprocess_policy.InProcessPolicy(recording, TOK, stop_strings=sampler.stop_strings)
  decoded_before = sampler.engine.stats["generated_tokens_total"]
  got = policy.complete(prompt, max_tokens=MAX_TOKENS, stop=[stop], temperature=0.0)[0]
  decoded = sampler.engine.stats["generated_tokens_total"] - decoded_before

  (kw, (raw,)), = calls
  assert kw["stop"] == [stop]
  assert raw.finish_reason == "stop" and len(raw.token_ids) == cut  # the engine stopped there
  # The first token comes from the prefill; the engine decodes at most one chunk past the stop,
  # where running to max_tokens decodes MAX_TOKENS - 1.
  assert decoded <= cut - 1 + sampler.engine.config.decode_steps < MAX_TOKENS - 1
  # The harness records exactly what it recorded before: the engine's tokens up to and
  # including the one that completes the stop string, with their logprobs, routing, versions.
  assert got.token_ids == expected.token_ids == full.token_ids[:cut]
  assert got.text == expected.text and got.text.endswith(stop)
  assert got.finish_reason == expected.finish_reason == "stop"
  # The second request's prompt comes from the prefix cache: float32 rounding apart.
  np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=rollout_testing.ATOL)
  np.testing.assert_array_equal(got.routing, expected.routing)
  assert got.policy_versions == expected.policy_versions


def test_an_evaluation_uses_the_sources_own_tokenizer(model, tmp_path):
  """A checkpoint's tokenizer.json, an engine's tokenizer, bytes for a byte vocabulary; a model
  whose vocabulary is not bytes and that brings no tokenizer is an error, never bytes."""
  bpe = tokenizer_lib.BPETokenizer.train(["def f():\n    return 1\n"] * 20, 300)
  big = rollout_testing.tiny_model(seed=1, vocab_size=300)
  ckpt = str(tmp_path / "ckpt")
  checkpoint.save_params(big, ckpt)
  with pytest.raises(tokenizer_lib.TokenizerError, match="300 ids is not the byte tokenizer's"):
    sources.with_tokenizer(ckpt)
  bpe.save(ckpt)
  loaded, tok = sources.with_tokenizer(ckpt)
  assert loaded.config == big.config and isinstance(tok, tokenizer_lib.BPETokenizer)
  assert tok.encode("def f():") == bpe.encode("def f():")
  with pytest.raises(tokenizer_lib.TokenizerError, match="the model has no directory"):
    sources.with_tokenizer(big)
  assert sources.with_tokenizer(big, TOK) == (big, TOK)  # the caller's tokenizer wins
  assert sources.with_tokenizer(model) == (model, tokenizer_lib.ByteTokenizer())
  engine = Engine(model, config=EngineConfig(max_slots=2, max_len=128), tokenizer=bpe,
                  start=False)
  assert sources.with_tokenizer(engine) == (engine, bpe)
  gen = scripted_sampler.scripted_generate(["x"])
  assert sources.with_tokenizer(gen) == (gen, tokenizer_lib.ByteTokenizer())


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
