"""Engine correctness: agreement with the full forward, sampling controls, determinism, load
handling and weight swaps (tiny model, few tokens). Tolerances: see rollout/testing.py."""

import sys
import threading
import time

import numpy as np
import pytest

from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from rollout import agreement
from rollout import testing
from rollout.engine import Engine, EngineConfig, QueueFull
from rollout.sampling import SamplingParams
from testlib import waiting

PROMPTS = [[5, 17, 200, 3, 9, 44, 12], [100, 101, 102], [7] * 11, [250, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def model():
  return testing.tiny_model(seed=3)


@pytest.fixture(scope="module")
def engine(model):
  eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64, decode_steps=4, max_queue=4),
               tokenizer=tokenizer_lib.for_model(None, model.config.vocab_size))
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def det_engine(model):
  eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64, decode_steps=4,
                                          deterministic=True, prefill_rows=2))
  yield eng
  eng.stop()


def test_greedy_equals_argmax_of_full_forward_and_routing_replays(engine, model):
  for prompt in PROMPTS[:2]:
    c = engine.generate(prompt, max_tokens=12, temperature=0.0)[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    seq = np.asarray([prompt + c.token_ids[:-1]])
    out = model(seq)
    p = len(prompt)
    np.testing.assert_array_equal(np.argmax(out.logits[0, p - 1:], -1), c.token_ids)
    stats = agreement.measure(model, [prompt], [c], temperature=0.0)
    assert stats["max_abs_dlogprob"] < testing.ATOL
    assert stats["routing_agreement"] == 1.0
    assert c.routing.shape == (model.config.num_moe_layers, 12, 2)
    assert c.prompt_routing.shape == (model.config.num_moe_layers, p - 1, 2)
    assert c.policy_versions == [0] * 12


def test_sampled_logprobs_equal_full_forward(engine, model):
  for temp, k, p in [(1.0, 0, 1.0), (0.8, 20, 0.9)]:
    cs = engine.generate(PROMPTS[0], n=3, max_tokens=10, temperature=temp, top_k=k, top_p=p,
                         seed=1)
    stats = agreement.measure(model, [PROMPTS[0]] * 3, cs, temperature=temp, top_k=k, top_p=p)
    assert stats["tokens"] == 30
    assert stats["max_abs_dlogprob"] < testing.ATOL, stats
    assert stats["routing_agreement"] == 1.0


def test_n_samples_share_one_prefill_and_seeds_reproduce(engine):
  before = engine.stats["prefill_calls_total"]
  a = engine.generate(PROMPTS[1], n=4, max_tokens=8, temperature=1.0, seed=42)
  assert engine.stats["prefill_calls_total"] == before + 1
  assert len({tuple(c.token_ids) for c in a}) > 1  # the samples differ
  b = engine.generate(PROMPTS[1], n=4, max_tokens=8, temperature=1.0, seed=42)
  assert [c.token_ids for c in a] == [c.token_ids for c in b]
  c = engine.generate(PROMPTS[1], n=4, max_tokens=8, temperature=1.0, seed=43)
  assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_deterministic_mode_is_batch_invariant(det_engine):
  alone = det_engine.generate(PROMPTS[0], max_tokens=10, temperature=1.0, seed=5)[0]
  # Now with other traffic: it lands in another slot, beside other rows, in another prefill.
  others = det_engine.submit_batch(PROMPTS[1:3], SamplingParams(max_tokens=14, seed=9))
  mixed = det_engine.submit(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=5))
  more = det_engine.submit(PROMPTS[3], SamplingParams(max_tokens=6, seed=2))
  got = mixed.result()[0]
  for h in others + [more]:
    h.result()
  assert got.token_ids == alone.token_ids
  assert got.logprobs == alone.logprobs  # bit-identical
  np.testing.assert_array_equal(got.routing, alone.routing)


