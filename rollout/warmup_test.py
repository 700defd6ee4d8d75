"""Warm-up (rollout.warmup, Engine.warm_up, the server's start-up): the programs it lists are
the shapes the scheduler picks; after it, varied traffic compiles nothing, and gives what a cold
engine gives; it changes nothing a request sees; a server is not ready until it is done.

Compilations are counted with `warmup.CompileCounter` (jax.monitoring), after
`jax.clear_caches()`: the jitted programs are module functions, so without it an earlier test's
engine of the same model would have compiled them already. Each cold test compiles 4 to 17
small programs: seconds each on a loaded 2-core machine.
"""

import dataclasses
import json
import logging
import sys
import threading
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from rollout import device_programs
from rollout import prefix_programs
from rollout import scheduler
from rollout import testing
from rollout import warmup
from rollout.engine import Engine, EngineConfig
from rollout.prefix_reuse import PrefixReuse
from rollout.sampling import MAX_TOP_LOGPROBS, SamplingParams
from testlib import waiting

WAIT_S = 600  # compiling every program of an engine, on a loaded machine

# Small engines with every kind of program: prompt buckets 8 and 16, prefix blocks of 4
# positions (up to 3 cached), decode batches of 1 and 2 slots.
SMALL = dict(max_slots=2, max_len=16, min_prefill_len=8, length_bucket=16, prefill_rows=1,
             prefix_block_size=4, decode_steps=2)
BASE = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 1, 2, 200, 31, 77]  # prompts are prefixes of it


@pytest.fixture(scope="module")
def model():
  return testing.tiny_model(seed=2)


def _programs(ec: EngineConfig, max_len: int, blocks=None) -> list:
  sched = scheduler.Scheduler(ec, max_len, threading.Condition())
  if blocks is None:
    blocks = ec.max_slots * max_len // ec.prefix_block_size
  prefix = PrefixReuse(testing.tiny_config(), ec, max_len, np.float32, blocks) if blocks else None
  return warmup.programs(ec, max_len, sched, prefix)


def _shapes(progs, kind) -> set:
  return {(p.rows, p.length, p.blocks) for p in progs if p.kind == kind}


def test_programs_are_the_shapes_the_scheduler_can_pick():
  """Hand-derived for a context of 32: prompt buckets 8, 16, 32; up to 3 cached blocks of 8;
  decode batches 1, 2; a decode call needs its furthest position (1..31) + 4 steps."""
  ec = EngineConfig(max_slots=2, max_len=32, min_prefill_len=8, length_bucket=8,
                    prefill_rows=2, prefix_block_size=8, decode_steps=4, prefill_tokens=32)
  # "coarse" (the default): rows fixed per bucket, min(2, 32 // bucket): 2, 2, 1. Every prefill
  # extends; tables 1 wide (nothing or 1 block cached) or 3 (2 or 3: a power of four, capped at
  # the 3 blocks a prefix can use). A prompt of 31 tokens at most: after 2 cached blocks 15
  # tokens are left (bucket 16). Decode attends over 8 x a power of two: 8, 16, 32.
  progs = _programs(ec, 32)
  assert len(progs) == len(set(progs)) == 12
  assert not _shapes(progs, "prefill")
  assert _shapes(progs, "extend") == {(2, 8, 1), (2, 8, 3), (2, 16, 1), (2, 16, 3), (1, 32, 1)}
  assert _shapes(progs, "decode") == {(b, s, 0) for b in (1, 2) for s in (8, 16, 32)}
  assert _shapes(progs, "copy") == {(8, 0, 0)}  # at most 2 x 32 / 8 = 8 blocks pending
  assert {p.top_n for p in progs if p.kind != "copy"} == {MAX_TOP_LOGPROBS}
  assert progs[0] == warmup.Program("decode", 1, 8, 0, MAX_TOP_LOGPROBS)  # smallest first

  # "fine": rows the power of two covering the prompts; plain prefills, and extends with 1..3
  # cached blocks in tables a power of two wide (capped at 3); 1 block leaves up to 23 tokens
  # (bucket 32), 2 leave 15 (16), 3 leave 7 (8). Decode lengths step by 8. Each but the copy
  # with top logprobs off and on.
  fine = _programs(dataclasses.replace(ec, shape_buckets="fine"), 32)
  assert len(fine) == len(set(fine)) == 53
  assert _shapes(fine, "prefill") == {(r, n, 0) for r in (1, 2) for n in (8, 16, 32)}
  assert _shapes(fine, "extend") == {(r, n, w) for r in (1, 2) for w, n in
                                     ((1, 8), (1, 16), (1, 32), (2, 8), (2, 16), (3, 8))}
  assert _shapes(fine, "decode") == {(b, s, 0) for b in (1, 2) for s in (8, 16, 24, 32)}
  assert _shapes(fine, "copy") == {(8, 0, 0)}
  for kind in ("prefill", "extend", "decode"):
    tops = [p.top_n for p in fine if p.kind == kind]
    assert tops.count(0) == tops.count(MAX_TOP_LOGPROBS) == len(tops) // 2

  # Deterministic: every prefill extends over a 3-wide table with 2 rows, one decode shape.
  for buckets, per_shape in (("coarse", 1), ("fine", 2)):
    det = _programs(dataclasses.replace(ec, deterministic=True, shape_buckets=buckets), 32)
    assert _shapes(det, "extend") == {(2, n, 3) for n in (8, 16, 32)}
    assert _shapes(det, "decode") == {(2, 32, 0)} and not _shapes(det, "prefill")
    assert len(det) == 4 * per_shape + 1
  # Without a prefix cache: plain prefills of the same rows and buckets.
  off = _programs(ec, 32, blocks=0)
  assert {p.kind for p in off} == {"prefill", "decode"} and len(off) == 3 + 6
  assert _shapes(off, "prefill") == {(2, 8, 0), (2, 16, 0), (1, 32, 0)}
  assert len(_programs(dataclasses.replace(ec, shape_buckets="fine"), 32, blocks=0)) == 12 + 16


