"""Tests for sharded publishing (numpy blocks; the learner's own shards on 8 CPU devices are
tested in tools/bench_sync_sharded_test.py): two publishing processes (threads with a barrier)
cover a model, a subscriber rebuilds every version bit for bit shard by shard, a stream running
ahead is not mistaken for the version, a bad cover is refused, a sampler can follow part of the
model, a damaged shard hands nothing over, and a restarted process re-publishes idempotently."""

import sys
import threading

import numpy as np
import pytest

from sync import manifest as manifest_lib
from sync import objects
from sync import relay
from sync import sharded
from sync import store as store_lib
from sync import subscriber
from sync import testing
from sync import transport
from sync import weights

TIMEOUT_S = 60


def _blocks(flat, splits=2):
  """Every tensor cut into `splits` blocks along each of its first two dimensions."""
  out = []
  for name in sorted(flat):
    a = flat[name]
    cuts = [np.linspace(0, d, min(splits, d) + 1).astype(int) for d in a.shape[:2]]
    if a.ndim == 1:
      boxes = [((int(x), int(y)),) for x, y in zip(cuts[0], cuts[0][1:])]
    else:
      boxes = [((int(x0), int(y0)), (int(x1), int(y1)))
               for x0, y0 in zip(cuts[0], cuts[0][1:]) for x1, y1 in zip(cuts[1], cuts[1][1:])]
    for box in boxes:
      out.append((name, box, a.shape, np.ascontiguousarray(a[tuple(slice(*b) for b in box)])))
  return out


class _Sampler:
  def __init__(self):
    self.applied = []

  def __call__(self, flat, version):
    self.applied.append((version, {k: v.copy() for k, v in flat.items()}))


class _Parts:
  """Two publishing processes as threads: part p publishes the blocks with index % 2 == p."""

  def __init__(self, st, **kw):
    self.barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    self.pubs = [sharded.ShardedPublisher(st, part=p, parts=2, barrier=self.barrier.wait,
                                          chunk_elems=testing.CHUNK, **kw) for p in range(2)]

  def publish(self, flat):
    blocks = _blocks(flat)
    reports = [None, None]
    errors = []

    def run(p):
      try:
        reports[p] = self.pubs[p].publish(b for i, b in enumerate(blocks) if i % 2 == p)
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
        self.barrier.abort()

    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a publishing process hung"
    if errors:
      raise errors[0]
    return reports


class _Counting:
  """A source that records the key and size of every object read."""

  def __init__(self, source):
    self.source, self.reads = source, []

  def get(self, key):
    data = self.source.get(key)
    self.reads.append((key, len(data)))
    return data


def test_two_processes_publish_their_shards_and_a_sampler_rebuilds_every_version(tmp_path):
  st = store_lib.Store(str(tmp_path))
  parts = _Parts(st)
  hist = testing.history(4)
  src = _Counting(st)
  sampler = _Sampler()
  sub = sharded.ShardedSubscriber(src, sampler)
  for v, flat in enumerate(hist):
    reports = parts.publish(flat)
    m = reports[0].manifest
    assert reports[1].manifest is None and m.version == v == sharded.read_index(st).latest
    # The manifest lists every block, each from its own stream at this version.
    assert [(r.name, r.box) for r in m.shards] == [(n, b) for n, b, _, _ in _blocks(flat)]
    assert m.tensors == {n: [weights.dtype_name(a.dtype), list(a.shape)] for n, a in flat.items()}
    assert sum(r.shards for r in reports) == len(m.shards)
    assert max(r.largest_block for r in reports) == max(b.nbytes for *_, b in _blocks(flat))
    if v:
      assert all(r.delta_bytes is not None for r in m.shards)
      assert sum(r.delta_bytes for r in reports) == m.delta_bytes
    src.reads.clear()
    rep = sub.poll()
    assert rep.version == v and sampler.applied[-1][0] == v
    assert testing.same_bits(sampler.applied[-1][1], flat)
    # Shard by shard: every object read is one shard's (or the version's list), none whole.
    objects_read = [(k, n) for k, n in src.reads if k.startswith("shards/") and (
        "/delta.bin" in k or "/snapshot/" in k)]
    assert objects_read and all(
        n < weights.nbytes(flat) / 2 for _, n in objects_read), objects_read
    assert sub.poll() is None
  assert len(sampler.applied) == 4


