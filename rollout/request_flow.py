"""The engine thread's side of requests in slots: tokens in, requests ended.

What: `RequestFlow` is what the serving loop (`rollout.engine`) does on the host between device
calls:
  * `seed_slots`: hands each prefilled request its first tokens and sets up its slots for
    decoding (sampling settings, position, budget);
  * `take_decode`: hands a decode call's tokens to the requests owning the slots and finishes
    the completions that stopped;
  * `emit` / `finish`: one completion's new tokens (stop strings cut here) and its end, which
    frees its slot and, with a prefix cache, queues the finished sequence's blocks;
  * `expire`, `fail_request`, `fail_all`: requests cancelled, timed out or failed.

Why split from `rollout.engine`: the engine owns the API, the loop and weight swaps, and
`rollout.model_runner` the device calls; this is the bookkeeping that connects their outputs to
requests. It shares the engine's scheduler (slot owners, queue), slot tables, counters and
prefix cache, and runs only on the engine thread.

Failures stay with the request that caused them: a request whose tokens fail on the host fails
alone (`fail_request`), and the others of the same call go on.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from moe.config import ModelConfig
from rollout import outputs
from rollout.engine_types import RequestHandle, Sample

log = logging.getLogger(__name__)


class RequestFlow:
  """Requests in slots, for one engine (see the module docstring).

  Args:
    cfg: the served model's config.
    sched: the engine's `rollout.scheduler.Scheduler`.
    slots: the engine's slot tables (`rollout.slot_tables`).
    stats: the engine's counters (a Counter, updated here).
    prefix: the engine's `rollout.prefix_reuse.PrefixReuse`, or None.
    tokenizer: for stop strings and completion text, or None.
  """

  def __init__(self, cfg: ModelConfig, sched, slots: dict, stats, prefix, tokenizer):
    self.cfg = cfg
    self.sched = sched
    self.slots = slots
    self.stats = stats
    self.prefix = prefix
    self.tokenizer = tokenizer

  # ------------------------------------------------------------------ tokens in
  def seed_slots(self, staged: list, out: tuple, version: int) -> None:
    """Hands each prefilled request its first tokens and seeds its slots for decoding."""
    tok, lp, routing, top_lp, top_ids = out
    moe = self.cfg.num_moe_layers
    st = self.slots
    m = 0
    for r, (h, slots, v) in enumerate(staged):
      first = m
      m += len(slots)
      try:
        n_p, c = len(h.prompt), v["start"]
        h.cached_tokens = c
        full = None  # routing of prompt positions [0, n_p): the cached ones, then the prefill's
        if moe:
          full = routing[:, r, :n_p - c]
          if c:
            full = np.concatenate([v["cached_routing"], full], axis=1)
        h.prompt_routing = full[:, :n_p - 1] if moe else None
        if self.prefix is not None:
          self.prefix.insert_prompt(h, slots[0], full)
        for i, slot in enumerate(slots):
          s = h.samples[i]
          s.slot = slot
          self.sched.assign(slot, h, s)
          for k in ("temp", "top_k", "top_p", "seed", "stop"):
            st[k][slot] = v[k]
          st["sample"][slot] = v["samples"][i]
          t = int(tok[first + i])
          self.emit(h, s, [t], [float(lp[first + i])], [full[:, n_p - 1]] if moe else [None],
                    version, top=[(top_ids[first + i], top_lp[first + i])])
          if s.finish_reason is not None:  # a stop string in the first token
            continue
          st["tok"][slot], st["pos"][slot] = t, n_p
          st["remaining"][slot] = v["remaining"]
          st["tindex"][slot] = 1
          st["active"][slot] = True
          if t in h.stop_ids:
            self.finish(slot, "stop")
          elif h.params.max_tokens == 1:
            self.finish(slot, "length")
        outputs.flush_stream(h)
      except Exception as e:  # host-side handling of this request's tokens: fail it alone
        self.fail_request(h, e)

  def take_decode(self, owned: list, outs: dict, version: int) -> None:
    """Hands a decode call's outputs (`rollout.device_programs.decode_chunk`'s, on the host) to
    the requests owning slots `owned`; finishes the completions that stopped."""
    owner, st = self.sched.owner, self.slots
    valid, toks, lps, routing = outs["valid"], outs["tokens"], outs["logprobs"], outs["routing"]
    touched = {}
    for slot in owned:
      if owner[slot] is None:  # its request failed at an earlier slot of this loop
        continue
      h, s = owner[slot]
      touched[id(h)] = h
      try:
        steps = np.nonzero(valid[:, slot])[0]
        if len(steps):
          self.emit(h, s, toks[steps, slot].tolist(), lps[steps, slot].tolist(),
                    [routing[j, :, slot] if self.cfg.num_moe_layers else None for j in steps],
                    version, [(outs["top_ids"][j, slot], outs["top_logprobs"][j, slot])
                              for j in steps])
        if owner[slot] is not None and not st["active"][slot]:
          last = s.tokens[-1] if s.tokens else None
          self.finish(slot, "stop" if last in h.stop_ids else "length")
      except Exception as e:  # host-side handling of this request's tokens: fail it alone
        self.fail_request(h, e)
    for h in touched.values():
      try:
        outputs.flush_stream(h)
      except Exception as e:
        self.fail_request(h, e)

  def emit(self, h: RequestHandle, s: Sample, tokens, logprobs, routing, version: int,
           top=None) -> None:
    """Appends a completion's new tokens (made by weights `version`); ends it at a stop
    string."""
    outputs.append(h, s, tokens, logprobs, routing, version, top)
    if h.params.stop and s.slot is not None and self.sched.owner[s.slot] is not None:
      if outputs.cut_at_stop_string(h, s, self.tokenizer):
        self.finish(s.slot, "stop", text_done=True)

  # ------------------------------------------------------------------ requests out
  def finish(self, slot: int, reason: str, text_done: bool = False) -> None:
    """Ends the completion in `slot` with `reason` and frees the slot."""
    h, s = self.sched.owner[slot]
    s.finish_reason = reason
    if not text_done and self.tokenizer is not None:
      s.text = outputs.final_text(h, s, reason, self.tokenizer)
    if self.prefix is not None:  # before the slot is reused: its KV is copied out first
      self.prefix.insert_finished(h, s, slot)
    self.free(slot)
    self.maybe_complete(h)

  def maybe_complete(self, h: RequestHandle) -> None:
    if all(s.finish_reason is not None for s in h.samples):
      outputs.flush_stream(h)
      self.complete(h)

  def complete(self, h: RequestHandle) -> None:
    """Resolves the request's future with its completions (once)."""
    if h.future.done():
      return
    out = outputs.completions(h, self.cfg, self.tokenizer)
    self.stats["completions_total"] += len(out)
    h.future.set_result(out)

  def free(self, slot: int) -> None:
    self.sched.release(slot)
    self.slots["active"][slot] = False
    self.slots["pos"][slot] = 0
    self.slots["remaining"][slot] = 0

  def expire(self) -> None:
    """Ends cancelled and timed-out requests, queued or running."""
    now = time.monotonic()
    for h, r in self.sched.expired_queued(now):
      for s in h.samples:
        s.finish_reason = r
      self.complete(h)
      self.stats[f"{r}_total"] += 1
    seen = set()
    for slot, r in self.sched.expired_slots(now):
      h, s = self.sched.owner[slot]
      s.finish_reason = r
      self.free(slot)
      if id(h) not in seen:
        seen.add(id(h))
        self.stats[f"{r}_total"] += 1
      self.maybe_complete(h)

  def fail_request(self, h: RequestHandle, err: BaseException) -> None:
    """Ends one request with `err` (its future raises), freeing the slots it holds."""
    log.error("request %d failed: %r", h.id, err)
    for s in h.samples:
      o = None if s.slot is None else self.sched.owner[s.slot]
      if o is not None and o[0] is h:
        self.free(s.slot)
    if not h.future.done():
      self.stats["failed_total"] += 1
      h.future.set_exception(err)

  def fail_all(self, err: Exception, reason: str = "error") -> None:
    """Ends in-flight requests (and, when stopping, queued ones) so no caller waits forever."""
    queued = self.sched.drain() if reason == "cancelled" else []
    owner = self.sched.owner
    handles = {id(o[0]): o[0] for o in owner if o is not None}
    for slot, o in enumerate(owner):
      if o is not None:
        self.free(slot)
    for h in list(handles.values()) + queued:
      if not h.future.done():
        if reason == "cancelled":
          for s in h.samples:
            if s.finish_reason is None:
              s.finish_reason = "cancelled"
          self.complete(h)
        else:
          h.future.set_exception(err)