def _record_calls(monkeypatch) -> set:
  """Makes every device program call add its `warmup.Program` to the returned set."""
  used = set()

  def wrap(module, name, program):
    real = getattr(module, name)

    def call(*a, **kw):
      used.add(program(a, kw))
      return real(*a, **kw)
    monkeypatch.setattr(module, name, call)

  wrap(device_programs, "prefill_into_slots",
       lambda a, kw: warmup.Program("prefill", *a[3].shape, 0, kw["top_n"]))
  wrap(prefix_programs, "extend_into_slots",
       lambda a, kw: warmup.Program("extend", *a[7].shape, a[5].shape[1], kw["top_n"]))
  wrap(device_programs, "decode_chunk",
       lambda a, kw: warmup.Program("decode", kw["nb"], kw["sv"], 0, kw["top_n"]))
  wrap(prefix_programs, "save_blocks", lambda a, kw: warmup.Program("copy", a[4].shape[0]))
  return used


def _traffic(seed: int) -> list:
  """Waves of requests (prompt, SamplingParams): first prefixes of BASE that find 0, 1, 2 and
  3 blocks cached and two completions at once, then random ones: prefixes of BASE of every
  length, n of 1 and 2, with and without top logprobs, greedy and sampled."""
  rng = np.random.default_rng(seed)
  greedy = SamplingParams(max_tokens=3, temperature=0.0)
  waves = [[(BASE[:k], greedy)] for k in (5, 9, 12, 13)]
  waves.append([(BASE[:3], SamplingParams(n=2, max_tokens=3, temperature=1.0, logprobs=1,
                                          seed=seed))])
  for _ in range(6):
    wave = []
    for _ in range(int(rng.integers(1, 3))):
      max_tokens = int(rng.integers(1, 4))
      prompt = BASE[:int(rng.integers(1, 16 - max_tokens))]
      wave.append((prompt, SamplingParams(n=int(rng.integers(1, 3)), max_tokens=max_tokens,
                                          temperature=float(rng.choice([0.0, 1.0])),
                                          logprobs=int(rng.choice([0, 2])), seed=int(seed))))
    waves.append(wave)
  return waves


def _serve(engine: Engine, waves) -> list:
  out = []
  for wave in waves:  # a wave runs together (batches of 2 slots), waves one after another
    handles = [engine.submit(p, params) for p, params in wave]
    out += [h.result(timeout=WAIT_S) for h in handles]
  return out


