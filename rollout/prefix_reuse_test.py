"""Automatic prefix caching in the engine (rollout.prefix_reuse): hits for repeated prompts, n
attempts, multi-turn continuations and shared system prompts; the prefill work it saves (the
engine's own count of prefilled tokens); bounded memory with LRU eviction; invalidation by
weight swaps; and replay exactness: with the cache, tokens, routing and prompt routing are
those of the engine without it.

Tolerance (rollout/testing.py): logprobs within ATOL = 1e-5. A cached prefix's KV was computed
by another program (a prefill of other shape, or the decode steps that fed a completion) than a
full prefill of the whole prompt would use, so the same formulas are summed in another order:
float32 rounding, observed <= 1e-6 here. Tokens and routing are compared exactly.
"""

import sys
import threading

import numpy as np
import pytest

from rollout import agreement
from rollout import testing
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from testlib import waiting

B = 4
BASE = dict(max_slots=4, max_len=64, decode_steps=4, deterministic=True, prefill_rows=2,
            prefix_block_size=B)
OFF = dict(BASE, prefix_cache_blocks=0)


@pytest.fixture(scope="module")
def model():
  return testing.tiny_model(seed=3)


@pytest.fixture(scope="module")
def cached(model):
  eng = Engine(model, config=EngineConfig(**BASE, prefix_cache_blocks=64))
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def plain(model):
  eng = Engine(model, config=EngineConfig(**OFF))
  yield eng
  eng.stop()


def _tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 259, n)]


def _prefilled(eng, fn):
  """fn()'s result and the prompt tokens the engine prefilled (computed, not cached) for it."""
  before = eng.metrics().get("prompt_tokens_total", 0)
  out = fn()
  return out, eng.metrics().get("prompt_tokens_total", 0) - before


def _same(a, b):
  """Completions a (with the cache) and b (without) agree: tokens and routing exactly."""
  assert a.token_ids == b.token_ids
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=testing.ATOL)
  np.testing.assert_array_equal(a.prompt_routing, b.prompt_routing)
  np.testing.assert_array_equal(a.routing, b.routing)


def test_a_repeated_prompt_prefills_only_its_last_token(cached, plain):
  p = _tokens(1, 21)
  first, n1 = _prefilled(cached, lambda: cached.generate(p, max_tokens=3, temperature=0.0)[0])
  m = cached.metrics()
  again, n2 = _prefilled(cached, lambda: cached.generate(p, max_tokens=3, temperature=0.0)[0])
  assert (first.cached_tokens, n1) == (0, 21)
  # 20 = five whole blocks; the last token is always computed (its logits sample token 0).
  assert (again.cached_tokens, n2) == (20, 1)
  after = cached.metrics()
  assert after["prefix_cache_hits_total"] == m["prefix_cache_hits_total"] + 1
  assert after["prefix_cache_hit_tokens_total"] == m["prefix_cache_hit_tokens_total"] + 20
  assert 0 < after["prefix_cache_hit_rate"] <= 1
  _same(again, first)
  _same(again, plain.generate(p, max_tokens=3, temperature=0.0)[0])


def test_n_attempts_share_the_prompt_as_n_requests_or_one(cached):
  p = _tokens(2, 21)
  # n attempts sent as n requests at once: the first computes the prompt, the others wait one
  # prefill call (the scheduler defers them) and find it cached.
  hs, n = _prefilled(cached, lambda: [h.result(120) for h in cached.submit_batch(
      [p] * 4, SamplingParams(max_tokens=3, temperature=1.0, seed=7))])
  assert sorted(h[0].cached_tokens for h in hs) == [0, 20, 20, 20]
  assert n == 21 + 3 * 1
  # One request of n = 4: one prefill for its four completions (here all cached but the last
  # token), and each completion reports its request's cached tokens.
  cs, n = _prefilled(cached, lambda: cached.generate(p, n=4, max_tokens=3, temperature=1.0,
                                                     seed=7))
  assert [c.cached_tokens for c in cs] == [20] * 4 and n == 1
  assert [c.token_ids for c in cs][0] == hs[0][0].token_ids  # same seed, same sample 0