def test_deterministic_outputs_do_not_depend_on_shape_buckets(model):
  """Deterministic shapes are fixed either way; "coarse" only has every call return top
  logprobs (one program where "fine" has two). Tokens, logprobs, routing and alternatives are
  bit-identical, for requests with and without alternatives, alone and side by side."""
  out = {}
  for buckets in ("coarse", "fine"):
    eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64, decode_steps=4,
                                            deterministic=True, prefill_rows=2,
                                            shape_buckets=buckets))
    try:
      plain = SamplingParams(max_tokens=9, temperature=1.0, seed=4)
      alts = SamplingParams(max_tokens=7, temperature=0.0, logprobs=3)
      alone = [eng.submit(PROMPTS[0], plain).result(120), eng.submit(PROMPTS[1], alts).result(120)]
      hs = [eng.submit(p, sp) for p, sp in ((PROMPTS[2], plain), (PROMPTS[3], alts))]
      out[buckets] = [(c.token_ids, c.logprobs, c.routing.tolist(), c.top_logprobs)
                      for r in alone + [h.result(120) for h in hs] for c in r]
    finally:
      eng.stop()
  assert out["coarse"] == out["fine"]
  assert out["fine"][1][3] and out["fine"][0][3] is None  # alternatives only where asked


def test_stop_token_and_stop_string(engine):
  ref = engine.generate(PROMPTS[0], max_tokens=12, temperature=0.0)[0]
  stop_tok = ref.token_ids[4]
  first = ref.token_ids.index(stop_tok)
  c = engine.generate(PROMPTS[0], max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok])[0]
  assert c.finish_reason == "stop"
  assert c.token_ids == ref.token_ids[:first + 1]  # the stop token is returned
  text = engine.tokenizer.decode(ref.token_ids)
  cut = next(i for i in range(1, len(text)) if text[i] != "\ufffd")
  stop = text[cut]
  c = engine.generate(PROMPTS[0], max_tokens=12, temperature=0.0, stop=[stop])[0]
  assert c.finish_reason == "stop"
  assert c.text == text[:text.find(stop)]
  assert c.token_ids == ref.token_ids[:len(c.token_ids)]
  assert stop in engine.tokenizer.decode(c.token_ids)
  assert stop not in engine.tokenizer.decode(c.token_ids[:-1])


def _multi_token_stop(tok, toks, k):
  """A stop string written by tokens toks[i:i + k] (k ASCII bytes, one character each) whose
  first occurrence in the text starts there; (i, stop), or None."""
  text = tok.decode(toks)
  for i in range(1, len(toks) - k):
    if all(t < 128 for t in toks[i:i + k]):
      stop = tok.decode(toks[i:i + k])
      if text.find(stop) == len(tok.decode(toks[:i])):
        return i, stop
  return None


@pytest.mark.parametrize("k", [2, 3])
def test_a_multi_token_stop_string_keeps_the_tokens_that_wrote_it(engine, k):
  """Token-in/token-out: a completion ended by a stop string the model wrote over k tokens keeps
  all k of them (with their logprobs, routing and versions), not just the one where it begins;
  its text stops before it. Sampled with seeds, so the stop lands in decode chunks anywhere."""
  tok = engine.tokenizer
  found = 0
  for seed in range(12):
    free, = engine.generate(PROMPTS[0], max_tokens=40, temperature=1.0, seed=seed)
    hit = _multi_token_stop(tok, free.token_ids, k)
    if hit is None:
      continue
    found += 1
    i, stop = hit
    c, = engine.generate(PROMPTS[0], max_tokens=40, temperature=1.0, seed=seed, stop=[stop])
    assert c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[:i + k], (seed, stop)
    assert c.text == tok.decode(free.token_ids[:i])
    assert tok.decode(c.token_ids) == c.text + stop
    assert c.logprobs == free.logprobs[:i + k]
    assert c.policy_versions == free.policy_versions[:i + k]
    np.testing.assert_array_equal(c.routing, free.routing[:, :i + k])
  assert found >= 3, "too few seeds wrote a usable stop string (the model and seeds are fixed)"


