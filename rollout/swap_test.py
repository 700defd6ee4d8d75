"""What a weight swap costs the serving loop: the pause, the deferred release of the old weights,
and the first decode call after the swap against the steady calls before it (tiny model).

The release is made slow on purpose (the old weights' dict takes RELEASE_S to be destroyed), so
the tests can tell where the engine pays for it: inside the first decode call after the swap,
counted in `free_s` and `first_call_s`, and not in the pause.
"""

import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rollout import packed_weights
from rollout import testing
from rollout.engine import Engine, EngineConfig
from rollout.engine_types import PreparedWeights
from rollout.sampling import SamplingParams

RELEASE_S = 1.0  # far above a loaded machine's pause (a few ms), far below the test timeout
TIMEOUT_S = 120.0


class _SlowToRelease(dict):
  """A weights dict whose destruction takes RELEASE_S, like freeing gigabytes of weights."""

  def __del__(self):
    time.sleep(RELEASE_S)


@pytest.fixture(scope="module")
def model():
  return testing.tiny_model(seed=3)


def _engine(model):
  # One cache-length bucket: every decode call has the same shapes.
  return Engine(model, config=EngineConfig(max_slots=2, max_len=64, decode_steps=2,
                                           length_bucket=64))


def _wait(cond, what):
  deadline = time.monotonic() + TIMEOUT_S
  while not cond():
    if time.monotonic() > deadline:
      raise TimeoutError(f"timed out waiting for {what}")
    time.sleep(0.005)


def _swap_while_held(eng, prepared, version, **kw):
  """Swaps while a request is in flight, after its third decode call.

  The request's stream callback runs on the engine thread and holds it after the third decode
  call until the swap is pending, so the swap lands before the fourth call however loaded the
  machine is. Returns (swap result, the request's completion).
  """
  held, go = threading.Event(), threading.Event()
  calls = []

  def on_tokens(h, i, toks, lps, reason):
    calls.append(len(toks))
    if len(calls) == 4:  # prefill's first token, then three decode calls
      held.set()
      if not go.wait(TIMEOUT_S):
        raise TimeoutError("the test never released the engine thread")

  h = eng.submit([5, 17, 200, 3], SamplingParams(max_tokens=30, temperature=0.0,
                                                 ignore_eos=True), on_tokens=on_tokens)
  assert held.wait(TIMEOUT_S), "the request never reached its third decode call"
  out = {}
  t = threading.Thread(target=lambda: out.update(eng.swap_weights(prepared, version, **kw)))
  t.start()
  try:
    _wait(lambda: eng._pending_swap is not None, "the swap to be pending")  # pylint: disable=protected-access
  finally:
    go.set()
  t.join(TIMEOUT_S)
  assert not t.is_alive(), "swap_weights did not return"
  return out, h.result(timeout=TIMEOUT_S)[0]


def test_release_of_old_weights_is_in_the_first_call_not_in_the_pause(model):
  eng = _engine(model)
  try:
    base = eng.current_flat()
    slow = eng.prepare_weights(base)
    # Served as version 1, these weights are released after the next swap.
    eng.swap_weights(PreparedWeights(slow.params, _SlowToRelease(slow.flat), slow.prepare_s), 1)
    del slow
    new = {k: (v * np.float32(1.01)).astype(v.dtype) for k, v in base.items()}
    out, comp = _swap_while_held(eng, eng.prepare_weights(new), 2, wait_first_call=True)
    assert out["version"] == 2 and out["in_flight"] == 1
    assert 1 in comp.policy_versions and 2 in comp.policy_versions
    assert out["free_s"] >= RELEASE_S
    assert out["pause_s"] < RELEASE_S  # the release was kept out of the pause ...
    assert out["first_call_s"] >= out["free_s"]  # ... and paid inside the first call
    assert out["decode_steps"] == 2
    # Three same-shape calls ran before the swap: the steady reference is one of them, and it
    # did not pay the release.
    assert 0 < out["steady_call_s"] < RELEASE_S
    assert eng.last_swap["free_s"] == out["free_s"]
  finally:
    eng.stop()


def test_last_swap_gets_the_first_call_without_waiting(model):
  eng = _engine(model)
  try:
    out, comp = _swap_while_held(eng, eng.prepare_weights(eng.current_flat()), 1)
    assert "first_call_s" not in out or out["first_call_s"] > 0
    # The request completed with tokens of version 1, so the first call after the swap ran and
    # its figures were recorded before the completion was handed back.
    assert comp.policy_versions[-1] == 1
    last = eng.last_swap
    assert last["version"] == 1 and last["first_call_s"] > 0 and last["free_s"] >= 0
    assert last["steady_call_s"] is not None
  finally:
    eng.stop()