# Per shape_buckets: the SMALL engine's programs, the warm-up's first progress line, and what
# the traffic reaches. "coarse": rows 1; every prefill an extend over a table 1 wide (0 or 1
# cached blocks) or 3 (2 or 3; a 16-token bucket does not fit after 2 blocks); decode over
# 16 positions; top logprobs always. "fine": plain prefills too, tables 1, 2 or 3 wide, top
# logprobs off and on.
TRAFFIC = {
    "coarse": dict(count=6, line="3 extend, 2 decode, 1 copy", kinds={"extend", "decode", "copy"},
                   widths={1, 3}, tops={MAX_TOP_LOGPROBS}),
    "fine": dict(count=17, line="4 prefill, 8 extend, 4 decode, 1 copy", kinds=set(warmup.KINDS),
                 widths={1, 2, 3}, tops={0, MAX_TOP_LOGPROBS}),
}


@pytest.mark.parametrize("buckets", sorted(TRAFFIC))
def test_after_warm_up_varied_traffic_compiles_nothing(model, monkeypatch, buckets):
  want = TRAFFIC[buckets]
  jax.clear_caches()
  engine = Engine(model, config=EngineConfig(**SMALL, shape_buckets=buckets), start=False)
  calls = []
  result = engine.warm_up(lambda done, total, what: calls.append((done, total, what)),
                          threads=2)
  progs = _programs(engine.config, engine.max_len)
  n = len(progs)
  assert result["programs"] == result["done"] == n == want["count"]
  assert result["compiled"] + result["cache_hits"] == n  # each compiled once, nothing else
  assert [c[:2] for c in calls] == [(i, n) for i in range(n + 1)]
  assert calls[0][2] == want["line"]
  assert sorted(c[2].rsplit(" (", 1)[0] for c in calls[1:]) == sorted(p.describe() for p in progs)

  used = _record_calls(monkeypatch)
  engine.start()
  try:
    with warmup.CompileCounter() as counter:
      results = _serve(engine, _traffic(seed=0) + _traffic(seed=1))
  finally:
    engine.stop()
  assert counter.executables == 0
  assert used <= set(progs)
  # The traffic reached every kind, every top-logprob variant, batches of 1 and 2 slots and
  # every table width (cached prefixes of 0 to 3 blocks).
  assert {p.kind for p in used} == want["kinds"]
  assert {p.top_n for p in used if p.kind != "copy"} == want["tops"]
  assert {p.rows for p in used if p.kind == "decode"} == {1, 2}
  assert {p.blocks for p in used if p.kind == "extend"} == want["widths"]
  assert all(c.finish_reason in ("stop", "length") for r in results for c in r)


def _snapshot(engine: Engine) -> dict:
  """What a request can see of an engine: caches, prefix store, counters, random stream."""
  pr = engine._prefix  # pylint: disable=protected-access
  runner = engine._runner  # pylint: disable=protected-access
  return {"cache": [np.asarray(x) for x in (*runner.ck, *runner.cv)],
          "store": [np.asarray(x) for x in (*pr.store_k, *pr.store_v)],
          "blocks": len(pr.index),
          "metrics": {k: v for k, v in engine.metrics().items() if k != "tokens_per_second"},
          "rng": engine._rng.bit_generator.state}  # pylint: disable=protected-access


def _same_state(a: dict, b: dict) -> bool:
  arrays = all(np.array_equal(x, y) for k in ("cache", "store") for x, y in zip(a[k], b[k]))
  return arrays and all(a[k] == b[k] for k in ("blocks", "metrics", "rng"))


def _flat(results) -> list:
  return [(c.token_ids, c.logprobs, None if c.routing is None else c.routing.tolist(),
           c.top_logprobs, c.cached_tokens, c.finish_reason) for r in results for c in r]