def test_a_multi_turn_continuation_prefills_only_the_new_tokens(cached, plain, model):
  prompt = _tokens(3, 9)
  for turn in range(3):
    c, n = _prefilled(cached, lambda: cached.generate(prompt, max_tokens=8, temperature=0.0)[0])
    ref = plain.generate(prompt, max_tokens=8, temperature=0.0)[0]
    _same(c, ref)
    if turn:
      # The previous turn's prompt + completion had KV for all but its last token: 9 + 7 = 16
      # tokens in turn 0, and 4 + 7 more each turn after it (whole blocks). The last completion
      # token was never fed, so it is prefilled with the observation.
      assert c.cached_tokens == len(prompt) - 5 and n == 5, (turn, c.cached_tokens, n)
    # Replay over the whole sequence agrees with the model (prompt routing included).
    stats = agreement.measure(model, [prompt], [c], temperature=0.0)
    assert stats["max_abs_dlogprob"] < testing.ATOL and stats["routing_agreement"] == 1.0
    prompt = prompt + c.token_ids + _tokens(30 + turn, 4)


def test_sampled_turns_agree_with_and_without_the_cache(cached, plain):
  prompt = _tokens(4, 13)
  for turn in range(2):
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=11 + turn)
    a = cached.submit(prompt, params).result(120)
    b = plain.submit(prompt, params).result(120)
    for x, y in zip(a, b):
      _same(x, y)
    assert turn == 0 or a[0].cached_tokens > 0
    prompt = prompt + a[1].token_ids + _tokens(40 + turn, 3)  # continue the second attempt


def test_concurrent_requests_share_a_cached_system_prompt(cached, plain):
  system = _tokens(5, 16)
  cached.generate(system + [7], max_tokens=1, temperature=0.0)  # caches the 4 system blocks
  prompts = [system + _tokens(50 + i, 3 + i) for i in range(4)]
  params = SamplingParams(max_tokens=5, temperature=0.0)
  got, n = _prefilled(cached, lambda: [h.result(120)[0]
                                       for h in cached.submit_batch(prompts, params)])
  assert [c.cached_tokens for c in got] == [16] * 4
  assert n == sum(len(p) - 16 for p in prompts)
  for c, p in zip(got, prompts):
    _same(c, plain.generate(p, max_tokens=5, temperature=0.0)[0])


def test_eviction_keeps_memory_bounded_in_lru_order(model):
  eng = Engine(model, config=EngineConfig(**BASE, prefix_cache_blocks=4))
  try:
    a, b, c = (_tokens(60 + i, 9) for i in range(3))  # two blocks each
    gen = lambda p: eng.generate(p, max_tokens=1, temperature=0.0)[0].cached_tokens
    assert (gen(a), gen(b)) == (0, 0)
    assert eng.metrics()["prefix_cache_blocks"] == 4
    assert gen(a) == 8  # a is now more recent than b
    assert gen(c) == 0  # full: b, the least recently used, makes room
    m = eng.metrics()
    assert m["prefix_cache_evictions_total"] == 2 and m["prefix_cache_blocks"] == 4
    assert m["prefix_cache_capacity_blocks"] == 4
    assert (gen(a), gen(c), gen(b)) == (8, 8, 0)
    assert eng.metrics()["prefix_cache_blocks"] == 4
    assert all(x.shape[0] == 4 for x in (*eng._prefix.store_k, *eng._prefix.store_v))
  finally:
    eng.stop()


def _perturbed(flat, seed):
  rng = np.random.default_rng(seed)
  return {k: (v + rng.normal(scale=0.05, size=v.shape)).astype(v.dtype) for k, v in flat.items()}


