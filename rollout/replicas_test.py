"""Data-parallel replicas (rollout.replicas) on 8 CPU devices: requests spread over both
replicas and give exactly the single engine's results; a swap reaches every replica at the same
version, mid-request, with every token's version recorded; bad weights change no replica; a
delta swap reaches all; metrics per replica.

Engines run in deterministic mode: a request's arithmetic does not depend on the batch, and the
replicas run the same programs on the same kind of device as the single engine, so results are
compared exactly (tokens, routing, logprobs, versions).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import urllib.request  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from moe import build  # noqa: E402
from moe import params as moe_params  # noqa: E402
from rollout import metrics as metrics_lib  # noqa: E402
from rollout import replicas  # noqa: E402
from rollout import testing  # noqa: E402
from rollout.engine import Engine, EngineConfig  # noqa: E402
from rollout.sampling import SamplingParams  # noqa: E402
from testlib import waiting  # noqa: E402

CFG = testing.tiny_config()
FLAT = moe_params.flatten(build.create(CFG, seed=3))
EC = EngineConfig(max_slots=4, max_len=64, decode_steps=4, deterministic=True, prefill_rows=2)
PROMPTS = [[5, 17, 200, 3, 9, 44, 12], [100, 101, 102], [7] * 11, [250, 1, 2, 3, 4]]
TIMEOUT_S = 300


def _perturbed(flat, seed):
  rng = np.random.default_rng(seed)
  return {k: (np.asarray(v) * (1 + 0.05 * rng.standard_normal(np.shape(v)))).astype(np.float32)
          for k, v in flat.items()}


def _requests() -> list:
  """Greedy and seeded requests, n = 1 and 2: eight submissions."""
  out = []
  for i, p in enumerate(PROMPTS):
    out.append((p, SamplingParams(max_tokens=10, temperature=0.0)))
    out.append((p, SamplingParams(n=1 + i % 2, max_tokens=8, temperature=1.0, seed=100 + i)))
  return out


def _assert_same(got, want) -> None:
  assert [c.token_ids for c in got] == [c.token_ids for c in want]
  assert [c.policy_versions for c in got] == [c.policy_versions for c in want]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.logprobs, w.logprobs)
    np.testing.assert_array_equal(g.routing, w.routing)
    np.testing.assert_array_equal(g.prompt_routing, w.prompt_routing)


@pytest.fixture(scope="module")
def single():
  eng = Engine.from_flat(FLAT, CFG, config=EC)
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def rset():
  # Devices 4 and 5: neither is the default device the single engine runs on.
  rs = replicas.build(FLAT, CFG, replicas=2, config=EC, devices=jax.devices()[4:6])
  yield rs
  rs.stop()


def test_each_replica_lives_on_its_own_device(rset):
  devs = jax.devices()
  for eng, dev in zip(rset.engines, devs[4:6]):
    runner = eng._runner  # pylint: disable=protected-access
    assert eng.placement.devices == [dev]
    assert all(x.devices() == {dev} for x in (*jax.tree.leaves(runner.params), *runner.ck,
                                               *runner.cv, *runner.prefix.store_k))


def test_requests_spread_over_replicas_and_equal_one_engine(single, rset):
  reqs = _requests()
  want = [c for h in [single.submit(p, s) for p, s in reqs] for c in h.result(TIMEOUT_S)]
  before = [e.stats["requests_total"] for e in rset.engines]
  handles = [rset.submit(p, s) for p, s in reqs]
  got = [c for h in handles for c in h.result(TIMEOUT_S)]
  _assert_same(got, want)
  served = [e.stats["requests_total"] - b for e, b in zip(rset.engines, before)]
  assert sum(served) == len(reqs) and min(served) >= 1, served
  # A batch is one submission, to the least-loaded replica: with replica 0 held inside a
  # request, a batch completes meanwhile, so replica 1 served all of it.
  go, held = threading.Event(), threading.Event()

  def hold(*_):
    held.set()
    go.wait(120)
  busy = rset.engines[0].submit(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0),
                                on_tokens=hold)
  try:
    waiting.wait_event(held, "replica 0 to be inside its request", timeout_s=120)
    before = [e.stats["requests_total"] for e in rset.engines]
    batch = rset.submit_batch(PROMPTS[:3], SamplingParams(max_tokens=3, temperature=0.0))
    for h in batch:
      h.result(TIMEOUT_S)
    assert [e.stats["requests_total"] - b for e, b in zip(rset.engines, before)] == [0, 3]
    assert not busy.done()
  finally:
    go.set()
  busy.result(TIMEOUT_S)
  # Metrics: the set's counters are the replicas' sums, and each replica has its own series.
  m = rset.metrics()
  assert len(m["replicas"]) == 2
  assert m["requests_total"] == sum(r["requests_total"] for r in m["replicas"])
  assert m["max_slots"] == 2 * EC.max_slots and m["policy_version"] == 0
  text = metrics_lib.render(m)
  for i, r in enumerate(m["replicas"]):
    assert f'rollout_replica_requests_total{{replica="{i}"}} {r["requests_total"]:g}' in text
  assert f"\nrollout_requests_total {m['requests_total']:g}\n" in text


def _swap_mid_request(engine, engines, prompts, new_flat, version) -> tuple:
  """Submits one long greedy request per prompt, holds each engine thread once its request has
  5 tokens (the prefill's and one decode chunk's), swaps `engine` to `new_flat` as `version`
  from another thread, and lets the engines go once every one of `engines` has the swap
  pending. Returns (completions, the swap's result)."""
  go = threading.Event()
  held = [threading.Event() for _ in prompts]

  def hold(i):
    def on_tokens(h, _i, *_):
      if len(h.samples[0].tokens) >= 5 and not held[i].is_set():
        held[i].set()
        go.wait(120)
    return on_tokens

  params = SamplingParams(max_tokens=20, temperature=0.0)
  handles = [engine.submit(p, params, on_tokens=hold(i)) for i, p in enumerate(prompts)]
  for i, e in enumerate(held):
    waiting.wait_event(e, f"request {i} to have 5 tokens", timeout_s=120)
  out = {}
  t = threading.Thread(target=lambda: out.update(engine.swap_weights(new_flat, version)))
  t.start()
  waiting.wait_until(lambda: all(e.metrics()["swap_pending"] for e in engines),
                     "the swap to be pending on every engine", timeout_s=120)
  go.set()
  t.join(120)
  assert not t.is_alive(), "swap_weights did not return"
  return [h.result(TIMEOUT_S)[0] for h in handles], out


def test_a_conversations_next_turn_goes_to_the_replica_that_cached_its_prefix(rset,
                                                                           monkeypatch):
  """Turn 2 extends turn 1's prompt and completion; it goes to the replica holding that prefix
  (round-robin alone would send it to the other) and takes it from the cache; a replica busier
  than the least loaded by more than a batch is passed over, cache or not."""
  turn1 = list(range(3, 43))  # two full 16-token blocks and more
  greedy = SamplingParams(max_tokens=4, temperature=0.0)
  before = [e.stats["requests_total"] for e in rset.engines]
  first = rset.submit(turn1, greedy).result(TIMEOUT_S)[0]
  r = [e.stats["requests_total"] - b for e, b in zip(rset.engines, before)].index(1)
  turn2 = turn1 + first.token_ids + [60, 61, 62]
  assert rset.engines[r].cached_prefix_tokens(turn2) >= 32
  assert rset.engines[1 - r].cached_prefix_tokens(turn2) == 0
  assert rset.pick(list(range(100, 140))) == 1 - r  # nothing cached: round-robin moves on
  before = [e.stats["requests_total"] for e in rset.engines]
  second = rset.submit(turn2, greedy).result(TIMEOUT_S)[0]
  assert [e.stats["requests_total"] - b for e, b in zip(rset.engines, before)][r] == 1
  assert second.cached_tokens >= 32
  monkeypatch.setattr(rset.engines[r], "load", lambda: EC.max_slots + 1)
  assert rset.pick(turn2) == 1 - r


def test_a_swap_reaches_every_replica_mid_request_and_versions_are_recorded(single, rset):
  v0 = rset.version
  new = _perturbed(FLAT, 1)
  # One request per replica (the second goes to the replica the first left idle).
  got, out = _swap_mid_request(rset, rset.engines, PROMPTS[:2], new, v0 + 1)
  assert [e.version for e in rset.engines] == [v0 + 1] * 2 and rset.version == v0 + 1
  assert out["version"] == v0 + 1 and len(out["replicas"]) == 2
  assert [r["in_flight"] for r in out["replicas"]] == [1, 1]
  for c in got:  # each request straddles the swap, and its record says which token is whose
    assert c.policy_versions == [v0] * 5 + [v0 + 1] * 15
  # The single engine, swapped at the same token of each request, gives the same tokens.
  base = single.version
  for i, p in enumerate(PROMPTS[:2]):
    single.swap_weights(FLAT, base + 2 * i)
    (want,), _ = _swap_mid_request(single, [single], [p], new, base + 2 * i + 1)
    assert got[i].token_ids == want.token_ids
    np.testing.assert_array_equal(got[i].logprobs, want.logprobs)
  for e in (single, rset):
    e.swap_weights(FLAT, e.version + 1)


def test_bad_weights_change_no_replica_and_a_delta_reaches_every_replica(single, rset):
  from sync import delta  # pylint: disable=g-import-not-at-top
  v0 = rset.version
  base = rset.current_flat()
  bad = dict(base)
  bad["layers/0/attn/q"] = np.full(np.shape(base["layers/0/attn/q"]), np.nan, np.float32)
  with pytest.raises(ValueError, match="layers/0/attn/q"):
    rset.swap_weights(bad, v0 + 1)
  assert [e.version for e in rset.engines] == [v0, v0]
  new = _perturbed(base, 2)
  out = rset.swap_delta(delta.encode(base, new), v0 + 1)
  assert [e.version for e in rset.engines] == [v0 + 1] * 2 and "decode_s" in out
  for k, v in new.items():
    np.testing.assert_array_equal(rset.current_flat()[k], v)
  single.swap_weights(new, single.version + 1)
  params = SamplingParams(max_tokens=6, temperature=0.0)
  want = single.submit(PROMPTS[2], params).result(TIMEOUT_S)[0]
  for e in rset.engines:  # each replica serves the delta's weights
    c = e.submit(PROMPTS[2], params).result(TIMEOUT_S)[0]
    assert c.token_ids == want.token_ids and c.policy_versions == [v0 + 1] * 6
  # A second delta applies to the set's host weights in place.
  newer = _perturbed(new, 3)
  rset.swap_delta(delta.encode(new, newer), v0 + 2)
  assert [e.version for e in rset.engines] == [v0 + 2] * 2
  for k, v in newer.items():
    np.testing.assert_array_equal(rset.current_flat()[k], v)
  for e in (single, rset):  # the next tests start from FLAT again
    e.swap_weights(FLAT, e.version + 1)


def test_the_server_serves_a_replica_set(single, rset):
  """rollout.server takes a ReplicaSet as its engine: completions over HTTP spread over the
  replicas and match the single engine; /metrics has each replica's series; the admin app's
  swap reaches every replica."""
  live = testing.LiveServer(rset, admin=True)
  try:
    before = [e.stats["requests_total"] for e in rset.engines]
    want = [single.generate(p, max_tokens=5, temperature=0.0)[0].token_ids for p in PROMPTS]
    got = [_post(live.url + "/v1/completions",
                 {"prompt": p, "max_tokens": 5, "temperature": 0})["choices"][0]["token_ids"]
           for p in PROMPTS]
    assert got == want
    assert all(e.stats["requests_total"] > b for e, b in zip(rset.engines, before))
    with urllib.request.urlopen(live.url + "/metrics", timeout=60) as r:
      text = r.read().decode()
    assert 'rollout_replica_requests_total{replica="1"}' in text
    v = rset.version + 1
    with urllib.request.urlopen(urllib.request.Request(
        f"{live.admin_url}/admin/swap_delta?version={v}", data=_delta_to_self(rset),
        method="POST", headers=live.admin_auth(**{"Content-Type": "application/octet-stream"})),
        timeout=120) as r:
      assert r.status == 200
    assert [e.version for e in rset.engines] == [v, v]
  finally:
    live.close()


def _post(url: str, body: dict) -> dict:
  req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=120) as r:
    return json.loads(r.read())


def _delta_to_self(rs) -> bytes:
  """A delta from the served weights to themselves (a swap that changes no value)."""
  from sync import delta  # pylint: disable=g-import-not-at-top
  return delta.encode(rs.current_flat(), rs.current_flat())


def test_too_few_devices_is_a_clear_error():
  with pytest.raises(ValueError, match="3 replicas of 4 devices need 12 devices, have 8"):
    replicas.build(FLAT, CFG, replicas=3, tensor=2, expert=2, config=EC, start=False)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
