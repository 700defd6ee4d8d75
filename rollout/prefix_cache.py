"""Automatic prefix caching, host side: which token prefixes have KV blocks in the block store.

What: `PrefixIndex` maps token prefixes, in whole blocks of `block_size` tokens, to blocks of a
device-resident block store (`rollout.prefix_programs`), as vLLM's automatic prefix caching does:
  * A block is named by a chained key: the digest of its parent block's key and its own tokens
    (`chain_keys`), so a key names the whole prefix up to the block's end, and two sequences
    share a block exactly when they share every token up to it.
  * `match` (no side effects; the scheduler plans with it) and `lookup` (counted, refreshes the
    LRU order) find the longest cached block prefix of a prompt.
  * `insert` adds the blocks of a sequence whose KV sits in a slot; the copies from the slot into
    the store are queued (`take_pending`) and run by the engine in one device call before its
    next call that could overwrite that slot.
  * Each block keeps the MoE routing recorded when its KV was computed ([moe_layers, block, k]),
    so a request served from the cache returns the routing it would have recomputed.
  * Bounded: at most `capacity` blocks; inserting into a full store evicts the least recently
    used block (counted). `clear` drops everything (a weight swap: counted as invalidations) and
    starts a new `epoch`, so a request whose KV predates it is never inserted afterwards.

Why these choices:
  * Chained digests, not a radix tree: a dict lookup per block is all a lookup needs, and blake2b
    over the parent digest and the block's int32 bytes makes a collision (which would serve one
    prefix's KV for another's) practically impossible, unlike Python's 64-bit `hash`.
  * LRU order with children older than parents: a lookup or insert refreshes a chain leaf first,
    root last, so the root is the most recent and eviction takes leaves first. Evicting a parent
    before its children would leave the children unreachable (a lookup stops at the first miss)
    while they still hold memory.
  * Only the engine thread calls this (no lock).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Optional, Sequence

import numpy as np

_ROOT = b""


def chain_keys(tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list:
  """The chained keys of every full block of `tokens`.

  Args:
    tokens: the token ids.
    block_size: tokens per block.
    known: keys already computed for a prefix of `tokens` (the first len(known) blocks); they
      are reused, so extending a prompt's chain by its completion hashes only the new blocks.
  """
  n = len(tokens) // block_size
  keys = list(known[:n])
  arr = np.asarray(tokens[len(keys) * block_size:n * block_size], np.int32)
  parent = keys[-1] if keys else _ROOT
  for i in range(n - len(keys)):
    block = arr[i * block_size:(i + 1) * block_size]
    parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
    keys.append(parent)
  return keys


@dataclasses.dataclass
class Block:
  """One cached block: its place in the store and the routing of its positions."""
  block_id: int
  routing: Optional[np.ndarray]  # [moe_layers, block_size, k], None for dense models


class PrefixIndex:
  """The host-side index of the block store (see the module docstring)."""

  def __init__(self, capacity: int, block_size: int):
    if capacity < 1 or block_size < 1:
      raise ValueError(f"capacity and block_size must be >= 1, got {capacity}, {block_size}")
    self.capacity = capacity
    self.block_size = block_size
    self._blocks: collections.OrderedDict = collections.OrderedDict()  # key -> Block, LRU first
    self._free = list(range(capacity - 1, -1, -1))  # block ids not in use (pop gives lowest)
    self._pending: dict = {}  # block id -> (slot, block index in the slot): copies to make
    self.epoch = 0
    self.stats = collections.Counter()

  def __len__(self) -> int:
    return len(self._blocks)

  def __contains__(self, key: bytes) -> bool:
    return key in self._blocks

  def match(self, keys: Sequence[bytes], limit: Optional[int] = None) -> int:
    """How many leading blocks of `keys` are cached (at most `limit`); changes nothing."""
    n = 0
    for k in keys[:limit]:
      if k not in self._blocks:
        break
      n += 1
    return n

  def lookup(self, keys: Sequence[bytes], limit: int, prompt_tokens: int) -> list:
    """The cached blocks of the longest cached prefix of `keys` (at most `limit`), counted.

    `prompt_tokens` is the prompt's length, for the token hit rate. Refreshes the blocks found
    (leaf first, so the root stays the most recent).
    """
    found = [self._blocks[k] for k in keys[:self.match(keys, limit)]]
    for k in reversed(keys[:len(found)]):
      self._blocks.move_to_end(k)
    self.stats["lookups"] += 1
    self.stats["lookup_tokens"] += prompt_tokens
    if found:
      self.stats["hits"] += 1
      self.stats["hit_tokens"] += len(found) * self.block_size
    return found

  def insert(self, keys: Sequence[bytes], slot: int, routing: Optional[np.ndarray]) -> int:
    """Adds the blocks named by `keys` whose KV is in `slot` (block i at positions i*B..);
    returns how many were new.

    `routing` ([moe_layers, >= len(keys) * B, k] or None) is the routing of the slot's positions.
    Blocks already cached are refreshed; a chain longer than the capacity keeps its first
    `capacity` blocks. New blocks evict the least recently used blocks outside this chain.
    """
    keys = list(keys[:self.capacity])
    if routing is not None and routing.shape[1] < len(keys) * self.block_size:
      raise ValueError(f"routing of {routing.shape[1]} positions does not cover "
                       f"{len(keys)} blocks of {self.block_size}")
    for k in reversed(keys):  # refresh what is there first, so eviction does not take it
      if k in self._blocks:
        self._blocks.move_to_end(k)
    chain = set(keys)
    new = 0
    b = self.block_size
    for i, k in enumerate(keys):
      if k in self._blocks:
        continue
      block_id = self._allocate(chain)
      r = None if routing is None else np.array(routing[:, i * b:(i + 1) * b])
      self._blocks[k] = Block(block_id, r)
      self._pending[block_id] = (slot, i)
      new += 1
    for k in reversed(keys):  # leaf first, root last: the root is the most recent
      self._blocks.move_to_end(k)
    self.stats["inserted_blocks"] += new
    return new

  def _allocate(self, protect: set) -> int:
    if self._free:
      return self._free.pop()
    victim = next(k for k in self._blocks if k not in protect)
    block = self._blocks.pop(victim)
    self._pending.pop(block.block_id, None)  # never copied: nothing to copy any more
    self.stats["evictions"] += 1
    return block.block_id

  def take_pending(self) -> list:
    """The queued copies [(block id, slot, block index in the slot)], emptied."""
    out = [(bid, slot, i) for bid, (slot, i) in self._pending.items()]
    self._pending = {}
    return out

  def has_pending(self) -> bool:
    return bool(self._pending)

  def clear(self, invalidation: bool = True) -> int:
    """Drops every block and queued copy, starting a new epoch; returns the blocks dropped.

    `invalidation` counts them as invalidated by new weights (False: the engine lost its cache
    buffers after a failed device call, which is no weight change).
    """
    n = len(self._blocks)
    self._blocks.clear()
    self._pending = {}
    self._free = list(range(self.capacity - 1, -1, -1))
    self.epoch += 1
    if invalidation:
      self.stats["invalidations"] += n
      self.stats["invalidation_events"] += 1
    return n
