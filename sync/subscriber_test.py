"""Tests for the sampler side: catch-up, reports, and every rejected-delta fault."""

import logging
import os
import sys
import threading
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

  def monotonic(self):
    return time.monotonic() + self.offset


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


def _damage(st, version):
  """Flips one byte of `version`'s delta on disk (the manifest's hash no longer matches)."""
  key = manifest_lib.delta_key(version)
  good = st.get(key)
  st.put(key, good[:100] + bytes([good[100] ^ 4]) + good[101:])


def test_damaged_delta_falls_back_to_the_newest_snapshot_and_says_so(tmp_path, caplog):
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2, snapshot_every=3, keep_snapshots=5)
  sub.poll()
  for w in hist[2:6]:  # 2, 3 (a snapshot), 4, 5
    pub.publish(w)
  _damage(st, 2)
  with caplog.at_level(logging.WARNING, logger="sync.subscriber"):
    r = sub.poll()
  assert r.version == 5 and r.steps == [("snapshot", 3), ("delta", 4), ("delta", 5)]
  assert r.fallback and r.skipped == ["delta 2"] and sub.fallbacks == 1
  assert sub.stats()["damaged"] == ["delta 2"] and sub.stats()["fallbacks"] == 1
  assert testing.same_bits(sampler.applied[-1][1], hist[5])
  assert any("delta 2 is damaged" in m for m in caplog.messages)
  assert any("fell back to snapshot 3" in m for m in caplog.messages)
  pub.publish(hist[6])  # later versions follow the (intact) chain after the snapshot
  r = sub.poll()
  assert r.steps == [("delta", 6)] and not r.fallback and sub.fallbacks == 1


@pytest.mark.parametrize("answer", ["answer_requests", "publish"])
def test_damaged_delta_without_a_snapshot_past_it_asks_the_publisher(tmp_path, caplog, answer):
  """No snapshot after the damaged link: the subscriber holds its version, says so and asks; the
  publisher answers with a snapshot of the newest version (when idle, as a learner waiting for
  data is) or makes its next version one; the subscriber then reaches it."""
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2)
  sub.poll()
  for w in hist[2:5]:
    pub.publish(w)
  _damage(st, 2)
  with caplog.at_level(logging.WARNING, logger="sync.subscriber"):
    with pytest.raises(subscriber.SyncError):
      sub.poll()
  assert sub.version == 1 and sub.waiting_for_snapshot == 2
  assert any("no snapshot at or past version 2" in m for m in caplog.messages)
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == [manifest_lib.snapshot_request_key(sub.name)]
  if answer == "answer_requests":
    assert pub.answer_requests() == 4
    want, steps = 4, [("snapshot", 4)]
  else:
    assert pub.publish(hist[5]).snapshot
    want, steps = 5, [("snapshot", 5)]
  assert pub.requested_snapshots == 1
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == []  # answered
  assert pub.answer_requests() is None  # nothing pending
  r = sub.poll()
  assert r.version == want and r.steps == steps and r.fallback and r.skipped == ["delta 2"]
  assert sub.waiting_for_snapshot is None
  assert testing.same_bits(sampler.applied[-1][1], hist[want])
  flat, v = publisher.restore(st, want)  # the added snapshot restores like any other
  assert v == want and testing.same_bits(flat, hist[want])


def test_restore_across_a_damaged_delta_starts_before_it_then_catches_up(tmp_path, caplog):
  """A sampler restarted with a damaged delta between the newest snapshot and the newest
  version: it starts on the newest version before the damage, says so, asks for a snapshot and
  reaches the newest version once one is published (issue #17: it used to fail to start)."""
  st, pub, hist, sampler, sub = _setup(tmp_path, n=6, snapshot_every=3, keep_snapshots=5)
  _damage(st, 4)  # snapshots 0 and 3; 4 lies between snapshot 3 and the newest, 5
  with caplog.at_level(logging.WARNING, logger="sync.subscriber"):
    r = sub.restore()
  assert r.version == sub.version == 3 and r.steps == [("snapshot", 3)]
  assert r.fallback and r.skipped == ["delta 4"] and sub.fallbacks == 1
  assert testing.same_bits(sub.weights, hist[3]) and sampler.applied == []  # held, not applied
  assert any("cannot restore the newest version 5 (damaged delta 4); restored version 3" in m
             for m in caplog.messages)
  assert sub.waiting_for_snapshot == 4
  with pytest.raises(ValueError, match="starts from nothing"):
    sub.restore()  # it holds 3 now: poll moves on
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == [manifest_lib.snapshot_request_key(sub.name)]
  with pytest.raises(subscriber.SyncError):
    sub.poll()  # still no snapshot past the damage: holds 3
  assert pub.answer_requests() == 5
  r = sub.poll()
  assert r.version == 5 and r.steps == [("snapshot", 5)] and r.skipped == ["delta 4"]
  assert testing.same_bits(sampler.applied[-1][1], hist[5])
  # publisher.restore walks the same way (and asks for nothing): the newest version is reached
  # through the added snapshot; version 4 only through the damaged delta, so that is an error.
  flat, v = publisher.restore(st)
  assert v == 5 and testing.same_bits(flat, hist[5])
  with pytest.raises(subscriber.SyncError, match="delta 4"):
    publisher.restore(st, 4)