def test_warm_up_mid_service_changes_nothing_and_outputs_match_a_cold_engine(model):
  """Deterministic mode: one request, then warm-up (caches, prefix store, counters and random
  stream as they were), then the rest without a compilation; a cold engine (cleared jit
  caches) compiles as it goes and gives bit-identical results."""
  ec = EngineConfig(**SMALL, deterministic=True)
  first = [[(BASE[:9], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))]]
  rest = [[w] for wave in _traffic(seed=2) for w in wave]  # one at a time: same cache hits

  jax.clear_caches()
  warm = Engine(model, config=ec)
  try:
    got = _serve(warm, first)
    before = _snapshot(warm)
    result = warm.warm_up()
    assert result["done"] == result["programs"] == len(_programs(ec, warm.max_len)) == 4
    assert _same_state(before, _snapshot(warm))
    with warmup.CompileCounter() as counter:
      got += _serve(warm, rest)
    assert counter.executables == 0
  finally:
    warm.stop()

  jax.clear_caches()
  cold = Engine(model, config=ec)
  try:
    with warmup.CompileCounter() as counter:
      want = _serve(cold, first + rest)
    assert counter.compiled > 0  # the cold engine did compile: the zero above means something
  finally:
    cold.stop()
  assert any(c.cached_tokens for r in want for c in r)
  assert _flat(got) == _flat(want)


def _health(live) -> tuple:
  try:
    with urllib.request.urlopen(live.url + "/health", timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_the_server_is_not_ready_until_its_warm_up_is_done(model, monkeypatch, caplog):
  """/health is 503 "warming_up" with the count while programs compile (held after the first),
  the log has a line per program, and /health turns 200 once the last is compiled."""
  caplog.set_level(logging.INFO, logger="rollout.server")
  engine = Engine(model, config=EngineConfig(**SMALL, deterministic=True))
  entered, gate = threading.Event(), threading.Event()
  real = engine.warm_up

  def held(progress, **kw):
    def hold(done, total, what):
      progress(done, total, what)
      if done == 1:
        entered.set()
        gate.wait(WAIT_S)
    return real(hold, **kw)

  monkeypatch.setattr(engine, "warm_up", held)
  live = testing.LiveServer(engine, warmup=True, admin=True)
  try:
    waiting.wait_event(entered, "the first program of the warm-up", timeout_s=WAIT_S)
    status, body = _health(live)
    assert status == 503 and body["status"] == "warming_up"
    assert body["warmup"] == {"done": 1, "total": 4}
    assert body["problems"] == ["warming up: compiled 1 of 4 programs"]
    gate.set()
    waiting.wait_until(lambda: _health(live)[0] == 200, "the warm-up to finish",
                       timeout_s=WAIT_S)
    assert _health(live)[1]["status"] == "ok"
  finally:
    gate.set()
    live.close()
    engine.stop()
  lines = [r.getMessage() for r in caplog.records if r.name == "rollout.server"]
  assert any(x.startswith("warm-up: compiling 4 device programs (2 extend, 1 decode, 1 copy)")
             for x in lines)
  assert [x.split(":")[1] for x in lines if x.startswith("warm-up: compiled ")] == \
      [f" compiled {i}/4" for i in range(1, 5)]
  assert any(x.startswith("warm-up done: 4 programs") for x in lines)
  # The admin app listens, so the delta kernels /admin/swap_delta uses were readied too.
  assert any(x.startswith("warm-up: delta kernels ready in ") for x in lines)
  assert live.server.warmup_result.result()["delta_kernels_s"] >= 0


def test_a_failed_warm_up_keeps_the_server_unhealthy(model, monkeypatch):
  engine = Engine(model, config=EngineConfig(**SMALL))

  def fail(progress, **kw):
    raise RuntimeError("out of memory compiling")

  monkeypatch.setattr(engine, "warm_up", fail)
  live = testing.LiveServer(engine, warmup=True)
  try:
    def failed():
      status, body = _health(live)
      return status == 503 and "warm-up failed" in " ".join(body.get("problems", []))
    waiting.wait_until(failed, "/health to report the failed warm-up")
    status, body = _health(live)
    assert body["status"] == "unhealthy"
    assert body["problems"] == ["warm-up failed: RuntimeError: out of memory compiling"]
  finally:
    live.close()
    engine.stop()


def test_a_server_without_warm_up_is_ready_at_once(model):
  engine = Engine(model, config=EngineConfig(**SMALL))
  live = testing.LiveServer(engine)
  try:
    assert _health(live) == (200, {"status": "ok", "policy_version": 0})
  finally:
    live.close()
    engine.stop()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
