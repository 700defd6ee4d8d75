"""The sampler's scheduler: the request queue, slot ownership, admission, expiry, shape buckets.

What: `Scheduler` decides which request runs in which KV-cache slot and with which shapes; the
engine thread (`rollout.engine`) makes the device calls and hands tokens back.
  * The queue holds requests waiting for slots as submissions: one `enqueue` call (one
    `Engine.submit` or `Engine.submit_batch`) is one submission, its requests in order.
    `enqueue` takes a batch all or nothing and bounds the queue by `max_queue` completions
    (`QueueFull`).
  * `owner[slot]` is the (request, sample) generating in that slot, or None. A request's n
    completions take n slots at once: they share one prefill.
  * Admission (`take_prefill_batch`) moves queued requests into the free slots, lowest first,
    for one prefill call: prompts of one length bucket, up to `max_prompts` of it, taken
    round-robin across submissions (below).
  * Expiry (`expired_queued`, `expired_slots`): requests cancelled or past their deadline.
  * Buckets: prompt length (`prompt_bucket`), prefill rows (`prefill_rows`, at most
    `max_prompts` per call), a decode call's batch and attended length (`decode_shape`) and
    whether calls return top logprobs (`top_n`) take few values, so a server compiles a
    fixed, small set of programs (`rollout.warmup` lists them). Deterministic mode fixes every
    shape, so a row's arithmetic never depends on what else is served.

Why `EngineConfig.shape_buckets` "coarse" by default: every shape is a compilation (seconds on
a CPU) that a server runs before it is ready, and the count is a product of the dimensions
(batch x attended length for decode; rows x prompt bucket x block-table width for prefills), so
the set is kept small where padding is cheap: a decode call's attended length is `length_bucket`
x a power of two (attention is one part of a step, and the batch, which the load sets, keeps
its powers of two), a prefill's rows are fixed per prompt bucket (`prefill_tokens`), block
tables are a power of four wide and every prefill is an extend when the prefix cache is on
(`rollout.prefix_reuse`), and the top-logprobs variant of every program is the only one (a
top-k over the vocabulary per sampled token). "fine" keeps the finer shapes of before, for
comparison and for a server that is started once and runs long (BENCHMARKS.md, "Shape
buckets").

Why round-robin across submissions: the unit of fairness is a submission, not a prompt. Taken in
arrival order, one submission of 4,000 prompts held every slot until all of them had run, and a
4-token request that came after it waited for all of them. Round-robin admits the head of each
waiting submission in turn, so a new submission is admitted within about one decode call of a
slot freeing, however much a big one still has queued. The submission whose turn it is is not
overtaken when its head needs more slots than are free (its n completions take n slots at once):
nothing is admitted until they are free, so a large-n request cannot be starved by small ones.
A burst of single-prompt submissions is still prefilled together (one prompt from each).

Why lowest-first: the active slots then form a prefix, and a decode call runs on the smallest
power-of-two batch covering them (`rollout.kv_cache`, `window`).

Threads: the queue is shared with the threads that submit and is guarded by `lock`, the engine's
condition (an RLock underneath, so these methods may be called with it held). Slot ownership is
the engine thread's alone.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from rollout.engine_types import EngineConfig, QueueFull, RequestHandle, Sample
from rollout.sampling import MAX_TOP_LOGPROBS


COARSE, FINE = "coarse", "fine"
SHAPE_BUCKETS = (COARSE, FINE)


def geometric_at_least(x: int, lo: int = 1, ratio: int = 2) -> int:
  """The smallest lo * ratio**i >= x."""
  b = lo
  while b < x:
    b *= ratio
  return b


def pow2_at_least(x: int, lo: int = 1) -> int:
  """The smallest lo * 2**i >= x."""
  return geometric_at_least(x, lo, 2)


def end_reason(h: RequestHandle, now: float) -> Optional[str]:
  """"cancelled", "timeout" (deadline passed at monotonic time `now`) or None."""
  if h.cancelled:
    return "cancelled"
  if h.deadline is not None and now >= h.deadline:
    return "timeout"
  return None


class Scheduler:
  """Queue, slot ownership, admission, expiry and shape buckets (see the module docstring)."""

  def __init__(self, config: EngineConfig, max_len: int, lock: threading.Condition,
               planner: Optional[Callable] = None):
    """`planner(handle) -> (tokens to prefill, key of its first uncached prefix block or None)`
    (`rollout.prefix_reuse.PrefixReuse.plan`) when prefix caching is on; None: every prompt is
    prefilled whole."""
    self.config = config
    self.planner = planner
    self.max_len = max_len
    self.lock = lock
    # The waiting submissions, each a deque of its requests, in turn order (the front's turn is
    # next); an emptied submission is dropped.
    self._groups: collections.deque = collections.deque()
    self.queued_completions = 0
    self.owner: list = [None] * config.max_slots  # (handle, sample) per slot

  # ------------------------------------------------------------------ queue
  @property
  def queue(self) -> list:
    """The waiting requests: each submission's in order, submissions in turn order."""
    with self.lock:
      return [h for g in self._groups for h in g]

  def queue_depth(self) -> int:
    """How many requests wait (a request of n completions counts once)."""
    with self.lock:
      return sum(len(g) for g in self._groups)

  def enqueue(self, handles: Sequence[RequestHandle]) -> None:
    """Queues `handles` as one submission, all in one step, or none (QueueFull: max_queue would
    be exceeded)."""
    need = sum(h.params.n for h in handles)
    with self.lock:
      if self.queued_completions + need > self.config.max_queue:
        raise QueueFull(f"queue full ({self.queued_completions} completions waiting)")
      if handles:
        self._groups.append(collections.deque(handles))
      self.queued_completions += need

  def drain(self) -> list:
    """Empties the queue; returns what it held."""
    with self.lock:
      queued = [h for g in self._groups for h in g]
      self._groups.clear()
      self.queued_completions = 0
    return queued

  def has_work(self) -> bool:
    """Whether anything is queued or running."""
    with self.lock:
      return bool(self._groups) or self.has_running()

  def expired_queued(self, now: float) -> list:
    """Removes cancelled and timed-out requests from the queue: [(handle, reason)]."""
    ended = []
    with self.lock:
      groups = collections.deque()
      for g in self._groups:
        keep = collections.deque()
        for h in g:
          r = end_reason(h, now)
          if r is None:
            keep.append(h)
          else:
            ended.append((h, r))
            self.queued_completions -= h.params.n
        if keep:
          groups.append(keep)
      self._groups = groups
    return ended

  # ------------------------------------------------------------------ slots
  def owned_slots(self) -> list:
    return [i for i, o in enumerate(self.owner) if o is not None]

  def has_running(self) -> bool:
    return any(o is not None for o in self.owner)

  def num_running(self) -> int:
    return int(sum(o is not None for o in self.owner))

  def assign(self, slot: int, h: RequestHandle, s: Sample) -> None:
    self.owner[slot] = (h, s)

  def release(self, slot: int) -> None:
    self.owner[slot] = None

  def expired_slots(self, now: float) -> list:
    """Running slots whose request was cancelled or timed out: [(slot, reason)]."""
    out = []
    for slot, o in enumerate(self.owner):
      if o is None:
        continue
      r = end_reason(o[0], now)
      if r is not None:
        out.append((slot, r))
    return out

  # ------------------------------------------------------------------ admission and shapes
  def take_prefill_batch(self) -> tuple:
    """Takes the queued requests for one prefill call and the free slots they will own.

    Round-robin over the waiting submissions in turn order: each pass takes the head of every
    submission whose prompt is in the call's length bucket (the first one taken sets it) and
    whose n completions all get a free slot (lowest first); passes repeat until `max_prompts`
    of the bucket are taken or a pass takes none. If the submission whose turn it is does not
    fit, the call takes nothing (see the module docstring). Submissions taken from move to the
    back of the turn order, in the order last taken; the others keep their places ahead of
    them.

    With a `planner` (prefix caching), the bucket is that of the tokens left to prefill after
    the cached prefix, and a request whose first uncached block is also the first uncached
    block of a request already taken waits for the next call: that one then finds the block
    cached instead of computing it a second time.

    Returns:
      ([(handle, [slot] * n)], length bucket), or ([], None) when nothing fits.
    """
    ec = self.config
    free = [i for i, o in enumerate(self.owner) if o is None]
    if not free:
      return [], None
    batch, used, bucket = [], 0, None
    with self.lock:
      order = list(self._groups)
      last_taken = {}  # id(group) -> when it was last taken from
      computing = set()  # first uncached prefix blocks of the requests taken
      took = True
      cap = ec.prefill_rows  # then max_prompts of the call's bucket, once the first is taken
      while took and len(batch) < cap:
        took = False
        for g in order:
          if not g or len(batch) >= cap:
            continue
          h = g[0]
          todo, key = self.planner(h) if self.planner else (len(h.prompt), None)
          lb = self.prompt_bucket(todo)
          if h.params.n > len(free) - used:
            if not batch:  # the submission whose turn it is waits for slots: nobody overtakes
              return [], None
            continue
          if bucket is not None and lb != bucket:
            continue
          if key is not None and key in computing:
            continue
          if key is not None:
            computing.add(key)
          g.popleft()
          self.queued_completions -= h.params.n
          bucket = lb
          cap = self.max_prompts(lb)
          batch.append((h, free[used:used + h.params.n]))
          used += h.params.n
          last_taken[id(g)] = len(batch)
          took = True
      waiting = [g for g in order if id(g) not in last_taken]
      served = sorted((g for g in order if id(g) in last_taken), key=lambda g: last_taken[id(g)])
      self._groups = collections.deque(g for g in waiting + served if g)
    return batch, bucket

  def prompt_bucket(self, n: int) -> int:
    """Padded prompt length for an n-token prompt: a power of two from min_prefill_len."""
    return min(pow2_at_least(n, self.config.min_prefill_len), self.max_len)

  def max_prompts(self, length: int) -> int:
    """Most prompts of one prefill call in prompt bucket `length`: `prefill_rows`, or with
    "coarse" shapes (not deterministic) as many as `prefill_tokens` positions hold (at least 1)."""
    ec = self.config
    if ec.deterministic or ec.shape_buckets == FINE:
      return ec.prefill_rows
    return min(ec.prefill_rows, max(1, ec.prefill_tokens // length))

  def prefill_rows(self, prompts: int, length: int) -> int:
    """Rows of a prefill call for `prompts` prompts of bucket `length`: `prefill_rows` when
    deterministic, `max_prompts(length)` with "coarse" shapes, else the power of two covering
    them."""
    ec = self.config
    if ec.deterministic:
      rows = ec.prefill_rows
    elif ec.shape_buckets == FINE:
      rows = pow2_at_least(prompts)
    else:
      rows = self.max_prompts(length)
    return max(rows, prompts)

  def decode_shape(self, owned: Sequence[int], pos: np.ndarray) -> tuple:
    """(batch rows, attended cache length) of a decode call over the `owned` slots.

    The batch is the power of two covering the highest owned slot; the length covers the
    furthest position plus `decode_steps`, rounded up to `length_bucket` x a power of two
    ("coarse") or to a multiple of `length_bucket` ("fine"), at most the cache. Deterministic
    mode always uses every slot and the whole cache.
    """
    ec = self.config
    if ec.deterministic:
      return ec.max_slots, self.max_len
    nb = min(pow2_at_least(max(owned) + 1), ec.max_slots)
    need = int(pos[owned].max()) + ec.decode_steps
    if ec.shape_buckets == FINE:
      sv = -(-need // ec.length_bucket) * ec.length_bucket
    else:
      sv = pow2_at_least(need, ec.length_bucket)
    return nb, min(sv, self.max_len)

  def top_n(self, wanted: bool) -> int:
    """Top logprobs a device call returns per token when a request in it `wanted` them (or
    not): always `MAX_TOP_LOGPROBS` with "coarse" shapes (one program serves both)."""
    return MAX_TOP_LOGPROBS if wanted or self.config.shape_buckets == COARSE else 0
