"""The engine's automatic prefix caching: what a prefill takes from the cache and what it adds.

What: `PrefixReuse` is the engine thread's glue between its slots and the prefix cache
(`rollout.prefix_cache` on the host, `rollout.prefix_programs` on the device):
  * `plan(h)`: for the scheduler, how many prompt tokens a request still has to prefill and the
    key of its first uncached block (`rollout.scheduler` defers a request whose first uncached
    block another request of the same prefill call computes: it then hits the cache one call
    later instead of computing the same block twice -- how the n attempts of a prompt sent as n
    requests, or a batch repeating a system prompt, share it);
  * `lookup(h)`: the cached prefix a prefill starts from (at most (P - 1) // B blocks: the last
    prompt token is always computed, its logits sample the first token);
  * `insert_prompt` / `insert_finished`: the blocks of a prompt after its prefill, and of
    prompt + generated tokens when a completion finishes (all but the last token, which was
    never fed, so has no KV), so the next turn of a conversation -- prompt + completion +
    observation -- hits all of it;
  * `flush(cache_k, cache_v)`: runs the queued copies from slots into the store; the engine
    calls it before every device call that could overwrite a slot;
  * `invalidate()`: a weight swap; cached blocks were computed by the old weights and are
    dropped (counted), and requests admitted before it are not inserted when they finish.

Routing: a block keeps the routing recorded when its KV was computed (by a prefill or by the
decode steps that fed the completion's tokens), so `prompt_routing` of a request served from the
cache is what a full prefill would have returned, position by position, for replay.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from moe.config import ModelConfig
from rollout import prefix_cache
from rollout import prefix_programs
from rollout import scheduler as scheduler_lib
from rollout.engine_types import EngineConfig, RequestHandle, Sample

log = logging.getLogger(__name__)

# Block copies into the store are padded to a power of two from this many per call, so that few
# copy programs compile (`copy_batch`).
MIN_COPY_BATCH = 8


def always_extends(config: EngineConfig) -> bool:
  """Whether every prefill is an extend call, from an empty prefix when nothing is cached:
  deterministic mode (a row's arithmetic must not depend on whether the others hit the cache)
  and "coarse" shapes (the plain prefill's programs are not compiled too). Otherwise a call
  extends only when one of its prompts has a cached prefix."""
  return config.deterministic or config.shape_buckets == scheduler_lib.COARSE


def copy_batch(pending: int) -> int:
  """Entries of the copy call for `pending` queued block copies (padding is dropped)."""
  return scheduler_lib.pow2_at_least(pending, MIN_COPY_BATCH)


class PrefixReuse:
  """The prefix cache of one engine (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, config: EngineConfig, max_len: int, dtype, blocks: int,
               sharding=None):
    """`sharding`: where the store lives (`rollout.placement.Placement.cache_sharding`; None:
    the default device)."""
    self.cfg = cfg
    self.config = config
    self.max_len = max_len
    self.blocks = blocks
    self.block_size = config.prefix_block_size
    self.index = prefix_cache.PrefixIndex(blocks, self.block_size)
    self._dtype = dtype
    self._sharding = sharding
    self.store_k, self.store_v = prefix_programs.allocate_store(cfg, blocks, self.block_size,
                                                                dtype, sharding)
    self.max_blocks = max(1, (max_len - 1) // self.block_size)  # a cached prefix is < max_len
    self.stats = self.index.stats

  # ------------------------------------------------------------------ planning and lookup
  def keys(self, h: RequestHandle) -> list:
    """The chained keys of the prompt's full blocks (computed once per request)."""
    if h.prefix_keys is None:
      h.prefix_keys = prefix_cache.chain_keys(h.prompt, self.block_size)
    return h.prefix_keys

  def _limit(self, h: RequestHandle) -> int:
    return (len(h.prompt) - 1) // self.block_size

  def plan(self, h: RequestHandle) -> tuple:
    """(prompt tokens left to prefill, key of the first uncached block or None); no effects."""
    keys = self.keys(h)
    have = self.index.match(keys)
    usable = min(have, self._limit(h))
    return len(h.prompt) - usable * self.block_size, (keys[have] if have < len(keys) else None)

  def cached_tokens(self, prompt, keys: Optional[list] = None) -> int:
    """Prompt tokens a prefill of `prompt` would take from the cache now (`keys`: its
    `chain_keys`, if known); changes nothing. Read from another thread it is a hint: the
    engine's loop may insert or evict blocks meanwhile."""
    keys = prefix_cache.chain_keys(prompt, self.block_size) if keys is None else keys
    usable = min(self.index.match(keys), (len(prompt) - 1) // self.block_size)
    return max(usable, 0) * self.block_size

  def lookup(self, h: RequestHandle) -> list:
    """The cached blocks a prefill of `h` starts from (counted as a lookup)."""
    h.prefix_epoch = self.index.epoch
    return self.index.lookup(self.keys(h), self._limit(h), len(h.prompt))

  def table_width(self, blocks: int) -> int:
    """Block-table columns of an extend call whose longest cached prefix has `blocks` blocks:
    a power of four ("coarse" shapes) or of two ("fine"), so few shapes compile, or all a
    cached prefix can use when deterministic (so a row's arithmetic never depends on the other
    rows')."""
    if self.config.deterministic:
      return self.max_blocks
    ratio = 2 if self.config.shape_buckets == scheduler_lib.FINE else 4
    return min(scheduler_lib.geometric_at_least(max(blocks, 1), 1, ratio), self.max_blocks)

  # ------------------------------------------------------------------ inserting
  def insert_prompt(self, h: RequestHandle, slot: int, routing: Optional[np.ndarray]) -> None:
    """Adds the prompt's blocks, whose KV the prefill just wrote into `slot`; `routing` is that
    of prompt positions [0, P) ([moe_layers, P, k] or None)."""
    self.index.insert(self.keys(h), slot, routing)

  def insert_finished(self, h: RequestHandle, s: Sample, slot: int) -> None:
    """Adds the blocks of prompt + s.tokens[:-1], whose KV is in `slot`, unless a weight swap
    happened since the request was admitted (its KV is then partly the old weights')."""
    if h.prefix_epoch != self.index.epoch or len(s.tokens) < 2:
      return
    seq = list(h.prompt) + list(s.tokens[:-1])
    keys = prefix_cache.chain_keys(seq, self.block_size, known=self.keys(h))
    if len(keys) <= len(self.keys(h)):
      return  # no full block past the prompt's, which its prefill inserted
    routing = None
    if self.cfg.num_moe_layers:
      # Positions 0..P-2 are the prompt routing's; position P-1+i was fed the input of token i
      # (the last prompt token, then token i-1), so its routing is s.routing[i].
      routing = np.concatenate([h.prompt_routing, np.stack(s.routing, axis=1)], axis=1)
    self.index.insert(keys, slot, routing)

  def flush(self, cache_k, cache_v) -> None:
    """Copies every queued block from its slot into the store (one device call)."""
    if not self.index.has_pending():
      return
    pending = self.index.take_pending()
    m = copy_batch(len(pending))
    n = self.blocks
    slot = np.zeros(m, np.int32)
    bidx = np.zeros(m, np.int32)
    dst = np.full(m, n, np.int32)  # n is out of range: padding entries are dropped
    for j, (block_id, sl, i) in enumerate(pending):
      dst[j], slot[j], bidx[j] = block_id, sl, i
    try:
      self.store_k, self.store_v = prefix_programs.save_blocks(
          self.store_k, self.store_v, cache_k, cache_v, slot, bidx, dst)
    except Exception:
      # The store was donated: start over with an empty one (no request depends on it).
      log.exception("copying %d blocks into the prefix cache failed; cache cleared", len(pending))
      self.reset()

  # ------------------------------------------------------------------ dropping
  def invalidate(self) -> int:
    """New weights: drops every cached block (counted as invalidations)."""
    return self.index.clear(invalidation=True)

  def reset(self) -> None:
    """Drops every block and allocates a fresh store (the slot cache or store buffers were
    lost to a failed device call; not counted as an invalidation)."""
    self.index.clear(invalidation=False)
    if any(x.is_deleted() for x in (*self.store_k, *self.store_v)):
      self.store_k, self.store_v = prefix_programs.allocate_store(
          self.cfg, self.blocks, self.block_size, self._dtype, self._sharding)

  def metrics(self) -> dict:
    """The prefix cache's counters and gauges for `Engine.metrics()`."""
    st = self.stats
    looked = st["lookup_tokens"]
    return {"prefix_cache_lookups_total": st["lookups"],
            "prefix_cache_lookup_tokens_total": looked,
            "prefix_cache_hits_total": st["hits"],
            "prefix_cache_hit_tokens_total": st["hit_tokens"],
            "prefix_cache_hit_rate": st["hit_tokens"] / looked if looked else 0.0,
            "prefix_cache_blocks": len(self.index),
            "prefix_cache_capacity_blocks": self.index.capacity,
            "prefix_cache_inserted_blocks_total": st["inserted_blocks"],
            "prefix_cache_evictions_total": st["evictions"],
            "prefix_cache_invalidations_total": st["invalidations"],
            "prefix_cache_invalidation_events_total": st["invalidation_events"]}