def test_swap_with_nothing_in_flight_returns_without_a_first_call(model):
  eng = _engine(model)
  try:
    out = eng.swap_weights(eng.prepare_weights(eng.current_flat()), 1, wait_first_call=True,
                           timeout=TIMEOUT_S)
    assert out["pause_s"] == 0.0 and out["in_flight"] == 0
    assert "first_call_s" not in out
    # The next request is served by the new version, and a later swap's figures are its own.
    c = eng.generate([1, 2, 3], max_tokens=3, temperature=0.0)[0]
    assert c.policy_versions == [1, 1, 1]
  finally:
    eng.stop()



def test_each_version_is_measured_once_for_the_weight_checks(model, monkeypatch):
  """The scale reference of a swap's checks is the served weights' RMS; the previous swap's
  check already computed it for them, so consecutive swaps (full or delta) never measure the
  served weights again."""
  from rollout import weight_checks
  from sync import delta
  calls = []
  real = weight_checks.rms
  monkeypatch.setattr(weight_checks, "rms", lambda flat: calls.append(1) or real(flat))
  eng = _engine(model)
  try:
    base = {k: np.array(v) for k, v in eng.current_flat().items()}
    eng.swap_weights({k: (v * 1.01).astype(v.dtype) for k, v in base.items()}, 1)
    assert len(calls) == 1  # the initial weights, once
    eng.swap_weights({k: (v * 1.02).astype(v.dtype) for k, v in base.items()}, 2)
    served = eng.current_flat()
    eng.swap_delta(delta.encode(served, {k: (v * 1.01).astype(v.dtype)
                                         for k, v in served.items()}), 3)
    assert len(calls) == 1 and eng.version == 3
    ref = real(eng.current_flat())
    assert eng.served_rms() == pytest.approx(ref, rel=1e-6)
  finally:
    eng.stop()


def _greedy(eng, prompt=(5, 17, 200, 3)):
  return eng.generate(list(prompt), max_tokens=20, temperature=0.0, ignore_eos=True,
                      timeout=TIMEOUT_S)[0]


def test_a_refused_swap_keeps_the_old_weights_serving_exactly(model):
  from sync import delta  # pylint: disable=import-outside-toplevel
  eng = _engine(model)
  try:
    before = _greedy(eng)
    base = eng.current_flat()
    rng = np.random.default_rng(0)
    nan = {k: np.full_like(v, np.nan) for k, v in base.items()}
    scaled = {k: rng.standard_normal(v.shape).astype(np.float32) * 1e3 for k, v in base.items()}
    one_inf = dict(base)
    one_inf["layers/0/ffn/experts/up"] = base["layers/0/ffn/experts/up"].copy()
    one_inf["layers/0/ffn/experts/up"][1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
      eng.swap_weights(nan, 1)
    with pytest.raises(ValueError, match="x the served"):
      eng.swap_weights(scaled, 1)
    with pytest.raises(ValueError, match="layers/0/ffn/experts/up holds 1 non-finite"):
      eng.swap_delta(delta.encode(base, one_inf), 1)
    with pytest.raises(ValueError, match="x the served"):
      eng.swap_delta(delta.encode(base, scaled), 1)
    assert eng.version == 0 and eng.current_flat() is base
    after = _greedy(eng)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert after.policy_versions == [0] * 20
    # The refused delta was reversed: the next delta for the served version applies.
    ok = {k: (v * np.float32(1.01)).astype(v.dtype) for k, v in base.items()}
    assert eng.swap_delta(delta.encode(base, ok), 1)["version"] == 1
  finally:
    eng.stop()


def test_after_nan_weights_and_a_nan_cache_good_weights_decode_like_a_clean_engine(model):
  """What NaN weights (swapped in past the checks) leave in the KV cache cannot reach later
  requests: decode selects entries past a sequence's position out, so 0 x NaN never happens."""
  clean = _engine(model)
  try:
    want = [_greedy(clean, p) for p in ((5, 17, 200, 3), (9,) * 11, (1, 2))]
  finally:
    clean.stop()
  eng = _engine(model)
  try:
    good = eng.current_flat()
    nan = {k: np.full_like(v, np.nan) for k, v in good.items()}
    bad = PreparedWeights(packed_weights.pack(nan, model.config, eng.config.dtype), nan, 0.0)
    eng.swap_weights(bad, 1)  # past the checks, as an engine without them would have taken it
    poisoned = eng.generate([3] * 40, max_tokens=20, temperature=0.0, ignore_eos=True,
                            timeout=TIMEOUT_S)[0]
    assert np.isnan(poisoned.logprobs).all()
    eng.swap_weights(good, 2)  # bad served weights do not block the swap that replaces them
    # And every entry of the cache NaN too (the engine thread is idle between requests).
    runner = eng._runner  # pylint: disable=protected-access
    runner.ck = tuple(jnp.full_like(c, jnp.nan) for c in runner.ck)
    runner.cv = tuple(jnp.full_like(c, jnp.nan) for c in runner.cv)
    got = [_greedy(eng, p) for p in ((5, 17, 200, 3), (9,) * 11, (1, 2))]
  finally:
    eng.stop()
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=testing.ATOL)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