def test_the_first_stop_string_completed_ends_it():
  """A stop string that starts later but is completed earlier (in one chunk) wins, and a stop
  string that starts and ends inside tokens keeps the token that completes it."""
  from rollout import outputs

  pieces = ["ab", "c\n", "\nd", "ef"]

  def decode(ids):
    return "".join(pieces[i] for i in ids)

  assert outputs.find_stop([0, 1, 2, 3], decode, ["\n\n"]) == (3, "abc")
  assert outputs.find_stop([0, 1, 2, 3], decode, ["bc\n\nde", "d"]) == (3, "abc\n\n")
  assert outputs.find_stop([0, 1, 2, 3], decode, ["x"]) is None
  chars = list(b"abcd")
  tok = tokenizer_lib.ByteTokenizer()
  assert outputs.find_stop(chars, tok.decode, ["abcd", "c"]) == (3, "ab")
  assert outputs.find_stop(chars, tok.decode, ["a"]) == (1, "")


def test_cancel_and_timeout_free_their_slots(engine):
  h = engine.submit(PROMPTS[0], SamplingParams(max_tokens=50, temperature=1.0))
  h.cancel()
  assert all(c.finish_reason == "cancelled" for c in h.result(timeout=60))
  h = engine.submit(PROMPTS[1], SamplingParams(max_tokens=50), timeout=1e-4)
  assert all(c.finish_reason == "timeout" for c in h.result(timeout=60))
  # The slots are free again: a full-width request runs.
  assert len(engine.generate(PROMPTS[1], n=4, max_tokens=3)) == 4


def test_bounded_queue_rejects_then_recovers(engine):
  # The busy request's stream callback runs on the engine thread and waits on `gate`, so the
  # engine holds all 4 slots, and admits nothing from the queue, until the test lets it go:
  # the queue cannot drain however fast or slow this machine is.
  entered, gate = threading.Event(), threading.Event()

  def hold(*_):
    entered.set()
    gate.wait(60)

  busy = engine.submit(PROMPTS[0], SamplingParams(n=4, max_tokens=50, ignore_eos=True),
                       on_tokens=hold)
  try:
    waiting.wait_event(entered, "the busy request's first tokens")
    assert engine.metrics()["active_slots"] == 4
    queued = [engine.submit(PROMPTS[1], SamplingParams(n=2, max_tokens=2)) for _ in range(2)]
    assert engine.metrics()["queued_completions"] == 4
    with pytest.raises(QueueFull):
      engine.submit(PROMPTS[1], SamplingParams(max_tokens=2))
  finally:
    busy.cancel()
    gate.set()
  assert all(c.finish_reason == "cancelled" for c in busy.result(timeout=60))
  for h in queued:  # nothing is dropped: the queued requests complete
    assert [c.finish_reason for c in h.result(timeout=60)] == ["length", "length"]


