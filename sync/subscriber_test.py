"""Tests for the sampler side: catch-up, reports, and every rejected-delta fault."""

import sys
import time

import pytest

from sync import delta
from sync import manifest as manifest_lib
from sync import publisher
from sync import store as store_lib
from sync import subscriber
from sync import synthetic
from sync import testing
from sync import weights


class Sampler:
  """Stands in for the sampling server's swap: records what it was handed. With `clock`, each
  swap moves that clock on by `swap_s` seconds (a swap of known length)."""

  def __init__(self, clock=None, swap_s=0.0):
    self.applied = []
    self.clock, self.swap_s = clock, swap_s

  def __call__(self, flat, version):
    if self.clock is not None:
      self.clock.offset += self.swap_s
    # A copy: with Subscriber(inplace=True) the arrays handed over change after this call.
    self.applied.append((version, {k: v.copy() for k, v in flat.items()}))


def _setup(tmp_path, n=1, inplace=False, **kw):
  st = store_lib.Store(str(tmp_path))
  kw.setdefault("snapshot_every", 100)
  pub = publisher.Publisher(st, chunk_elems=testing.CHUNK, **kw)
  hist = testing.history(12)
  for w in hist[:n]:
    pub.publish(w)
  sampler = Sampler()
  return st, pub, hist, sampler, subscriber.Subscriber(st, sampler, inplace=inplace)


class _Clock:
  """`time` for sync.subscriber: the real perf_counter plus what the sampler's swaps added."""

  def __init__(self):
    self.offset = 0.0

  def perf_counter(self):
    return time.perf_counter() + self.offset


def test_follows_each_version_and_reports(tmp_path, monkeypatch):
  st, pub, hist, _, sub = _setup(tmp_path)
  # Each swap takes 1000 s more on the subscriber's clock: the pause must hold them, and the
  # fetch and decode times must not.
  clock = _Clock()
  monkeypatch.setattr(subscriber, "time", clock)
  sampler = sub.apply_fn = Sampler(clock, swap_s=1000.0)
  r = sub.poll()
  assert r.steps == [("snapshot", 0)] and sub.poll() is None
  for v in range(1, 4):
    rep = pub.publish(hist[v])
    r = sub.poll()
    assert r.version == v and r.from_version == v - 1 and r.steps == [("delta", v)]
    assert rep.delta_bytes < r.bytes_moved < rep.delta_bytes + 4096  # + manifest
    assert r.pause_s >= 1000.0
    assert 0 < r.decode_s < 1000.0 and 0 < r.fetch_s < 1000.0 and not r.recovered
    assert testing.same_bits(sampler.applied[-1][1], hist[v])
  assert [v for v, _ in sampler.applied] == [0, 1, 2, 3]


def test_adopted_weights_are_not_applied_again(tmp_path):
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2)
  flat, v = publisher.restore(st)
  sub.adopt(flat, v, publisher.read_manifest(st, v).digest)
  assert sub.poll() is None and sampler.applied == []
  pub.publish(hist[2])
  r = sub.poll()
  assert r.steps == [("delta", 2)] and [v for v, _ in sampler.applied] == [2]
  assert testing.same_bits(sampler.applied[-1][1], hist[2])


def test_catch_up_by_chain_or_by_snapshot_whichever_is_smaller(tmp_path):
  st, pub, hist, sampler, sub = _setup(tmp_path, snapshot_every=5, keep_snapshots=10)
  sub.poll()
  for w in hist[1:3]:
    pub.publish(w)
  assert sub.poll().steps == [("delta", 1), ("delta", 2)]
  for w in hist[3:12]:
    pub.publish(w)
  r = sub.poll()  # 9 deltas (~9 x 2.5 KB) vs snapshot 10 (~60 KB) + 1 delta
  assert r.steps[0][0] in ("snapshot", "delta") and r.version == 11
  index = publisher.read_index(st)
  chain = sum(index.versions[v][0] for v in range(3, 12))
  jump = index.versions[10][1] + index.versions[11][0]
  assert r.steps[0] == (("snapshot", 10) if jump < chain else ("delta", 3))
  assert testing.same_bits(sampler.applied[-1][1], hist[11])


def _rewrite_manifest(st, version, **changes):
  m = publisher.read_manifest(st, version)
  for k, v in changes.items():
    setattr(m, k, v)
  st.put(manifest_lib.manifest_key(version), m.to_bytes())


def _point_delta_at(st, version, blob):
  key = manifest_lib.delta_key(version)
  st.put(key, blob)
  _rewrite_manifest(st, version, delta=manifest_lib.ObjectRef(key, len(blob), weights.xxh(blob)))


