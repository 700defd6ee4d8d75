"""The sampling engine: continuous batching over fixed KV-cache slots, weight swaps in place.

The engine is the serving thread, the weight swaps and the API; what runs where and with which
shapes is `rollout.scheduler`'s, its device state and calls (weights, KV cache, prefix store, on
one device or sharded over a mesh) are `rollout.model_runner`'s, the per-slot tables they read
are `rollout.slot_tables`, handing tokens to requests and ending them is
`rollout.request_flow`, and turning tokens into results (stop strings, streams, Completions) is
`rollout.outputs`.

What:
  * `Engine(model, config=EngineConfig(...))` serves a `MoEDecoder` (or `Engine.from_flat`);
    `mesh=` shards it over a mesh (tensor and expert parallel, `rollout.placement`), `device=`
    puts it on one chosen device (a replica's, `rollout.replicas`).
  * `engine.generate(prompt_token_ids, *, n, max_tokens, temperature, stop_token_ids, seed, ...)`
    -> list[Completion] (blocking, in-process entry point for the environments harness). A
    completion ended by a stop string keeps, in `token_ids`, every token up to and including the
    one that completes it; its `text` stops before it (`rollout.outputs.find_stop`).
  * `engine.submit(prompt_token_ids, SamplingParams(...)) -> RequestHandle` (non-blocking; the
    handle has `.result()`, `.future` for asyncio, `.cancel()`, and an optional per-chunk
    `on_tokens` callback for streaming) and `engine.submit_batch` for the RL controller.
  * `engine.swap_weights(flat, version)` / `swap_delta(blob, version)` replace the weights while
    serving; in-flight requests continue with their KV caches and record the version per token.
  * `engine.warm_up(progress)` compiles every device program a request can reach
    (`rollout.warmup`), so that no request waits for a compilation.

Design (see rollout/README.md for the measurements behind it):
  * Slot KV cache, not paged (`rollout.kv_cache`): allocated once, max_slots rows. A request's n
    completions each take a slot and share one prefill (its KV is copied into the n slots).
  * One background thread owns the device state; it admits queued requests (prefill), runs
    `decode_steps`-step chunks, and hands tokens back. All other threads only enqueue.
  * Failures stay with the request that caused them: a request whose values do not fit the slot
    tables, whose prefill fails (a batch is retried one request at a time), or whose tokens fail
    on the host fails alone. Only a failed decode call fails every request in flight: it cannot
    be attributed, and request checks keep client input from causing one.
  * Deterministic mode fixes every shape (all slots, full cache length, dropless experts, fixed
    prefill rows), so a request's arithmetic never depends on what else is being served.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from moe import params as moe_params
from moe.config import ModelConfig
from rollout import delta_swap
from rollout import forward
from rollout import model_runner
from rollout import placement as placement_lib
from rollout import request_checks
from rollout import request_flow
from rollout import scheduler
from rollout import slot_tables
from rollout import warmup
from rollout import weight_checks
from rollout.engine_types import (Completion, EngineConfig, EngineStopped, PreparedWeights,
                                  QueueFull, RequestHandle)
from rollout.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStopped", "PreparedWeights",
           "QueueFull", "RequestHandle", "SamplingParams"]

log = logging.getLogger(__name__)


class Engine:
  """Continuous-batching sampler (see the module docstring).

  Args (of both constructors):
    config: serving settings.
    tokenizer: for stop strings and completion text (None: token ids only).
    version: the policy version of the first weights.
    start: start the serving loop now.
    mesh: a mesh of moe.sharding's axes to shard the model over (`rollout.placement`: tensor
      and expert parallel; data and fsdp must be 1).
    device: one device to run on. Neither: the default device.
  """

  def __init__(self, model, *, config: EngineConfig = EngineConfig(), tokenizer=None,
               version: int = 0, start: bool = True, mesh=None, device=None):
    self._init(model.config, moe_params.flatten(model), config, tokenizer, version, start,
               placement_lib.Placement(model.config, mesh=mesh, device=device))

  @classmethod
  def from_flat(cls, flat: Mapping[str, np.ndarray], cfg: ModelConfig, *,
                config: EngineConfig = EngineConfig(), tokenizer=None, version: int = 0,
                start: bool = True, mesh=None, device=None) -> "Engine":
    self = cls.__new__(cls)
    self._init(cfg, dict(flat), config, tokenizer, version, start,
               placement_lib.Placement(cfg, mesh=mesh, device=device))
    return self

  # ------------------------------------------------------------------ setup
  def _init(self, cfg: ModelConfig, flat, config: EngineConfig, tokenizer, version, start,
            placement: placement_lib.Placement):
    ec = config
    max_len = ec.max_len or cfg.max_seq_len
    for name, v in (("max_slots", ec.max_slots), ("decode_steps", ec.decode_steps),
                    ("prefill_rows", ec.prefill_rows), ("max_len", max_len),
                    ("length_bucket", ec.length_bucket), ("max_queue", ec.max_queue),
                    ("prefix_block_size", ec.prefix_block_size),
                    ("prefill_tokens", ec.prefill_tokens)):
      if v < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {v}")
    if ec.shape_buckets not in scheduler.SHAPE_BUCKETS:
      raise ValueError(f"EngineConfig.shape_buckets must be one of {scheduler.SHAPE_BUCKETS}, "
                       f"got {ec.shape_buckets!r}")
    blocks = ec.prefix_cache_blocks
    if blocks is None:
      blocks = ec.max_slots * max_len // ec.prefix_block_size
    if blocks < 0:
      raise ValueError(f"EngineConfig.prefix_cache_blocks must be >= 0 (0 is off), got {blocks}")
    for t in ec.eos_token_ids:
      if not 0 <= t < cfg.vocab_size:
        raise ValueError(f"eos token id {t} is outside the vocabulary ({cfg.vocab_size})")
    self.model_config = cfg
    self.config = ec
    self.max_len = max_len
    self.tokenizer = tokenizer
    self._flat = flat
    self._flat_rms = None  # weight_checks.rms of _flat, measured once when a swap needs it
    self._runner = model_runner.ModelRunner(cfg, ec, max_len, flat, placement, blocks)
    self.version = version
    self._prefix = self._runner.prefix
    self._slots = slot_tables.new_tables(ec.max_slots, ec.max_stop_ids)
    self._cv_lock = threading.Condition()
    self._sched = scheduler.Scheduler(ec, max_len, self._cv_lock,
                                      planner=self._prefix.plan if self._prefix else None)
    self.stats = collections.Counter()
    self._flow = request_flow.RequestFlow(cfg, self._sched, self._slots, self.stats,
                                          self._prefix, tokenizer)
    self._pending_swap = None
    self._swap_followup = None  # (result, event) of a swap whose first decode call is pending
    self._recent_calls: collections.deque = collections.deque(maxlen=4)  # (shape key, seconds)
    self._stopping = False
    self._thread: Optional[threading.Thread] = None
    self._rng = np.random.default_rng()
    self._tok_window: collections.deque = collections.deque()  # (time, tokens)
    self._delta_swapper = delta_swap.DeltaSwapper(self)
    self.last_swap: dict = {}
    if start:
      self.start()

  def start(self) -> None:
    if self._thread is not None:
      return
    self._stopping = False
    self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
    self._thread.start()

  @property
  def running(self) -> bool:
    """Whether the serving loop runs (requests are accepted)."""
    return self._thread is not None and not self._stopping

  @property
  def placement(self) -> placement_lib.Placement:
    """Where the engine's arrays live (its devices, its mesh)."""
    return self._runner.placement

  def load(self) -> int:
    """Completions queued or running: how busy the engine is, for spreading requests over
    replicas (`rollout.replicas`)."""
    with self._cv_lock:
      return self._sched.queued_completions + self._sched.num_running()

  def cached_prefix_tokens(self, prompt_token_ids: Sequence[int],
                           keys: Optional[list] = None) -> int:
    """Prompt tokens a request would take from the prefix cache now (`PrefixReuse.
    cached_tokens`; 0 without prefix caching): where a conversation's next turn goes among
    replicas (`rollout.replicas`)."""
    if self._prefix is None:
      return 0
    return self._prefix.cached_tokens(list(prompt_token_ids), keys)

  def stop(self) -> None:
    """Stops the loop; waiting and running requests finish as "cancelled"."""
    with self._cv_lock:
      self._stopping = True
      self._cv_lock.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  # ------------------------------------------------------------------ public API
  def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(), *,
             timeout: Optional[float] = None,
             on_tokens: Optional[Callable] = None) -> RequestHandle:
    """Queues a request and returns at once.

    Args:
      prompt_token_ids: the prompt (1 <= length, ids in the vocabulary).
      params: sampling settings.
      timeout: seconds (> 0; None or inf: none) until the request is ended with finish_reason
        "timeout", queued or running. The engine thread checks between device calls, so the
        answer comes at most one prefill or decode call after the deadline.
      on_tokens: called from the engine thread after each decode call as
        on_tokens(handle, sample_index, token_ids, logprobs) with the new tokens.

    Raises:
      ValueError: bad prompt, settings or timeout (a clear message; nothing is queued).
      QueueFull: the queue holds max_queue completions already.
      EngineStopped: the engine is not running.

    A request the engine cannot run (a fault of the engine, logged) fails alone: its future
    raises, and other requests are unaffected. Only a failed decode call, which cannot be
    attributed to one request, fails every request in flight (see `_loop`).
    """
    handle = self._make_handle(prompt_token_ids, params, timeout, on_tokens)
    self._enqueue([handle])
    return handle

  def submit_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
                   *, timeout: Optional[float] = None,
                   on_tokens: Optional[Callable] = None) -> list:
    """Submits several prompts with the same settings; returns their handles in order.

    All or nothing: every prompt is checked first, and the batch is queued in one step (so the
    engine prefills it together) or not at all (ValueError / QueueFull / EngineStopped).

    The batch is one submission for the scheduler's fairness (`rollout.scheduler`): waiting
    submissions are admitted round-robin, so a large batch cannot hold every slot while a later,
    small submission waits for all of it.
    """
    handles = [self._make_handle(p, params, timeout, on_tokens) for p in prompts]
    self._enqueue(handles)
    return handles

  def _make_handle(self, prompt_token_ids, params: SamplingParams, timeout, on_tokens):
    """Validates one request (ValueError with a clear message) and builds its handle."""
    prompt, stop_ids = request_checks.check_request(
        prompt_token_ids, params, self.model_config, self.config, self.max_len, self.tokenizer)
    timeout = request_checks.check_timeout(timeout)
    if params.seed is None:
      params = dataclasses.replace(params, seed=int(self._rng.integers(0, 2**32)))
    deadline = None if timeout is None else time.monotonic() + timeout
    return RequestHandle(prompt, params, stop_ids, deadline, on_tokens)

  def _enqueue(self, handles: list) -> None:
    with self._cv_lock:
      if self._thread is None or self._stopping:
        raise EngineStopped("the engine is not running")
      try:
        self._sched.enqueue(handles)
      except QueueFull:
        self.stats["rejected_total"] += len(handles)
        raise
      self.stats["requests_total"] += len(handles)
      self._cv_lock.notify_all()

  def generate(self, prompt_token_ids: Sequence[int], *, n: int = 1, max_tokens: int = 16,
               temperature: float = 1.0, stop_token_ids: Sequence[int] = (),
               seed: Optional[int] = None, top_p: float = 1.0, top_k: int = 0,
               stop: Sequence[str] = (), ignore_eos: bool = False,
               timeout: Optional[float] = None) -> list:
    """Blocking generation: list of n `Completion`s for one prompt."""
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, stop_token_ids=tuple(int(t) for t in stop_token_ids),
                            stop=tuple(stop), seed=seed, ignore_eos=ignore_eos)
    return self.submit(prompt_token_ids, params, timeout=timeout).result()

  def prepare_weights(self, flat: Mapping[str, np.ndarray], *,
                      reference_rms: Optional[Mapping[str, float]] = None,
                      checked_rms: Optional[Mapping[str, float]] = None) -> "PreparedWeights":
    """Validates, checks and packs weights for a later `swap_weights` (no effect on serving).

    Every swap path comes through here, so bad weights are refused before anything changes:
    names and shapes must match the served model, and `rollout.weight_checks` refuses
    non-finite values and tensors whose RMS is off the served one's by more than 100x.
    `reference_rms` ({name: RMS}) replaces the served weights as the scale reference (a delta
    swap measures the held arrays before writing into them). `checked_rms`: `flat` passed the
    checks already and these are its figures (a replica set checks once for all its engines,
    `rollout.replicas`); only names and shapes are checked again, while packing.

    Raises:
      ValueError: naming the tensor and what is wrong with it.
    """
    t0 = time.perf_counter()
    flat = dict(flat)
    new_rms = checked_rms
    if new_rms is None:
      if reference_rms is None:
        reference_rms = self.served_rms()
      new_rms = weight_checks.check(flat, self.model_config, reference_rms)
    packed = self._runner.pack(flat)
    return PreparedWeights(packed, flat, time.perf_counter() - t0, dict(new_rms))

  def served_rms(self) -> dict:
    """{name: RMS} of the served weights (`rollout.weight_checks.rms`): the scale reference of
    the next swap's checks. Measured once per version: a swap keeps the figures its own check
    computed for the new weights, so no swap measures the same weights twice."""
    with self._cv_lock:
      flat, cached = self._flat, self._flat_rms
    if cached is not None and cached[0] is flat:
      return cached[1]
    out = weight_checks.rms(flat)
    with self._cv_lock:
      if self._flat is flat:
        self._flat_rms = (flat, out)
    return out

  def swap_weights(self, flat, version: int, timeout: Optional[float] = None, *,
                   wait_first_call: bool = False) -> dict:
    """Replaces the weights while serving; returns timings.

    `flat` is a flat weight dict (validated and packed here, in the calling thread, while
    decoding continues) or the result of `prepare_weights`. The serving loop then swaps the
    packed weights in between two decode calls. In-flight requests keep their KV caches
    (computed by the old weights) and record `version` for tokens produced afterwards.

    The pause alone understates what a swap costs the serving loop: the old weights are freed
    while the first decode call with the new ones runs (so that the free overlaps its compute),
    and that call may be slower than a steady one. Those figures exist only once that call has
    finished; `wait_first_call=True` waits for it (one decode call longer) and returns them, and
    `last_swap` gets them in either case.

    Returns:
      {"version", "prepare_s" (validate + pack), "pause_s" (how long the decode loop stood
       still for the swap, from the end of its last call with the old weights to the swap
       being in place; 0 if nothing was in flight), "in_flight" (completions running),
       "total_s" (call to applied, including waiting for the decode call in progress)}, and
      with wait_first_call, when a decode call followed the swap: "free_s" (the engine thread's
      time releasing the old weights, inside the first call), "first_call_s" (that call,
      dispatch to tokens on the host, free included), "steady_call_s" (median of the last
      calls before the swap with the same shapes, or None if there were none),
      "decode_steps" (steps per call).

    Raises:
      ValueError: names or shapes do not match the served model (nothing changes).
      TimeoutError: not applied (or, with wait_first_call, its first call not done) in time.
    """
    t0 = time.perf_counter()
    prepared = flat if isinstance(flat, PreparedWeights) else self.prepare_weights(flat)
    done, first_done = threading.Event(), threading.Event()
    result = {"version": int(version), "prepare_s": prepared.prepare_s}
    with self._cv_lock:
      if self._thread is None or self._stopping:
        raise EngineStopped("the engine is not running")
      self._pending_swap = (prepared.params, prepared.flat, prepared.rms, int(version), done,
                            result, first_done)
      self._cv_lock.notify_all()
    if not done.wait(timeout):
      raise TimeoutError("weight swap was not applied in time")
    total_s = time.perf_counter() - t0
    if wait_first_call:
      left = None if timeout is None else max(0.0, timeout - total_s)
      if not first_done.wait(left):
        raise TimeoutError("the first decode call after the weight swap did not finish in time")
    with self._cv_lock:  # the engine thread adds the first call's figures under this lock
      result["total_s"] = total_s
      out = dict(result)
      if self.last_swap.get("version") == out["version"]:
        self.last_swap = {**self.last_swap, **out}
    return out

  def swap_delta(self, blob: bytes, version: int) -> dict:
    """Applies a `sync.delta` blob to the served weights in place, then swaps the result in.

    Only the changed elements are written, into host arrays the engine owns (copied once from
    weights that came from elsewhere, so a caller's arrays are never written); the delta must
    be for the served version. All or nothing: a damaged blob, one for another parent, or one
    that would not fit the model raises before anything changes, and a failed swap reverses
    the apply (rollout.delta_swap). `current_flat()` then returns the held arrays, which the
    next delta swap updates in place (copy them to keep a version).

    Returns:
      `swap_weights`' timings plus "decode_s" (copy on first use, digest, apply in place;
      packing is "prepare_s").
    """
    return self._delta_swapper.swap(blob, version)

  def programs(self) -> list:
    """The device programs (`warmup.Program`s) a request can make this engine run, smallest
    first: what `warm_up` compiles."""
    return warmup.programs(self.config, self.max_len, self._sched, self._prefix)

  def warm_up(self, progress: Optional[Callable[[int, int, str], None]] = None, *,
              threads: int = 1, stop: Optional[threading.Event] = None) -> dict:
    """Compiles every device program a request can make this engine run (`rollout.warmup`),
    so that no request waits for a compilation.

    Args:
      progress: `progress(done, total, what)`, first with done 0, then after each program.
      threads: programs compiled at once.
      stop: set to end early, once the compilations under way finish.

    Safe beside serving: it compiles from shapes alone, so the KV cache, the prefix cache, the
    random streams and the counters stay as they were. Returns `warmup.compile_all`'s counts.
    """
    progs = self.programs()
    args = self._runner.warmup_args(self._slots)
    context = self._runner.placement.context

    def compile_one(p: warmup.Program) -> None:
      with context():  # each compiling thread traces under the engine's mesh
        warmup.compile_program(p, cfg=self.model_config, config=self.config, args=args)
    return warmup.compile_all(progs, compile_one, progress, threads, stop)

  def current_flat(self) -> dict:
    """The flat weights being served (numpy; do not modify)."""
    return self._flat

  def metrics(self) -> dict:
    """A snapshot of counters and gauges for /metrics."""
    now = time.monotonic()
    with self._cv_lock:
      while self._tok_window and self._tok_window[0][0] < now - 10.0:
        self._tok_window.popleft()
      recent = sum(n for _, n in self._tok_window)
      active = self._sched.num_running()
      return {**self.stats,
              "queue_depth": self._sched.queue_depth(),
              "queued_completions": self._sched.queued_completions,
              "active_slots": active, "max_slots": self.config.max_slots,
              "batch_occupancy": active / self.config.max_slots,
              "tokens_per_second": recent / 10.0,
              "policy_version": self.version,
              "last_swap_pause_seconds": self.last_swap.get("pause_s", 0.0),
              "swap_pending": int(self._pending_swap is not None),
              **(self._prefix.metrics() if self._prefix is not None else {})}

  # ------------------------------------------------------------------ serving loop
  def _loop(self) -> None:
    last_chunk_end = None
    while True:
      with self._cv_lock:
        if self._stopping:
          break
        swap = self._pending_swap
        self._pending_swap = None
        has_work = self._sched.has_work()
        if swap is None and not has_work:
          self._cv_lock.wait(self.config.idle_wait_s)
          continue
      try:
        if swap is not None:
          self._apply_swap(swap, last_chunk_end)
        self._flow.expire()
        # Prefill first: fill every free slot before the next decode call, so a burst of
        # requests decodes as one batch instead of ramping up one prefill call per chunk.
        while self._admit():
          self._flow.expire()  # each prefill call takes time: end what timed out meanwhile
        if self._sched.has_running():
          self._decode()
        if self._swap_followup is not None and swap is not None:
          self._end_followup({})  # no decode call followed the swap (its requests ended)
        # A swap's pause is measured from the end of the last decode call only while requests
        # are in flight; an idle loop is not paused.
        busy = self._sched.has_running()
        last_chunk_end = time.perf_counter() if busy else None
      except Exception as e:
        # Failures that can be attributed to a request fail that request alone (`_prefill`,
        # `_decode`'s host side). What reaches here cannot be: a failed decode call runs every
        # slot at once, and may have consumed the donated cache. Request checks keep client input
        # from causing one, so this is an engine fault; fail what is in flight (no caller hangs),
        # start from a fresh cache and keep serving what is queued.
        log.exception("engine loop error")
        if self._swap_followup is not None:
          self._end_followup({})
        self._flow.fail_all(e)
        self._runner.alloc_cache()  # a failed call may have consumed the donated cache buffers
    if self._swap_followup is not None:
      self._end_followup({})
    self._flow.fail_all(EngineStopped("the engine stopped"), reason="cancelled")

  def _apply_swap(self, swap, last_chunk_end) -> None:
    new_params, flat, rms, version, done, result, first_done = swap
    if self._swap_followup is not None:  # two swaps without a decode call between them
      self._end_followup({})
    # Freeing the old weights (GBs) takes long; keep them until the next device call is queued,
    # so that the free overlaps with its compute instead of pausing decoding.
    self._runner.swap_params(new_params, self._flat)
    with self._cv_lock:
      self._flat = flat
      self._flat_rms = None if rms is None else (flat, rms)
    self.version = version
    self.stats["swaps_total"] += 1
    if self._prefix is not None:  # cached KV is the old weights': never reused after this
      self._prefix.invalidate()
    # The decode loop stood still from the end of its last call until the next call starts; that
    # next call starts right after this returns, so measure to here (plus a negligible return).
    pause = 0.0 if last_chunk_end is None else time.perf_counter() - last_chunk_end
    with self._cv_lock:
      result["pause_s"] = pause
      result["in_flight"] = self._sched.num_running()
      self.last_swap = dict(result)
    self._swap_followup = (result, first_done)
    done.set()

  def _end_followup(self, figures: dict) -> None:
    """Adds the first post-swap decode call's figures to its swap's result and wakes waiters."""
    result, first_done = self._swap_followup
    self._swap_followup = None
    with self._cv_lock:
      result.update(figures)
      if self.last_swap.get("version") == result["version"]:
        self.last_swap = {**self.last_swap, **figures}
    first_done.set()

  def _admit(self) -> bool:
    """Prefills the queued requests that fit free slots (one prompt length bucket).

    Returns whether anything was admitted (the loop calls it until nothing more fits).
    """
    self._runner.flush_prefix()  # the scheduler plans with the prefix index: make it current
    batch, bucket = self._sched.take_prefill_batch()
    if batch:
      try:
        self._prefill(batch, bucket)
      except Exception as e:  # they left the queue: answer them before the loop's handler
        for h, _ in batch:
          if not h.future.done():
            self._flow.fail_request(h, e)
        raise
    return bool(batch)

  def _prefill(self, batch, length: int) -> None:
    """Prefills `batch` = [(handle, its slots)] and seeds their slots; failures stay per request.

    A request whose values do not fit the slot tables fails alone, before the call. If the call
    fails for several requests, each is retried alone, so only the one that fails again fails;
    if the call consumed the cache, the running requests lost their KV and fail too.
    """
    ec, flow = self.config, self._flow
    staged = []
    for h, slots in batch:
      try:
        found = self._prefix.lookup(h) if self._prefix is not None else []
        v = slot_tables.stage(h, vocab_size=self.model_config.vocab_size,
                              max_stop_ids=ec.max_stop_ids, length=length,
                              start=len(found) * ec.prefix_block_size)
        v["blocks"] = [b.block_id for b in found]
        v["cached_routing"] = (np.concatenate([b.routing for b in found], axis=1)
                               if found and self.model_config.num_moe_layers else None)
        staged.append((h, slots, v))
      except Exception as e:
        flow.fail_request(h, e)
    if not staged:
      return
    try:
      out = self._prefill_call(staged, length)
    except Exception as e:
      if not self._runner.cache_alive():
        log.exception("prefill call failed and consumed the KV cache")
        flow.fail_all(e)
        for h, _, _ in staged:
          flow.fail_request(h, e)
        self._runner.alloc_cache()
        return
      if len(staged) == 1:
        flow.fail_request(staged[0][0], e)
        return
      log.warning("prefill of %d requests failed (%r); retrying one by one", len(staged), e)
      for h, slots, _ in staged:
        self._prefill([(h, slots)], length)
      return
    flow.seed_slots(staged, out, self.version)

  def _prefill_call(self, staged: list, length: int) -> tuple:
    """One prefill device call for `staged` requests; its outputs on the host."""
    ec, cfg = self.config, self.model_config
    rows = self._sched.prefill_rows(len(staged), length)
    caps = forward.capacity_tiers(rows * length, cfg, ec.capacity_factors, ec.deterministic)
    top_n = self._sched.top_n(any(h.params.logprobs for h, _, _ in staged))
    t0 = time.perf_counter()
    out, prompt_tokens = self._runner.prefill(staged, rows, length, caps, top_n)
    self.stats["prefill_calls_total"] += 1
    self.stats["prefill_seconds_total"] += time.perf_counter() - t0
    self.stats["prompt_tokens_total"] += prompt_tokens
    return out

  def _decode(self) -> None:
    """One decode call over the running slots; its tokens go to their requests."""
    ec, cfg = self.config, self.model_config
    st = self._slots
    owner = self._sched.owner
    owned = self._sched.owned_slots()
    nb, sv = self._sched.decode_shape(owned, st["pos"])
    caps = forward.capacity_tiers(nb, cfg, ec.capacity_factors, ec.deterministic)
    top_n = self._sched.top_n(any(owner[i][0].params.logprobs for i in owned))
    version = self.version
    self._runner.flush_prefix()  # the call writes every slot: copy queued blocks out first
    t0 = time.perf_counter()
    carried, outs, free_s = self._runner.decode(st, nb=nb, sv=sv, caps=caps, top_n=top_n)
    call_s = time.perf_counter() - t0
    self.stats["decode_seconds_total"] += call_s
    key = (nb, sv, ec.decode_steps, caps, top_n)
    if self._swap_followup is not None:
      same = [s for k, s in self._recent_calls if k == key]
      self._end_followup({"free_s": free_s, "first_call_s": call_s,
                          "steady_call_s": float(np.median(same)) if same else None,
                          "decode_steps": ec.decode_steps})
      self._recent_calls.clear()  # calls before the swap are no reference for the next one
    else:
      self._recent_calls.append((key, call_s))
    for k, v in carried.items():
      st[k][:nb] = v
    n_new = int(outs["valid"].sum())
    self.stats["decode_calls_total"] += 1
    self.stats["generated_tokens_total"] += n_new
    with self._cv_lock:
      self._tok_window.append((time.monotonic(), n_new))
    self._flow.take_decode(owned, outs, version)