def test_restore_falls_back_past_a_lost_snapshot_and_a_damaged_delta(tmp_path, caplog):
  """Snapshot 5 listed but its files gone (transient: avoided for the call) and delta 4
  damaged: restore reaches 3, the newest version before both, and says so."""
  st, pub, hist, _, _ = _setup(tmp_path, n=6, snapshot_every=3, keep_snapshots=5)
  _damage(st, 4)  # the cheapest path to 5 is snapshot 3 + deltas 4, 5
  publisher.request_snapshot(st, "other", 5, "test")
  assert pub.answer_requests() == 5
  flat, v = publisher.restore(st)  # the snapshot is the cheapest way, past the damage
  assert v == 5 and testing.same_bits(flat, hist[5])
  st.delete_prefix(manifest_lib.snapshot_dir(5))  # that snapshot lost: back before delta 4
  with caplog.at_level(logging.WARNING, logger="sync.subscriber"):
    flat, v = publisher.restore(st)
  assert v == 3 and testing.same_bits(flat, hist[3])
  assert any("cannot restore the newest version 5 (damaged delta 4); restored version 3" in m
             for m in caplog.messages)
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == []  # publisher.restore asks for nothing
  pub.publish(hist[6])  # a periodic snapshot (every 3), past the damage
  flat, v = publisher.restore(st)
  assert v == 6 and testing.same_bits(flat, hist[6])


def test_restarted_publisher_over_a_damaged_delta_publishes_consistently(tmp_path, caplog):
  """The learner restarts with a damaged delta on the way to the newest version: its publisher
  cannot rebuild that version, so its next version is a snapshot (a delta on weights it does
  not hold would be wrong), and a subscriber following it gets exactly the learner's weights."""
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2)
  sub.poll()  # a sampler at version 1
  for w in hist[2:4]:
    pub.publish(w)
  _damage(st, 2)
  with caplog.at_level(logging.WARNING, logger="sync.publisher"):
    pub2 = publisher.Publisher(st, chunk_elems=testing.CHUNK, snapshot_every=100)
  assert pub2.version == 3
  assert any("cannot rebuild the newest published version 3" in m for m in caplog.messages)
  with pytest.raises(subscriber.SyncError):
    sub.poll()  # stuck at 1; it asks for a snapshot
  assert pub2.answer_requests() is None  # it holds nothing to snapshot: the request waits
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == [manifest_lib.snapshot_request_key(sub.name)]
  r = pub2.publish(hist[4])
  assert r.version == 4 and r.snapshot and r.delta_bytes is None
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == []  # answered by that snapshot
  r = sub.poll()
  assert r.version == 4 and r.steps == [("snapshot", 4)]
  assert testing.same_bits(sampler.applied[-1][1], hist[4])
  pub2.publish(hist[5])  # and deltas on from there
  r = sub.poll()
  assert r.steps == [("delta", 5)] and testing.same_bits(sampler.applied[-1][1], hist[5])


def test_restarted_publisher_holds_the_learners_weights_when_they_match(tmp_path):
  """A restarted publisher that could not rebuild the newest version takes it from the learner
  (`hold`, checked against the digest), then answers requests and publishes deltas again."""
  st, pub, hist, sampler, sub = _setup(tmp_path, n=2)
  sub.poll()
  for w in hist[2:4]:
    pub.publish(w)
  _damage(st, 2)
  pub2 = publisher.Publisher(st, chunk_elems=testing.CHUNK, snapshot_every=100)
  with pytest.raises(subscriber.SyncError):
    sub.poll()
  assert not pub2.hold(hist[2])  # not version 3's weights
  assert pub2.answer_requests() is None
  assert pub2.hold(hist[3])
  assert pub2.answer_requests() == 3
  assert sub.poll().version == 3 and testing.same_bits(sampler.applied[-1][1], hist[3])
  r = pub2.publish(hist[4])
  assert not r.snapshot and r.delta_bytes
  r = sub.poll()
  assert r.steps == [("delta", 4)] and testing.same_bits(sampler.applied[-1][1], hist[4])


def _wait(cond, what, timeout=60.0):
  """Waits (polling) until cond() holds; fails naming `what` after `timeout` s."""
  t0 = time.monotonic()
  while not cond():
    assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
    time.sleep(0.01)


class _Notifying(Sampler):
  """A Sampler that wakes waiters on every swap."""

  def __init__(self):
    super().__init__()
    self.changed = threading.Condition()

  def __call__(self, flat, version):
    super().__call__(flat, version)
    with self.changed:
      self.changed.notify_all()

  def wait_for(self, version, timeout=60.0):
    with self.changed:
      ok = self.changed.wait_for(lambda: self.applied and self.applied[-1][0] == version,
                                 timeout)
    assert ok, f"the sampler never reached version {version}: {[v for v, _ in self.applied]}"


