"""The engine's device side: its weights, KV cache and prefix store on its devices, and the calls.

What: `ModelRunner` holds everything of one engine that lives on its devices and makes every
device call of its serving loop:
  * where the arrays live (`rollout.placement`: the default device, one device, or a mesh for
    tensor and expert parallelism) and the context the programs run in;
  * the packed weights (`pack` packs and places new ones off the serving loop; `swap_params`
    puts them in and keeps the old ones until the next device call is queued, so their free
    overlaps its compute);
  * the slot KV cache (`rollout.kv_cache`; reallocated after a failed call consumed it) and the
    prefix cache's device store (`rollout.prefix_reuse`);
  * `prefill` (a plain prefill or an extend after cached prefixes) and `decode` (one
    `decode_steps` chunk), their outputs brought to the host.

Why split from `rollout.engine`: the engine decides what runs (requests, slots, swaps) and this
module how it runs on the devices; sharding the engine over a mesh changes only this side.
"""

from __future__ import annotations

import time
import jax
import numpy as np

from moe.config import ModelConfig
from rollout import device_programs
from rollout import kv_cache
from rollout import packed_weights
from rollout import placement as placement_lib
from rollout import prefix_programs
from rollout import prefix_reuse
from rollout import slot_tables
from rollout import warmup
from rollout.engine_types import EngineConfig


class ModelRunner:
  """One engine's device state and calls (see the module docstring).

  Args:
    cfg: the served model's config.
    config: the engine's settings.
    max_len: the slot cache's length.
    flat: the first weights (flat names).
    placement: where the arrays live (`rollout.placement.Placement`).
    prefix_blocks: blocks of the prefix cache (0: none).
  """

  def __init__(self, cfg: ModelConfig, config: EngineConfig, max_len: int, flat,
               placement: placement_lib.Placement, prefix_blocks: int):
    self.cfg = cfg
    self.config = config
    self.max_len = max_len
    self.placement = placement
    self.params = self.pack(flat)
    self.retired = None  # the weights before the last swap, freed once the next call is queued
    dtype = self.params["embed"].dtype
    self.prefix = (prefix_reuse.PrefixReuse(
        cfg, config, max_len, dtype, prefix_blocks,
        sharding=placement.cache_sharding((1, cfg.num_kv_heads, 1, 1)))
                   if prefix_blocks else None)
    self.alloc_cache()

  # ------------------------------------------------------------------ state
  def pack(self, flat):
    """Packs `flat` (validated by the caller) onto the engine's devices; blocks until placed."""
    params = self.placement.put_params(
        packed_weights.pack_host(flat, self.cfg, self.config.dtype, self.placement.groups))
    jax.block_until_ready(params)
    return params

  def swap_params(self, params, retire=None) -> None:
    """Serves `params` from the next call. The old weights (and `retire`, e.g. their host
    copy) are kept until that call is queued, so that freeing them (GBs) overlaps its compute
    instead of pausing decoding."""
    self.retired = (self.params, retire)
    self.params = params

  def alloc_cache(self) -> None:
    """A zeroed slot cache (at start, and after a failed call consumed the donated one)."""
    cfg = self.cfg
    sharding = self.placement.cache_sharding((1, cfg.num_kv_heads, 1, 1))
    self.ck, self.cv = kv_cache.allocate(cfg, self.config.max_slots, self.max_len,
                                         self.params["embed"].dtype, sharding)
    if self.prefix is not None:  # blocks waiting to be copied out of the old cache are lost
      self.prefix.reset()

  def cache_alive(self) -> bool:
    """Whether the KV cache buffers still exist (a failed call may have consumed donated ones)."""
    return not any(x.is_deleted() for x in (*self.ck, *self.cv))

  def flush_prefix(self) -> None:
    """Copies the blocks queued for the prefix store out of the slots (before a call that could
    overwrite them)."""
    if self.prefix is not None:
      with self.placement.context():
        self.prefix.flush(self.ck, self.cv)

  def warmup_args(self, slots: dict) -> warmup.Arguments:
    """The shapes (and shardings) of the device state every program takes, with the engine's
    slot tables `slots`."""
    pr = self.prefix
    return warmup.Arguments.of(self.params, self.ck, self.cv, slots,
                               pr.store_k if pr else None, pr.store_v if pr else None)

  # ------------------------------------------------------------------ calls
  def prefill(self, staged: list, rows: int, length: int, caps: tuple, top_n: int) -> tuple:
    """One prefill device call for `staged` [(handle, slots, staged values)] padded to `rows`
    prompts of `length`; returns (its outputs on the host, prompt tokens prefilled).

    An extend call (`rollout.prefix_programs`) when the prefix cache makes every prefill one,
    or when a prompt starts from cached blocks; a plain prefill otherwise.
    """
    ec, cfg = self.config, self.cfg
    a = slot_tables.prefill_arrays(staged, rows, length, ec.max_slots)
    pr = self.prefix
    with self.placement.context():
      if pr is not None and (prefix_reuse.always_extends(ec)
                             or any(v["start"] for _, _, v in staged)):
        table = np.zeros((rows, pr.table_width(max(len(v["blocks"]) for _, _, v in staged))),
                         np.int32)
        start = np.zeros(rows, np.int32)
        for r, (_, _, v) in enumerate(staged):
          table[r, :len(v["blocks"])] = v["blocks"]
          start[r] = v["start"]
        self.ck, self.cv, *out = prefix_programs.extend_into_slots(
            self.params, self.ck, self.cv, pr.store_k, pr.store_v, table, start, a["tokens"],
            a["lengths"], a["dst"], a["src"], a["temp"], a["top_k"], a["top_p"], a["seed"],
            a["sample"], cfg=cfg, caps=caps, top_n=top_n)
      else:
        self.ck, self.cv, *out = device_programs.prefill_into_slots(
            self.params, self.ck, self.cv, a["tokens"], a["lengths"], a["dst"], a["src"],
            a["temp"], a["top_k"], a["top_p"], a["seed"], a["sample"], cfg=cfg, caps=caps,
            top_n=top_n)
      out = tuple(np.asarray(x) for x in out)
    return out, int(a["lengths"][:len(staged)].sum())

  def decode(self, slots: dict, *, nb: int, sv: int, caps: tuple,
             top_n: int) -> tuple[dict, dict, float]:
    """One decode chunk over slots [0, nb) attending over [0, sv); returns (carried slot
    fields, outputs, seconds spent freeing the retired weights), on the host."""
    with self.placement.context():
      self.ck, self.cv, carried, outs = device_programs.decode_chunk(
          self.params, self.ck, self.cv, slots, cfg=self.cfg, nb=nb, sv=sv,
          steps=self.config.decode_steps, caps=caps, top_n=top_n)
      t_free = time.perf_counter()
      self.retired = None  # the call is queued (async dispatch): free old weights meanwhile
      free_s = time.perf_counter() - t_free
      outs = jax.device_get(outs)
      carried = jax.device_get(carried)
    return carried, outs, free_s

