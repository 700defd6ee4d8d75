"""Tests for the HTTP relay tree: fan-out once per cluster, Range resume, relays dying."""

import sys

import pytest

from sync import transport
from sync import manifest as manifest_lib
from sync import publisher
from sync import relay
from sync import store as store_lib
from sync import subscriber
from sync import testing


class CuttingRelay(relay.Relay):
  """Drops the connection after `cut_at` bytes of the next `cuts` large responses."""

  def __init__(self, *a, cut_at=1000, cuts=1, **kw):
    super().__init__(*a, **kw)
    self.cut_at, self.cuts = cut_at, cuts

  async def _send(self, resp, data):
    if self.cuts and len(data) > self.cut_at:
      self.cuts -= 1
      await resp.write(data[:self.cut_at])
      raise ConnectionResetError("relay died mid-transfer")
    await super()._send(resp, data)


@pytest.fixture
def servers():
  started = []

  def start(r):
    s = relay.RelayServer(r)
    s.start()
    started.append(s)
    return s
  yield start
  for s in started:
    if s._thread.is_alive():  # pylint: disable=protected-access
      s.stop()


def _publisher(tmp_path, **kw):
  st = store_lib.Store(str(tmp_path))
  kw.setdefault("snapshot_every", 100)
  return st, publisher.Publisher(st, chunk_elems=testing.CHUNK, **kw)


def test_two_clusters_fetch_each_object_once(tmp_path, servers):
  st, pub = _publisher(tmp_path)
  hist = testing.history(4)
  origin = servers(relay.Relay(st, index_ttl_s=0))
  clusters = [servers(relay.Relay([origin.url], index_ttl_s=0)) for _ in range(2)]
  subs, sources = [], []
  for c in clusters:
    for _ in range(3):
      src = transport.HttpSource([c.url])
      sources.append(src)
      subs.append((subscriber.Subscriber(src, lambda f, v: None), src))
  for v, w in enumerate(hist):
    pub.publish(w)
    assert clusters[0].call(clusters[0].relay.warm()) == v  # prefetch before samplers ask
    for sub, _ in subs:
      assert sub.poll().version == v
      assert testing.same_bits(sub.weights, w)
  for c in clusters:  # every immutable object crossed the "WAN" once per cluster
    fetched = {k: n for k, n in c.relay.upstream_fetches.items()}
    assert fetched and set(fetched.values()) == {1}
    assert manifest_lib.delta_key(3) in fetched
  origin_fetches = origin.relay.upstream_fetches[manifest_lib.delta_key(3)]
  assert origin_fetches == 1
  for s in sources:
    s.close()


def test_interrupted_transfer_resumes_with_range(tmp_path, servers):
  st, pub = _publisher(tmp_path)
  hist = testing.history(2)
  for w in hist:
    pub.publish(w)
  r = servers(CuttingRelay(st, cut_at=3000, cuts=3))
  with transport.HttpSource([r.url]) as src:
    key = manifest_lib.delta_key(1)
    assert src.get(key) == st.get(key)
    assert src.stats.resumes >= 1
    assert src.stats.bytes == len(st.get(key))  # no byte moved twice
    with pytest.raises(KeyError):
      src.get("v/missing")


def test_relay_dying_mid_update_never_mixes_weights(tmp_path, servers):
  st, pub = _publisher(tmp_path)
  hist = testing.history(3)
  pub.publish(hist[0])
  pub.publish(hist[1])
  origin = servers(relay.Relay(st, index_ttl_s=0))
  dying = servers(CuttingRelay([origin.url], cut_at=1000, cuts=100, index_ttl_s=0))
  applied = []
  with transport.HttpSource([dying.url], attempts=2) as src:
    sub = subscriber.Subscriber(src, lambda f, v: applied.append((v, f)))
    dying.relay.cuts = 0
    sub.poll()
    assert sub.version == 1
    pub.publish(hist[2])
    dying.relay.cuts = 100  # every large transfer now breaks: the relay is dying
    with pytest.raises(subscriber.SyncError):
      sub.poll()
    assert sub.version == 1 and [v for v, _ in applied] == [1]
    assert testing.same_bits(sub.weights, hist[1])
  # With a second relay to fail over to, the update completes, resuming mid-object.
  backup = servers(relay.Relay([origin.url], index_ttl_s=0))
  dying.relay.cuts = 1
  with transport.HttpSource([dying.url, backup.url]) as src:
    sub.source = src
    r = sub.poll()
    assert r.version == 2 and src.stats.resumes >= 1
  assert [v for v, _ in applied] == [1, 2]
  assert testing.same_bits(applied[-1][1], hist[2])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