def test_a_weight_swap_or_delta_invalidates_the_cache(model):
  from sync import delta
  eng = Engine(model, config=EngineConfig(**BASE, prefix_cache_blocks=64))
  try:
    p = _tokens(7, 21)
    gen = lambda: eng.generate(p, max_tokens=3, temperature=0.0)[0]
    gen()
    assert gen().cached_tokens == 20
    blocks = eng.metrics()["prefix_cache_blocks"]
    assert blocks == 5  # the prompt's; prompt + completion (23 tokens) adds no whole block
    new = _perturbed(eng.current_flat(), 1)
    eng.swap_weights(new, eng.version + 1)
    m = eng.metrics()
    assert m["prefix_cache_invalidations_total"] == blocks
    assert m["prefix_cache_invalidation_events_total"] == 1 and m["prefix_cache_blocks"] == 0
    after, n = _prefilled(eng, gen)
    assert (after.cached_tokens, n) == (0, 21)  # nothing computed by the old weights is reused
    fresh = Engine(model, config=EngineConfig(**OFF))
    try:
      fresh.swap_weights(new, 1)
      _same(after, fresh.generate(p, max_tokens=3, temperature=0.0)[0])
    finally:
      fresh.stop()
    assert gen().cached_tokens == 20  # cached again, under the new weights
    blob = delta.encode(eng.current_flat(), _perturbed(eng.current_flat(), 2))
    eng.swap_delta(blob, eng.version + 1)
    assert eng.metrics()["prefix_cache_invalidation_events_total"] == 2
    assert gen().cached_tokens == 0
  finally:
    eng.stop()


def test_a_request_spanning_a_swap_is_not_cached_when_it_finishes(model):
  eng = Engine(model, config=EngineConfig(**{**BASE, "decode_steps": 2}, prefix_cache_blocks=64))
  try:
    p = _tokens(8, 9)
    seen, go = threading.Event(), threading.Event()

    def hold(h, i, t, l, r):
      # The engine thread waits here (>= 4 tokens in) until the swap is pending, so the swap
      # lands while the request runs however loaded the machine is.
      if len(h.samples[0].tokens) >= 4 and not seen.is_set():
        seen.set()
        go.wait(120)

    h = eng.submit(p, SamplingParams(max_tokens=12, temperature=0.0), on_tokens=hold)
    waiting.wait_event(seen, "the request's fourth token", timeout_s=120)
    t = threading.Thread(target=lambda: eng.swap_weights(eng.current_flat(), 1))
    t.start()
    waiting.wait_until(lambda: eng.metrics()["swap_pending"], "the swap to be pending",
                       timeout_s=120)
    go.set()
    t.join(120)
    assert not t.is_alive(), "swap_weights did not return"
    c = h.result(120)[0]
    assert c.policy_versions[0] == 0 and c.policy_versions[-1] == 1
    # Its KV is partly the old weights': neither its prompt (invalidated) nor its completion
    # (never inserted) may serve the next turn.
    nxt = eng.generate(p + c.token_ids + [1, 2, 3], max_tokens=1, temperature=0.0)[0]
    assert nxt.cached_tokens == 0
    assert eng.metrics()["prefix_cache_blocks"] == (len(p) + len(c.token_ids) + 3) // B
  finally:
    eng.stop()


def test_cache_off_is_the_old_behaviour(plain):
  p = _tokens(9, 21)
  m = plain.metrics()
  assert not any(k.startswith("prefix_cache") for k in m)
  (a, b), n = _prefilled(plain, lambda: [h.result(120)[0] for h in plain.submit_batch(
      [p, p], SamplingParams(max_tokens=3, temperature=0.0))])
  assert n == 42 and a.cached_tokens == b.cached_tokens == 0
  assert plain.metrics()["prefill_calls_total"] == m.get("prefill_calls_total", 0) + 1  # one call


def test_on_by_default_sized_as_the_slot_cache(model):
  eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64), start=False)
  assert eng.metrics()["prefix_cache_capacity_blocks"] == 4 * 64 // 16


def test_bad_settings_are_refused(model):
  with pytest.raises(ValueError, match="prefix_cache_blocks"):
    Engine(model, config=EngineConfig(prefix_cache_blocks=-1), start=False)
  with pytest.raises(ValueError, match="prefix_block_size"):
    Engine(model, config=EngineConfig(prefix_cache_blocks=8, prefix_block_size=0), start=False)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
