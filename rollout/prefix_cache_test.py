"""The prefix cache's host index: chained block keys, longest-prefix lookup, bounded LRU
eviction (leaves before their parents), queued copies, invalidation (rollout.prefix_cache)."""

import sys

import numpy as np
import pytest

from rollout import prefix_cache

B = 4


def _keys(tokens):
  return prefix_cache.chain_keys(tokens, B)


def test_a_key_names_the_whole_prefix_up_to_its_block():
  a = _keys(list(range(10)))
  assert len(a) == 2  # only full blocks
  b = _keys(list(range(8)) + [99, 98])
  assert a == b  # same first 8 tokens, same keys
  c = _keys([1] + list(range(1, 8)))
  assert c[0] != a[0] and c[1] != a[1]  # block 1 has the same tokens, but another prefix
  longer = list(range(16))
  assert prefix_cache.chain_keys(longer, B, known=a) == _keys(longer)  # extending reuses keys


def test_lookup_finds_the_longest_cached_prefix_within_its_limit_and_counts():
  idx = prefix_cache.PrefixIndex(8, B)
  seq = list(range(12))
  routing = np.arange(2 * 12 * 2).reshape(2, 12, 2)
  assert idx.insert(_keys(seq), slot=3, routing=routing) == 3
  assert sorted(idx.take_pending()) == sorted([(b.block_id, 3, i) for i, b in
                                               enumerate(idx.lookup(_keys(seq), 3, 12))])
  other = list(range(8)) + [50, 51, 52, 53, 54]
  found = idx.lookup(_keys(other), 3, len(other))
  assert len(found) == 2  # the third block differs
  np.testing.assert_array_equal(found[1].routing, routing[:, 4:8])
  assert len(idx.lookup(_keys(seq), 1, 12)) == 1  # the limit
  assert idx.match(_keys([7] * 12)) == 0
  assert idx.stats["lookups"] == 3 and idx.stats["hits"] == 3
  assert idx.stats["hit_tokens"] == (3 + 2 + 1) * B
  assert idx.stats["lookup_tokens"] == 12 + 13 + 12


def test_inserting_a_cached_prefix_adds_only_the_new_blocks():
  idx = prefix_cache.PrefixIndex(8, B)
  assert idx.insert(_keys(list(range(8))), 0, None) == 2
  idx.take_pending()
  assert idx.insert(_keys(list(range(16))), 1, None) == 2
  assert [(s, i) for _, s, i in idx.take_pending()] == [(1, 2), (1, 3)]
  assert len(idx) == 4


def test_memory_is_bounded_and_the_least_recently_used_chain_is_evicted_leaf_first():
  idx = prefix_cache.PrefixIndex(4, B)
  a, b, c = ([t] * 8 for t in (1, 2, 3))  # two blocks each
  idx.insert(_keys(a), 0, None)
  idx.insert(_keys(b), 1, None)
  idx.lookup(_keys(a), 2, 8)  # a is now more recent than b
  idx.insert(_keys(c), 2, None)  # full: evicts b's two blocks, leaf first
  assert len(idx) == 4 and idx.stats["evictions"] == 2
  assert idx.match(_keys(b)) == 0 and idx.match(_keys(a)) == 2 and idx.match(_keys(c)) == 2
  # One more block evicts only the least recent leaf: a's second block (a's root stays, so a
  # still hits one block; evicting the root first would strand the leaf).
  idx.insert(_keys([3] * 8 + [4] * 4), 3, None)
  assert idx.match(_keys(a)) == 1 and idx.stats["evictions"] == 3
  # A chain longer than the store keeps its first `capacity` blocks.
  idx.insert(_keys([9] * 24), 4, None)
  assert len(idx) == 4 and idx.match(_keys([9] * 24)) == 4


def test_an_evicted_block_is_not_copied_and_its_id_is_reused_once():
  idx = prefix_cache.PrefixIndex(2, B)
  idx.insert(_keys([1] * 8), 0, None)  # two pending copies
  idx.insert(_keys([2] * 8), 1, None)  # evicts both before they were copied
  pending = idx.take_pending()
  assert sorted(s for _, s, _ in pending) == [1, 1]
  assert len({bid for bid, _, _ in pending}) == 2  # each store block written once


def test_clear_drops_everything_counts_invalidations_and_starts_an_epoch():
  idx = prefix_cache.PrefixIndex(4, B)
  idx.insert(_keys(list(range(8))), 0, None)
  epoch = idx.epoch
  assert idx.clear() == 2
  assert idx.epoch == epoch + 1 and len(idx) == 0 and not idx.has_pending()
  assert idx.stats["invalidations"] == 2 and idx.stats["invalidation_events"] == 1
  idx.insert(_keys(list(range(8))), 0, None)
  idx.clear(invalidation=False)
  assert idx.stats["invalidations"] == 2


def test_routing_must_cover_the_blocks_inserted():
  idx = prefix_cache.PrefixIndex(4, B)
  with pytest.raises(ValueError, match="routing of 7 positions"):
    idx.insert(_keys(list(range(8))), 0, np.zeros((1, 7, 2)))
  assert len(idx) == 0


def test_bad_sizes_are_refused():
  with pytest.raises(ValueError, match="capacity"):
    prefix_cache.PrefixIndex(0, B)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