def test_a_burst_is_prefilled_before_decoding_and_submit_batch_is_all_or_nothing(model):
  """Prefill first: 8 queued requests fill all 8 slots (4 prefill calls of 2 rows) before the
  first decode call, so the batch decodes together: 8 more tokens in 4-step calls = 2 calls.
  (Interleaving one prefill per decode call would need 5+ decode calls.)"""
  eng = Engine(model, config=EngineConfig(max_slots=8, max_len=64, decode_steps=4,
                                          prefill_rows=2, max_queue=8))
  try:
    eng.generate(PROMPTS[0], max_tokens=5)  # compile outside the counted run
    before = dict(eng.stats)
    prompts = [[11 + i, 3, 4, 5, 6] for i in range(8)]
    hs = eng.submit_batch(prompts, SamplingParams(max_tokens=9, temperature=0.0))
    assert all(len(h.result(timeout=120)[0].token_ids) == 9 for h in hs)
    assert eng.stats["prefill_calls_total"] - before["prefill_calls_total"] == 4
    assert eng.stats["decode_calls_total"] - before["decode_calls_total"] == 2
    # A batch that does not fit the queue, or holds one bad prompt, queues nothing.
    with pytest.raises(QueueFull):
      eng.submit_batch(prompts + [prompts[0]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
      eng.submit_batch([prompts[0], []], SamplingParams(max_tokens=2))
    assert eng.metrics()["queue_depth"] == 0
  finally:
    eng.stop()


def test_bad_requests_raise_clear_errors(engine):
  with pytest.raises(ValueError, match="empty"):
    engine.generate([], max_tokens=2)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    engine.generate([1, 999], max_tokens=2)
  with pytest.raises(ValueError, match="context length"):
    engine.generate([1] * 60, max_tokens=10)
  with pytest.raises(ValueError, match="slots"):
    engine.generate([1], n=5, max_tokens=2)
  with pytest.raises(ValueError, match="stop token"):
    engine.generate([1], max_tokens=2, stop_token_ids=[10**6])


def _perturbed(flat, seed):
  rng = np.random.default_rng(seed)
  return {k: (v + rng.normal(scale=0.05, size=v.shape)).astype(v.dtype) for k, v in flat.items()}


def test_bad_shape_settings_are_refused(model):
  with pytest.raises(ValueError, match="shape_buckets must be one of"):
    Engine(model, config=EngineConfig(shape_buckets="pow2"), start=False)
  with pytest.raises(ValueError, match="prefill_tokens must be >= 1"):
    Engine(model, config=EngineConfig(prefill_tokens=0), start=False)


def test_swap_mid_request_records_versions_and_keeps_kv(model):
  eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64, decode_steps=2,
                                          deterministic=True, prefill_rows=2))
  try:
    base = eng.current_flat()
    ref = eng.generate(PROMPTS[0], max_tokens=30, temperature=0.0)[0]
    for new_flat, same in ((base, True), (_perturbed(base, 1), False)):
      seen, go = threading.Event(), threading.Event()

      def hold(h, i, t, l, r):
        # The engine thread stops here (>= 6 tokens in) until the swap is pending, so the
        # request is still in flight when the swap lands however loaded the machine is.
        if len(h.samples[0].tokens) >= 6 and not seen.is_set():
          seen.set()
          go.wait(120)

      h = eng.submit(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0), on_tokens=hold)
      waiting.wait_event(seen, "the request's sixth token", timeout_s=120)
      v = eng.version + 1
      swapped = {}
      weights = eng.prepare_weights(new_flat) if same else new_flat
      t = threading.Thread(target=lambda: swapped.update(eng.swap_weights(weights, v)))
      t.start()
      waiting.wait_until(lambda: eng.metrics()["swap_pending"], "the swap to be pending",
                         timeout_s=120)
      go.set()
      t.join(120)
      assert not t.is_alive(), "swap_weights did not return"
      out = swapped
      # A request was in flight, so the loop did stand still (pause > 0), for about one loop
      # iteration (ms here; 5 s leaves room for a loaded machine's scheduling delays). That
      # the swap did not wait for the request to end is shown by the versions below.
      assert out["version"] == v and out["in_flight"] == 1 and 0 < out["pause_s"] < 5
      c = h.result(timeout=60)[0]
      vs = c.policy_versions
      assert vs[0] == v - 1 and vs[-1] == v and vs == sorted(vs)
      switch = vs.index(v)
      assert switch >= 6
      # Tokens before the swap are the old policy's; after it, the same weights continue
      # bit-identically from the kept KV cache, different weights diverge.
      assert c.token_ids[:switch] == ref.token_ids[:switch]
      assert (c.token_ids == ref.token_ids) == same
    eng.swap_weights(base, eng.version + 1)
  finally:
    eng.stop()