def test_a_stream_ahead_of_the_version_is_not_taken_for_it(tmp_path):
  # Part 1 has published its shards of version 2 and waits for part 0; a sampler polling now
  # gets version 1 whole, every shard at 1, none at 2.
  st = store_lib.Store(str(tmp_path))
  hist = testing.history(3)
  at_barrier, release = threading.Event(), threading.Event()

  def held_barrier():
    at_barrier.set()
    assert release.wait(TIMEOUT_S)

  pubs = [sharded.ShardedPublisher(st, part=p, parts=2, barrier=lambda: None,
                                   chunk_elems=testing.CHUNK) for p in range(2)]
  for flat in hist[:2]:
    blocks = _blocks(flat)
    pubs[1].publish(b for i, b in enumerate(blocks) if i % 2 == 1)
    pubs[0].publish(b for i, b in enumerate(blocks) if i % 2 == 0)
  pubs[1].barrier = held_barrier
  blocks = _blocks(hist[2])
  t = threading.Thread(target=pubs[1].publish, args=([b for i, b in enumerate(blocks) if i % 2],))
  t.start()
  try:
    assert at_barrier.wait(TIMEOUT_S)
    ahead = [manifest_lib.shard_prefix(n, b) for i, (n, b, _, _) in enumerate(blocks) if i % 2]
    assert {objects.read_index(store_lib.prefixed(st, p)).latest for p in ahead} == {2}
    sampler = _Sampler()
    sub = sharded.ShardedSubscriber(st, sampler)
    assert sub.poll().version == 1
    assert testing.same_bits(sampler.applied[-1][1], hist[1])
  finally:
    release.set()
    t.join(TIMEOUT_S)
  pubs[0].publish(b for i, b in enumerate(blocks) if i % 2 == 0)
  assert sub.poll().version == 2 and testing.same_bits(sampler.applied[-1][1], hist[2])


def test_shards_that_do_not_cover_the_model_are_refused(tmp_path):
  st = store_lib.Store(str(tmp_path))
  flat = testing.history(1)[0]
  blocks = _blocks(flat)
  pub = sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK)
  with pytest.raises(ValueError, match="do not make a model: the shards of 'embed' hold"):
    pub.publish(b for b in blocks if not (b[0] == "embed" and b[1][0][0] == 0))
  assert sharded.read_index(st).latest is None
  name, box, shape, block = blocks[0]
  with pytest.raises(ValueError, match="not its box's"):
    sharded.ShardedPublisher(st).publish([(name, box, shape, block[:1])])
  overlap = [(name, ((0, shape[0]),) + box[1:], shape, np.zeros(
      (shape[0],) + block.shape[1:], block.dtype))]
  problem = manifest_lib.cover_problem({name: ["bfloat16", list(shape)]},
                                       {name: [overlap[0][1], box]})
  assert problem and "overlap" in problem


def test_a_sampler_host_can_follow_its_own_shards_only(tmp_path):
  st = store_lib.Store(str(tmp_path))
  parts = _Parts(st)
  hist = testing.history(2)
  mine = {(n, b) for i, (n, b, _, _) in enumerate(_blocks(hist[0])) if i % 2 == 0}
  got = []
  sub = sharded.ShardedSubscriber(st, lambda blocks, v: got.append((v, dict(blocks))),
                                  select=lambda n, b: (n, b) in mine, assemble=False)
  parts.publish(hist[0])
  assembling = sharded.ShardedSubscriber(st, None, select=lambda n, b: (n, b) in mine)
  with pytest.raises(ValueError, match="assemble=False"):
    assembling.poll()
  for v, flat in enumerate(hist):
    if v:
      parts.publish(flat)
    rep = sub.poll()
    assert rep.version == v and rep.shards == len(mine)
    version, blocks = got[-1]
    assert version == v and set(blocks) == mine
    for (name, box), block in blocks.items():
      np.testing.assert_array_equal(weights.words(block), weights.words(np.ascontiguousarray(
          flat[name][tuple(slice(*b) for b in box)])))


