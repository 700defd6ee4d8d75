"""SamplerSet over real HTTP sampling servers (rollout.server on 127.0.0.1): requests complete,
a server that goes away is routed around, and a request a server refuses is neither retried nor
masked: the controller stops on it with the server's reason."""

import contextlib
import sys

import pytest

from envs.sandbox import pool as pool_lib
from moe import build
from moe import params as moe_params
from moe.tokenizer import ByteTokenizer
from pipeline import controller as controller_lib
from pipeline import samplers as samplers_lib
from pipeline import testing
from rollout import testing as rollout_testing
from rollout.engine import Engine
from rollout.sampling import SamplingParams


@pytest.fixture
def servers():
  """Makes live servers, each over a fresh tiny engine; at the end closes each server, then
  stops its engine."""
  with contextlib.ExitStack() as cleanup:

    def make(tokenizer=ByteTokenizer()):
      flat = moe_params.flatten(build.create(testing.MODEL, seed=0))
      engine = Engine.from_flat(flat, testing.MODEL, tokenizer=tokenizer, config=testing.ENGINE)
      cleanup.callback(engine.stop)
      live = rollout_testing.LiveServer(engine)
      cleanup.callback(live.close)
      return live

    yield make


def test_requests_complete_and_a_dead_server_is_routed_around(servers):
  a, b = servers(), servers()
  sset = samplers_lib.SamplerSet([samplers_lib.HttpSampler(a.url), samplers_lib.HttpSampler(b.url)])
  params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True,
                          stop=("\n\n", "\ndef ", "\nclass ", "\n#", "\nif __name__"))
  comps = sset.submit([1, 2, 3], params, timeout=60).result(120)
  assert len(comps) == 2 and all(1 <= len(c.token_ids) <= 4 for c in comps)
  a.close()
  with pytest.raises(samplers_lib.SamplerDown):
    sset.samplers[0].version()
  assert sset.min_version() == 0  # the dead server is marked down, not raised through
  assert [s.base_url for s in sset.live()] == [b.url]
  for _ in range(3):  # every request completes
    assert len(sset.submit([1, 2, 3], params, timeout=60).result(120)) == 2
  assert [s.base_url for s in sset.live()] == [b.url]


def test_a_rejected_request_is_not_retried_nor_counted_as_a_dead_sampler(servers):
  a, b = servers(tokenizer=None), servers(tokenizer=None)  # no tokenizer: stop strings are refused
  sset = samplers_lib.SamplerSet([samplers_lib.HttpSampler(a.url), samplers_lib.HttpSampler(b.url)])
  fut = sset.submit([1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)), timeout=60)
  with pytest.raises(samplers_lib.RequestRejected, match="stop"):
    fut.result(120)
  assert sset.retries == 0 and len(sset.live()) == 2
  # The in-process sampler refuses the same request the same way.
  eng = samplers_lib.SamplerSet([samplers_lib.EngineSampler(a.engine)])
  with pytest.raises(ValueError, match="tokenizer"):
    eng.submit([1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)), timeout=60).result(120)


def test_controller_stops_on_a_rejected_request_instead_of_masking_it(servers):
  srv = servers(tokenizer=None)  # the controller's stop strings will be refused
  sset = samplers_lib.SamplerSet([samplers_lib.HttpSampler(srv.url)])
  written = []
  with pool_lib.WarmPool(size=1) as pool:
    ctl = controller_lib.RolloutController(testing.tasks(2), sset, pool, written.append,
                                           config=testing.config())
    with pytest.raises(RuntimeError, match="rejected the request.*stop"):
      ctl.run(num_steps=1)
  assert not written  # nothing was written as if it were an infrastructure failure


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_a_dead_sampler_is_probed_with_back_off_and_rejoins_only_with_current_weights():
  flat = moe_params.flatten(build.create(testing.MODEL, seed=0))
  engines = [Engine.from_flat(flat, testing.MODEL, tokenizer=ByteTokenizer(),
                              config=testing.ENGINE) for _ in range(2)]
  a, b = (samplers_lib.EngineSampler(e, name) for e, name in zip(engines, "ab"))
  clock = _Clock()
  sset = samplers_lib.SamplerSet([a, b], max_lag=1, probe_backoff_s=1.0,
                                 max_probe_backoff_s=3.0, clock=clock)
  params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
  try:
    engines[0].stop()  # sampler a dies; its request is retried on b
    assert len(sset.submit([1, 2, 3], params, timeout=60).result(120)) == 2
    assert sset.live() == [b] and sset.retries == 1
    engines[1].swap_weights(flat, 3)
    assert sset.min_version() == 3
    engines[0].start()  # a is back, but still serves version 0: 3 behind, bound 1
    assert sset.min_version() == 3 and sset.live() == [b]  # not probed before its back-off
    clock.t = 1.0
    assert sset.probe_dead() == [] and sset.live() == [b]  # probed: too far behind
    clock.t = 2.9
    assert sset.probe_dead() == []  # the next probe waits twice as long (until 3.0)
    engines[0].swap_weights(flat, 2)  # within the bound of the newest (3)
    assert sset.probe_dead() == []
    clock.t = 3.0
    assert sset.probe_dead() == [a] and sset.rejoins == 1
    assert sset.min_version() == 2 and sset.live() == [a, b]
    before = engines[0].stats["requests_total"]
    assert len(sset.submit([1, 2, 3], params, timeout=60).result(120)) == 2
    assert engines[0].stats["requests_total"] == before + 1  # idle tie: the first listed, a
  finally:
    for e in engines:
      e.stop()


def test_a_sampler_found_by_name_is_followed_to_its_new_address_at_once(servers):
  """A sampler placed again elsewhere (a launcher's job on another node) comes back at another
  address: asked by name before each probe, it rejoins there without waiting its back-off."""
  a, b = servers(), servers()
  where = {"s0": a.url}
  named = samplers_lib.HttpSampler(a.url, name="@s0", resolve=lambda: where["s0"])
  sset = samplers_lib.SamplerSet([named, samplers_lib.HttpSampler(b.url)],
                                 probe_backoff_s=600.0, max_probe_backoff_s=600.0)
  a.close()
  assert sset.min_version() == 0 and sset.live() == [sset.samplers[1]]
  assert sset.probe_dead() == []  # same address, back-off not over: not probed
  c = servers()
  where["s0"] = c.url  # registered again at its new address
  assert sset.probe_dead() == [named] and named.base_url == c.url
  params = SamplingParams(n=1, max_tokens=2, temperature=1.0, seed=1, ignore_eos=True)
  assert len(named.submit([1, 2, 3], params, timeout=60).result(120)) == 1


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