def test_sync_thread_with_an_idle_publisher_gets_past_a_damaged_delta(tmp_path):
  """The deadlock of issue #17: the learner publishes nothing more until the samplers move."""
  st, pub, hist, _, _ = _setup(tmp_path, n=2)
  pub2 = publisher.Publisher(st, chunk_elems=testing.CHUNK, snapshot_every=100,
                             answer_requests_s=0.01)
  sampler = _Notifying()
  sub = subscriber.Subscriber(st, sampler)
  stop = threading.Event()
  t = threading.Thread(target=sub.run, args=(stop, 0.01), daemon=True)
  t.start()
  try:
    sampler.wait_for(1)
    for w in hist[2:4]:
      pub2.publish(w)
    _damage(st, 2)  # (damaged before the subscriber's next poll could read it: it is slower)
    pub2.publish(hist[4])
    sampler.wait_for(4)
  finally:
    stop.set()
    pub2.close()
    t.join(timeout=30)
  assert testing.same_bits(sampler.applied[-1][1], hist[4])
  assert sub.reports[-1].version == 4 and sub.thread_state == "stopped"


def test_torn_index_does_not_kill_the_sync_thread(tmp_path):
  """INDEX.json half-written (by a non-atomic copy): polls fail, are counted and retried; once
  it is whole again the thread moves on to the new version."""
  st, pub, hist, _, _ = _setup(tmp_path, n=2)
  sampler = _Notifying()
  sub = subscriber.Subscriber(st, sampler)
  failed = threading.Event()
  stop = threading.Event()
  t = threading.Thread(target=sub.run, args=(stop, 0.01),
                       kwargs={"on_error": lambda e: failed.set(), "max_backoff_s": 0.05},
                       daemon=True)
  t.start()
  try:
    sampler.wait_for(1)
    path = os.path.join(str(tmp_path), manifest_lib.INDEX_KEY)
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
      f.write(whole[:len(whole) // 2])
    assert failed.wait(60), "a torn index never failed a poll"
    assert t.is_alive() and sub.thread_state == "running" and sub.errors >= 1
    assert "bad index" in sub.last_error
    pub.publish(hist[2])  # rewrites the index whole
    sampler.wait_for(2)
  finally:
    stop.set()
    t.join(timeout=30)
  assert testing.same_bits(sampler.applied[-1][1], hist[2])
  assert sub.last_error is None and sub.thread_state == "stopped"


def test_read_index_retries_a_torn_read():
  st = store_lib.Store("memory://")
  good = manifest_lib.Index(3, {3: (10, None)}).to_bytes()

  class Tearing:
    """Serves the index torn `tears` times, then whole."""

    def __init__(self, tears):
      self.tears = tears

    def get(self, key):
      self.tears -= 1
      return good[:7] if self.tears >= 0 else good
  assert publisher.read_index(Tearing(2), backoff_s=0.001).latest == 3
  with pytest.raises(manifest_lib.ManifestError):
    publisher.read_index(Tearing(5), attempts=5, backoff_s=0.001)
  assert publisher.read_index(st).latest is None  # nothing published yet


def test_health_problem_reports_stale_weights_and_a_dead_thread(tmp_path, monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(subscriber, "time", clock)
  st, pub, hist, sampler, _ = _setup(tmp_path, n=2)
  sub = subscriber.Subscriber(st, sampler, request_snapshot=False)
  sub.poll()
  for w in hist[2:5]:
    pub.publish(w)
  _damage(st, 2)
  with pytest.raises(subscriber.SyncError):
    sub.poll()
  assert sub.health_problem(max_behind_versions=1, max_stale_s=30) is None  # within grace
  clock.offset += 31
  with pytest.raises(subscriber.SyncError):
    sub.poll()  # still stuck (the index itself reads fine)
  problem = sub.health_problem(max_behind_versions=1, max_stale_s=30)
  assert "serving version 1, 3 behind the published 4 for 31 s" in problem
  assert "last error" not in problem  # run() records errors; poll() alone does not
  assert sub.health_problem(max_behind_versions=3, max_stale_s=30) is None  # within bound
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == []  # request_snapshot=False: only waits
  path = os.path.join(str(tmp_path), manifest_lib.INDEX_KEY)
  whole = open(path, "rb").read()
  with open(path, "wb") as f:  # torn: every read fails for 31 s
    f.write(whole[:len(whole) // 2])
  with pytest.raises(manifest_lib.ManifestError):
    sub.poll()
  assert "behind" in sub.health_problem(1, max_stale_s=30)
  clock.offset += 31
  problem = sub.health_problem(1, max_stale_s=30)
  assert "no weight index read succeeded for 31 s (ManifestError: bad index" in problem
  pub.publish(hist[5])  # the index whole again
  publisher.request_snapshot(st, "other", 3, "test")
  pub.answer_requests()
  assert sub.poll().version == 5 and sub.health_problem(1, 30) is None

  def dies(flat, version):
    raise SystemExit("gone")
  sub.apply_fn = dies
  pub.publish(hist[6])
  with pytest.raises(SystemExit):
    sub.run(threading.Event(), 0.01)
  assert "the sync thread died: SystemExit: gone" in sub.health_problem(1, 30)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