def test_a_sampler_follows_through_a_relay(tmp_path):
  # Through a relay every shard stream's index is refetched like the top-level one (they are
  # rewritten in place); the rest is cached as immutable.
  st = store_lib.Store(str(tmp_path))
  pub = sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK)
  hist = testing.history(3)
  server = relay.RelayServer(relay.Relay(st, index_ttl_s=0.0))
  server.start()
  src = transport.HttpSource([server.url])
  try:
    sampler = _Sampler()
    sub = sharded.ShardedSubscriber(src, sampler, request_snapshot=False)
    for v, flat in enumerate(hist):
      pub.publish(_blocks(flat))
      assert sub.poll().version == v and testing.same_bits(sampler.applied[-1][1], flat)
  finally:
    src.close()
    server.stop()


def test_a_damaged_shard_hands_nothing_over_until_its_snapshot(tmp_path):
  st = store_lib.Store(str(tmp_path))
  pub = sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK)
  hist = testing.history(3)
  sampler = _Sampler()
  sub = sharded.ShardedSubscriber(st, sampler, name="s")
  pub.publish(_blocks(hist[0]))
  sub.poll()
  pub.publish(_blocks(hist[1]))
  m = sharded.read_manifest(st, 1)
  victim = m.shards[len(m.shards) // 2]
  key = victim.prefix + manifest_lib.delta_key(1)
  data = bytearray(st.get(key))
  data[len(data) // 2] ^= 0xFF
  st.put(key, bytes(data))
  with pytest.raises(subscriber.SyncError, match=victim.prefix):
    sub.poll()
  assert sub.version == 0 and [v for v, _ in sampler.applied] == [0]
  # The shard's subscriber asked its stream for a snapshot; the publisher answers it.
  assert pub.answer_requests() == [(victim.name, victim.box, 1)]
  assert sub.poll().version == 1 and testing.same_bits(sampler.applied[-1][1], hist[1])


def test_a_restarted_process_republishes_the_version_it_died_in(tmp_path):
  # The process died after its shards of version 1 were published and before the version's
  # list: a restarted one publishing the same blocks completes the version; other blocks are
  # refused (they are not what the streams hold).
  st = store_lib.Store(str(tmp_path))
  hist = testing.history(3)
  sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK).publish(_blocks(hist[0]))

  class Dies(RuntimeError):
    pass

  class DiesAtTheList:
    def __init__(self, inner):
      self.inner = inner

    def __getattr__(self, name):
      return getattr(self.inner, name)

    def put(self, key, data):
      if key.startswith("sharded/parts/"):
        raise Dies(key)
      self.inner.put(key, data)

  with pytest.raises(Dies):
    sharded.ShardedPublisher(DiesAtTheList(st), chunk_elems=testing.CHUNK).publish(
        _blocks(hist[1]))
  assert sharded.read_index(st).latest == 0
  with pytest.raises(RuntimeError, match="already holds a different version 1"):
    sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK).publish(_blocks(hist[2]))
  rep = sharded.ShardedPublisher(st, chunk_elems=testing.CHUNK).publish(_blocks(hist[1]))
  assert rep.manifest.version == 1 == sharded.read_index(st).latest
  sampler = _Sampler()
  sharded.ShardedSubscriber(st, sampler).poll()
  assert testing.same_bits(sampler.applied[-1][1], hist[1])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