def _faults(st, hist):
  """(name, corrupt(store) -> None) for the delta of version 2."""
  good = st.get(manifest_lib.delta_key(2))
  other = testing.history(3, seed=9)
  odd = {k: v for k, v in hist[1].items()}
  odd["embed"] = synthetic.cast({"e": synthetic.init_master({"e": (65, 33)})["e"]})["e"]
  return [
      ("corrupted", lambda: st.put(manifest_lib.delta_key(2),
                                   good[:100] + bytes([good[100] ^ 4]) + good[101:])),
      ("truncated", lambda: st.put(manifest_lib.delta_key(2), good[:len(good) // 2])),
      # Damaged in a way the manifest's hash does not catch (hash rewritten): the blob's own
      # checks must.
      ("corrupted_rehashed", lambda: _point_delta_at(
          st, 2, good[:200] + bytes([good[200] ^ 1]) + good[201:])),
      # Version 3's delta served as version 2's: applies to the wrong parent.
      ("reordered", lambda: _point_delta_at(st, 2, delta.encode(hist[2], hist[3],
                                                                chunk_elems=testing.CHUNK))),
      # From another training run with the same shapes.
      ("foreign", lambda: _point_delta_at(st, 2, delta.encode(other[1], other[2],
                                                              chunk_elems=testing.CHUNK))),
      # Encoded against a base with other shapes.
      ("wrong_shapes", lambda: _point_delta_at(st, 2, delta.encode(odd, hist[2],
                                                                   chunk_elems=testing.CHUNK))),
      # A manifest claiming another parent.
      ("wrong_parent", lambda: _rewrite_manifest(st, 2, parent_digest="f" * 32)),
  ]


@pytest.mark.parametrize("fault", range(7))
def test_bad_delta_is_rejected_and_recovered_by_snapshot(tmp_path, fault):
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2, snapshot_every=2)
  sub.poll()
  sub.poll()  # no-op: already at 1
  assert sub.version == 1
  pub.publish(hist[2])  # version 2: a delta and a snapshot
  name, corrupt = _faults(st, hist)[fault]
  corrupt()
  r = sub.poll()
  assert r.recovered, name
  assert r.steps == [("snapshot", 2)] and sub.version == 2
  assert testing.same_bits(sampler.applied[-1][1], hist[2])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fault", range(7))
def test_bad_delta_without_snapshot_keeps_the_old_version(tmp_path, fault, inplace):
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2, inplace=inplace)
  sub.poll()
  held = sub.weights
  pub.publish(hist[2])
  _faults(st, hist)[fault][1]()
  with pytest.raises(subscriber.SyncError):
    sub.poll()
  assert sub.version == 1 and sub.weights is held
  assert testing.same_bits(sub.weights, hist[1])  # in place: rolled back or never written
  assert [v for v, _ in sampler.applied] == [1]


@pytest.mark.parametrize("inplace", [False, True])
def test_failing_apply_fn_keeps_the_old_version(tmp_path, inplace):
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2, inplace=inplace)
  sub.poll()

  def broken(flat, version):
    raise RuntimeError("sampler refused")
  sub.apply_fn = broken
  pub.publish(hist[2])
  with pytest.raises(RuntimeError):
    sub.poll()
  assert sub.version == (2 if inplace else 1)  # in place: held on the host, not yet served
  sub.apply_fn = sampler
  r = sub.poll()
  assert r.version == 2 and r.from_version == 1
  assert [v for v, _ in sampler.applied] == [1, 2]
  assert testing.same_bits(sampler.applied[-1][1], hist[2])


def test_inplace_writes_the_held_arrays_and_catches_up(tmp_path):
  st, pub, hist, sampler, sub = _setup(tmp_path, inplace=True, snapshot_every=4)
  sub.poll()
  arrays = dict(sub.weights)
  for v in range(1, 3):
    pub.publish(hist[v])
    r = sub.poll()
    assert r.steps == [("delta", v)] and r.decode_s > 0
    assert all(sub.weights[k] is arrays[k] for k in arrays)  # no new model allocated
    assert testing.same_bits(sampler.applied[-1][1], hist[v])
  for w in hist[3:6]:
    pub.publish(w)
  r = sub.poll()  # a chain of deltas, or snapshot 4 plus a delta
  assert r.version == 5 and testing.same_bits(sub.weights, hist[5])
  assert testing.same_bits(sampler.applied[-1][1], hist[5])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