def test_swap_rejects_bad_weights_and_applies_deltas(engine):
  from sync import delta
  base = engine.current_flat()
  bad = dict(base)
  bad["embed"] = np.zeros((2, 2), np.float32)
  v0 = engine.version
  with pytest.raises(ValueError, match="embed"):
    engine.swap_weights(bad, v0 + 1)
  assert engine.version == v0
  new = _perturbed(base, 2)
  blob = delta.encode(base, new)
  damaged = bytearray(blob)
  damaged[len(damaged) // 2] ^= 0xFF
  with pytest.raises(delta.DeltaError):
    engine.swap_delta(bytes(damaged), v0 + 1)
  assert engine.version == v0
  engine.swap_delta(blob, v0 + 1)
  assert engine.version == v0 + 1
  for k, v in new.items():
    np.testing.assert_array_equal(engine.current_flat()[k], v)
  assert engine.generate(PROMPTS[1], max_tokens=3)[0].policy_versions == [v0 + 1] * 3
  engine.swap_weights(base, v0 + 2)


def _ulp_steps(flat, frac, seed):
  """`flat` with ~frac of the elements moved by one ulp up or down (a sampler-sized delta)."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in flat.items():
    w = np.array(v, copy=True)
    bits = w.reshape(-1).view(f"u{w.itemsize}")
    idx = np.flatnonzero(rng.random(bits.size) < frac)
    bits[idx] += np.where(rng.random(idx.size) < 0.5, 1, -1).astype(bits.dtype)
    out[k] = w
  return out


def _same_flat(a, b):
  return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k]))
                                      for k in a)


def test_delta_swaps_write_in_place_refuse_stale_deltas_and_roll_back(engine, monkeypatch):
  from sync import delta
  base = engine.current_flat()
  before = {k: np.array(v, copy=True) for k, v in base.items()}
  v0 = engine.version
  new1 = _ulp_steps(before, 0.04, 1)
  new2 = _ulp_steps(new1, 0.04, 2)
  new3 = _ulp_steps(new2, 0.04, 3)
  assert engine.swap_delta(delta.encode(before, new1), v0 + 1)["version"] == v0 + 1
  held1 = engine.current_flat()
  assert _same_flat(held1, new1) and _same_flat(base, before)  # the caller's arrays: unwritten
  engine.swap_delta(delta.encode(new1, new2), v0 + 2)
  held2 = engine.current_flat()
  assert all(held2[k] is held1[k] for k in held1)  # the same buffers, updated in place
  assert _same_flat(held2, new2)
  # A delta for another parent (here the version before) is refused; nothing changes.
  with pytest.raises(delta.DeltaError, match="expected version"):
    engine.swap_delta(delta.encode(new1, new3), v0 + 3)
  # A delta whose result would not fit the model: refused before anything is written.
  with pytest.raises(ValueError, match="missing"):
    engine.swap_delta(delta.encode(new2, {k: v for k, v in new3.items() if k != "embed"}),
                      v0 + 3)
  assert engine.version == v0 + 2 and _same_flat(engine.current_flat(), new2)
  # A swap that fails after the apply: the delta is reversed, the held version stays usable.
  blob3 = delta.encode(new2, new3)

  def failing_swap(*a, **kw):
    raise RuntimeError("swap failed")
  monkeypatch.setattr(engine, "swap_weights", failing_swap)
  with pytest.raises(RuntimeError, match="swap failed"):
    engine.swap_delta(blob3, v0 + 3)
  monkeypatch.undo()
  assert engine.version == v0 + 2 and _same_flat(engine.current_flat(), new2)
  engine.swap_delta(blob3, v0 + 3)
  assert _same_flat(engine.current_flat(), new3)
  assert engine.generate(PROMPTS[1], max_tokens=2)[0].policy_versions == [v0 + 3] * 2
  # A full swap replaces the held arrays: the next delta starts from a copy of those.
  engine.swap_weights(before, v0 + 4)
  engine.swap_delta(delta.encode(before, new1), v0 + 5)
  assert _same_flat(engine.current_flat(), new1) and _same_flat(base, before)
  engine.swap_weights(before, v0 + 6)


def test_a_failing_device_call_fails_its_requests_and_the_engine_recovers(engine, monkeypatch):
  from rollout import device_programs
  real = device_programs.decode_chunk
  calls = []

  def broken(*a, **kw):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("injected device failure")
    return real(*a, **kw)

  monkeypatch.setattr(device_programs, "decode_chunk", broken)
  h = engine.submit(PROMPTS[1], SamplingParams(max_tokens=8))
  with pytest.raises(RuntimeError, match="injected"):
    h.result(timeout=60)
  c = engine.generate(PROMPTS[1], max_tokens=8, temperature=0.0)[0]
  assert len(c.token_ids) == 8 and c.finish_reason == "length"



def test_values_the_slot_tables_cannot_hold_are_refused_before_queueing(engine):
  """top_k of 2**31 used to pass, overflow the int32 table on the engine thread, go unanswered
  and fail every other request in flight; now it is a ValueError naming the field, at submit."""
  before = engine.metrics()
  with pytest.raises(ValueError, match="top_k"):
    engine.submit(PROMPTS[0], SamplingParams(top_k=2**31))
  with pytest.raises(ValueError, match="top_k"):
    engine.generate(PROMPTS[0], max_tokens=2, top_k=2**40)
  for bad in ({"temperature": 1e-40}, {"top_p": 1e-40}, {"seed": 2**64},
              {"stop_token_ids": (2**31,)}, {"max_tokens": 2**31}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      engine.submit(PROMPTS[0], SamplingParams(**bad))
  for timeout in (float("nan"), -1.0, 0):
    with pytest.raises(ValueError, match="timeout"):
      engine.submit(PROMPTS[0], SamplingParams(max_tokens=2), timeout=timeout)
  after = engine.metrics()
  assert after["queue_depth"] == 0
  assert after.get("requests_total", 0) == before.get("requests_total", 0)
  # top_k of the vocabulary size or more keeps every token: the same draws as top_k=0.
  off = engine.generate(PROMPTS[0], max_tokens=6, seed=4)[0]
  big = engine.generate(PROMPTS[0], max_tokens=6, seed=4, top_k=2**31 - 1)[0]
  assert big.token_ids == off.token_ids


def _batch_beside_a_running_request(engine, submit_batch):
  """Runs a greedy request R and, while R is in flight, a batch `submit_batch()` queued so that
  the engine prefills it in one call. Returns (R's completion, the batch's handles)."""
  entered, go = threading.Event(), threading.Event()

  def hold(*_):  # R's first tokens: the engine thread waits here until the batch is queued
    entered.set()
    go.wait(60)

  running = engine.submit(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0),
                          on_tokens=hold)
  try:
    waiting.wait_event(entered, "the running request's first tokens")
    handles = submit_batch()
  finally:
    go.set()
  return running.result(timeout=120)[0], handles


def test_a_request_failing_in_staging_or_prefill_fails_alone(engine, monkeypatch):
  from rollout import device_programs, prefix_programs
  ref_running = engine.generate(PROMPTS[0], max_tokens=16, temperature=0.0)[0]
  ref_good = engine.generate(PROMPTS[1], max_tokens=6, temperature=0.0)[0]
  greedy = SamplingParams(max_tokens=6, temperature=0.0)

  # 1. Staging: a request built around the checks (top_k set past int32 after construction)
  # fails alone; the one prefilled beside it and the one running are unaffected.
  unchecked = SamplingParams(max_tokens=6, temperature=0.5, top_k=5, seed=1)
  object.__setattr__(unchecked, "top_k", 2**31)
  calls_before = engine.stats["prefill_calls_total"]
  running, (bad, good) = _batch_beside_a_running_request(
      engine, lambda: [engine.submit(PROMPTS[3], unchecked), engine.submit(PROMPTS[1], greedy)])
  with pytest.raises(ValueError, match="top_k"):
    bad.result(timeout=120)
  assert good.result(timeout=120)[0].token_ids == ref_good.token_ids
  assert running.token_ids == ref_running.token_ids and running.finish_reason == "length"
  assert engine.stats["prefill_calls_total"] == calls_before + 2  # R, then good alone

  # 2. The prefill call fails for a batch of two: each is retried alone, and only the prompt
  # that makes the call fail fails. (With the prefix cache on and "coarse" shapes, prefills
  # are extend calls: both programs fail for the culprit.)
  culprit_prompt = [251, 9, 9, 9]

  def failing_for_culprit(module, name, tokens_arg):
    real = getattr(module, name)

    def call(*a, **kw):
      if (np.asarray(a[tokens_arg])[:, 0] == culprit_prompt[0]).any():
        raise RuntimeError("injected prefill failure")
      return real(*a, **kw)
    monkeypatch.setattr(module, name, call)

  failing_for_culprit(device_programs, "prefill_into_slots", 3)
  failing_for_culprit(prefix_programs, "extend_into_slots", 7)
  running, handles = _batch_beside_a_running_request(
      engine, lambda: engine.submit_batch([culprit_prompt, PROMPTS[1]], greedy))
  with pytest.raises(RuntimeError, match="injected prefill failure"):
    handles[0].result(timeout=120)
  assert handles[1].result(timeout=120)[0].token_ids == ref_good.token_ids
  assert running.token_ids == ref_running.token_ids and running.finish_reason == "length"
  monkeypatch.undo()
  assert engine.generate(PROMPTS[1], max_tokens=6, temperature=0.0)[0].token_ids == \
      ref_good.token_ids


def test_a_small_request_is_not_starved_by_a_huge_one(model):
  """40 prompts in one submit_batch hold all 4 slots with 36 more queued; a 4-token request that
  comes after them is admitted as soon as slots free (round-robin across submissions) and
  finishes while most of the huge batch still waits. In arrival order it finished after 36."""
  eng = Engine(model, config=EngineConfig(max_slots=4, max_len=64, decode_steps=4,
                                          max_queue=64))
  try:
    entered, go = threading.Event(), threading.Event()

    def hold(*_):
      entered.set()
      go.wait(60)

    huge = eng.submit_batch([[20 + i, 3, 4, 5, 6] for i in range(40)],
                            SamplingParams(max_tokens=8, temperature=0.0), on_tokens=hold)
    try:
      waiting.wait_event(entered, "the huge batch's first tokens")
      assert eng.metrics()["queue_depth"] == 36  # 4 taken for the first prefill
      small = eng.submit(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0))
      huge_done_then = []
      small.future.add_done_callback(
          lambda _: huge_done_then.append(sum(h.done() for h in huge)))
    finally:
      go.set()
    c = small.result(timeout=120)[0]
    assert len(c.token_ids) == 4 and c.finish_reason == "length"
    assert huge_done_then[0] <= 8, huge_done_then  # the first wave of 4, at most one more
    for h in huge:
      assert len(h.result(timeout=300)[0].token_ids) == 8
  finally:
    eng.stop()


def test_a_queued_request_times_out_while_long_work_runs(engine):
  """A request queued behind one that holds every slot is answered "timeout" at its deadline,
  long before that work ends (the engine thread is held until the deadline has passed)."""
  entered, go = threading.Event(), threading.Event()

  def hold(*_):
    entered.set()
    go.wait(60)

  busy = engine.submit(PROMPTS[0], SamplingParams(n=4, max_tokens=40, ignore_eos=True),
                       on_tokens=hold)
  try:
    waiting.wait_event(entered, "the busy request's first tokens")
    queued = engine.submit(PROMPTS[1], SamplingParams(max_tokens=4), timeout=0.05)
    busy_tokens_then = []
    queued.future.add_done_callback(
        lambda _: busy_tokens_then.append(len(busy.samples[0].tokens)))
    waiting.wait_until(lambda: time.monotonic() > queued.deadline, "the queued deadline")
  finally:
    go.set()
  assert [c.finish_reason for c in queued.result(timeout=60)] == ["timeout"]
  assert busy_tokens_then[0] < 40  # answered while the long request still ran
  assert all(len(c.token_ids) == 40 for c in busy.result(timeout=120))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
