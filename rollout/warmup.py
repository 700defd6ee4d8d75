"""Warm-up: compiles, before the first request, every device program a request can make the
engine run, so that no request waits for XLA.

What:
  * `programs(config, max_len, sched, prefix)`: the `Program`s (kind and static shapes) that
    requests can reach under the engine's settings, derived from the scheduler's own bucket
    functions (`rollout.scheduler`) and the prefix cache's (`rollout.prefix_reuse`):
      - "prefill": `device_programs.prefill_into_slots`, (prompt rows, prompt-length bucket),
        when there is no prefix cache, or with "fine" shapes (`EngineConfig.shape_buckets`)
        for calls in which nothing is cached;
      - "extend": `prefix_programs.extend_into_slots`, (rows, bucket of the tokens after the
        cached prefix) x (block-table width), for the pairs a prompt that fits the context can
        reach;
      - "decode": `device_programs.decode_chunk`, (batch bucket) x (attended-length bucket);
      - "copy": `prefix_programs.save_blocks`, one per padded count of blocks copied at once;
    each but "copy" at every `top_n` the scheduler picks: `MAX_TOP_LOGPROBS` only with
    "coarse" shapes, 0 and `MAX_TOP_LOGPROBS` with "fine" ones (a request asking for
    alternatives makes its calls return that many, a static shape).
  * `compile_program(program, ...)`: lowers and compiles one of them ahead of time
    (`jax.jit(f).lower(shapes).compile()`).
  * `compile_all(programs, compile_one, progress, threads, stop)`: compiles a list, several at
    a time, calls `progress(done, total, what)` after each, and returns counts and seconds.
  * `CompileCounter`: XLA compilations and persistent-cache requests and hits in a span of time
    (`jax.monitoring` events), for warm-up's summary, `//tools:rl_part`'s last line and tests
    that prove nothing compiles.

Why ahead of time, from shapes: lowering from `jax.ShapeDtypeStruct`s reads no buffer and runs
nothing, so warm-up can run beside a serving engine and changes nothing a request sees (KV cache,
prefix store, random streams, counters). jit keeps what it lowered and compiled, so the engine's
first call of a warmed shape finds the executable: no compilation, and the same executable a
cold engine would have built (warmup_test checks both). With JAX's persistent compilation cache
on (`//tools:serve` turns it on), a restart loads these executables instead of compiling them.

Why every reachable shape rather than the common ones: which shapes a server sees depends on
its clients, and a missed one stalls a user for a compilation (seconds on the CPU) at the
moment it is first used. So the count is the server's start-up time on a cold compilation
cache, and the scheduler keeps it small by default ("coarse" shapes): it grows with
log2(max_slots) x log2(max_len / length_bucket) for decode and with the prompt buckets x
log4 of the block-table widths for prefix-cache extends -- 60 programs for tiny.gin at
serve.gin's 64 slots and 512 positions, 92 at 2,048 ("fine" shapes: 449 and 1,027;
BENCHMARKS.md, "Shape buckets"). Deterministic mode has a handful (every shape fixed). The
server logs the count (`Engine.warm_up`'s progress).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from moe.config import ModelConfig
from rollout import device_programs
from rollout import forward
from rollout import prefix_programs
from rollout import prefix_reuse
from rollout import scheduler as scheduler_lib
from rollout import slot_tables
from rollout.engine_types import EngineConfig
from rollout.sampling import MAX_TOP_LOGPROBS

# jax.monitoring events: one BACKEND_COMPILE per executable built or loaded from the persistent
# cache (an executable jit already holds records none); CACHE_REQUEST per compilation that
# consulted the persistent cache (none while it is off); CACHE_HIT per load from it.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

KINDS = ("prefill", "extend", "decode", "copy")
# The per-slot sampling arguments of a prefill call, in the device programs' order.
_PREFILL_ARGS = ("tokens", "lengths", "dst", "src", "temp", "top_k", "top_p", "seed", "sample")


@dataclasses.dataclass(frozen=True)
class Program:
  """One device program at one static shape.

  Attributes:
    kind: one of KINDS.
    rows: prompt rows (prefill, extend), batch rows (decode) or blocks per copy call (copy).
    length: prompt-length bucket (prefill, extend: the tokens after the cached prefix) or
      attended cache length (decode); 0 for copy.
    blocks: block-table width (extend), else 0.
    top_n: top logprobs returned per token (0 or MAX_TOP_LOGPROBS).
  """
  kind: str
  rows: int
  length: int = 0
  blocks: int = 0
  top_n: int = 0

  def describe(self) -> str:
    top = ", top logprobs" if self.top_n else ""
    if self.kind == "prefill":
      return f"prefill {self.rows} x {self.length} tokens{top}"
    if self.kind == "extend":
      return (f"prefill after a cached prefix {self.rows} x {self.length} tokens, "
              f"{self.blocks} cached blocks{top}")
    if self.kind == "decode":
      return f"decode {self.rows} slots x {self.length} positions{top}"
    return f"prefix-cache copy of {self.rows} blocks"

  def work(self, block_size: int) -> int:
    """Positions the program touches per row batch, to order compilation small first."""
    if self.kind == "extend":
      return self.rows * (self.length + self.blocks * block_size)
    if self.kind == "copy":
      return self.rows * block_size
    return self.rows * self.length


def _first_of_each(values: Sequence[int], fn: Callable[[int], int]) -> dict:
  """{fn(v): the first v (in order) that maps to it} over `values`."""
  out = {}
  for v in values:
    out.setdefault(fn(v), v)
  return out


def programs(config: EngineConfig, max_len: int, sched: scheduler_lib.Scheduler,
             prefix: Optional[prefix_reuse.PrefixReuse]) -> list:
  """Every `Program` a request can reach, smallest first.

  Derived from the functions that choose the shapes at serving time (`sched.prompt_bucket`,
  `sched.prefill_rows`, `sched.decode_shape`, `prefix.table_width`, `prefix_reuse.copy_batch`)
  over their whole input ranges, so it follows them when they change. Assumes only that a
  bucket grows with what it covers (a longer prompt never gets a shorter bucket), which the
  extend pairs use: a (width, bucket) pair is reachable when the shortest prompt reaching both
  fits the context.
  """
  ec = config
  tops = sorted({sched.top_n(False), sched.top_n(True)})
  # A prompt has 1..max_len-1 tokens (max_tokens >= 1 must fit after it).
  lengths = _first_of_each(range(1, max_len), sched.prompt_bucket)  # bucket -> fewest tokens
  # (rows, bucket): a call of a bucket takes 1..max_prompts(bucket) prompts.
  shapes = sorted({(sched.prefill_rows(p, b), b) for b in lengths
                   for p in range(1, sched.max_prompts(b) + 1)})
  out = []
  extends = prefix is not None and prefix_reuse.always_extends(ec)
  if not extends:  # plain prefills: no prefix cache, or a call in which nothing is cached
    out += [Program("prefill", r, b, 0, t) for r, b in shapes for t in tops]
  if prefix is not None:
    bs = prefix.block_size
    first = 0 if extends else 1  # else an extend has a cached block
    widths = _first_of_each(range(first, prefix.max_blocks + 1), prefix.table_width)
    pairs = {(w, b) for w, fewest_blocks in widths.items() for b, fewest in lengths.items()
             if fewest_blocks * bs + fewest <= max_len - 1}
    out += [Program("extend", r, b, w, t) for r, b in shapes for w in widths if (w, b) in pairs
            for t in tops]
    # Pending copies are keyed by store block, so one call copies at most `blocks` of them.
    counts = {prefix_reuse.copy_batch(n) for n in range(1, prefix.blocks + 1)}
    out += [Program("copy", m) for m in sorted(counts)]
  # decode_shape's batch follows the highest owned slot, its length the furthest position.
  pos = np.ones(ec.max_slots, np.int32)
  batches = {sched.decode_shape([s], pos)[0] for s in range(ec.max_slots)}
  spans = set()
  for p in range(1, max_len):
    pos[0] = p
    spans.add(sched.decode_shape([0], pos)[1])
  out += [Program("decode", nb, sv, 0, t) for nb in sorted(batches) for sv in sorted(spans)
          for t in tops]
  block = prefix.block_size if prefix is not None else 1
  return sorted(out, key=lambda p: (p.work(block), KINDS.index(p.kind), p.top_n))


def spec(x) -> jax.ShapeDtypeStruct:
  """The shape, dtype (and, for an array placed explicitly, sharding) jit sees for `x`: what a
  call with `x` is compiled for."""
  committed = isinstance(x, jax.Array) and x.committed
  weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding if committed else None,
                              weak_type=weak)


@dataclasses.dataclass(frozen=True)
class Arguments:
  """The shapes of the engine's device state, which every program takes (`spec` trees)."""
  params: object
  cache_k: tuple
  cache_v: tuple
  slots: dict
  store_k: Optional[tuple] = None
  store_v: Optional[tuple] = None

  @classmethod
  def of(cls, params, cache_k, cache_v, slots, store_k=None, store_v=None) -> "Arguments":
    """Shapes only: nothing here holds (or keeps alive) the arrays it was given."""
    s = lambda t: None if t is None else jax.tree.map(spec, t)  # noqa: E731
    return cls(s(params), s(cache_k), s(cache_v), s(slots), s(store_k), s(store_v))


def compile_program(p: Program, *, cfg: ModelConfig, config: EngineConfig,
                    args: Arguments) -> None:
  """Lowers and compiles `p` with the arguments the engine's call of that shape passes."""
  ec = config
  if p.kind == "copy":
    idx = spec(np.zeros(p.rows, np.int32))
    prefix_programs.save_blocks.lower(args.store_k, args.store_v, args.cache_k, args.cache_v,
                                      idx, idx, idx).compile()
    return
  if p.kind == "decode":
    caps = forward.capacity_tiers(p.rows, cfg, ec.capacity_factors, ec.deterministic)
    device_programs.decode_chunk.lower(
        args.params, args.cache_k, args.cache_v, args.slots, cfg=cfg, nb=p.rows, sv=p.length,
        steps=ec.decode_steps, caps=caps, top_n=p.top_n).compile()
    return
  a = slot_tables.prefill_arrays([], p.rows, p.length, ec.max_slots)
  per_slot = [spec(a[k]) for k in _PREFILL_ARGS]
  caps = forward.capacity_tiers(p.rows * p.length, cfg, ec.capacity_factors, ec.deterministic)
  if p.kind == "prefill":
    device_programs.prefill_into_slots.lower(args.params, args.cache_k, args.cache_v, *per_slot,
                                             cfg=cfg, caps=caps, top_n=p.top_n).compile()
    return
  table = spec(np.zeros((p.rows, p.blocks), np.int32))
  start = spec(np.zeros(p.rows, np.int32))
  prefix_programs.extend_into_slots.lower(
      args.params, args.cache_k, args.cache_v, args.store_k, args.store_v, table, start,
      *per_slot, cfg=cfg, caps=caps, top_n=p.top_n).compile()


class CompileCounter:
  """Counts, while open (`with CompileCounter() as c:`), the executables built or loaded in
  this process: `c.compiled` XLA compilations, `c.cache_hits` loads from JAX's persistent
  compilation cache, `c.cache_requests` compilations that asked it (`//tools:rl_part`'s last
  line reports both), `c.compile_seconds` the time of all. Process-wide: a compilation in any
  thread counts. The one counter of JAX's compilation events (testlib/jax_cache.py, below every
  layer, counts the two cache events for test processes on its own)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.executables = 0
    self.cache_requests = 0
    self.cache_hits = 0
    self.compile_seconds = 0.0

  @property
  def compiled(self) -> int:
    return self.executables - self.cache_hits

  def _on_duration(self, event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE:
      with self._lock:
        self.executables += 1
        self.compile_seconds += duration

  def _on_event(self, event: str, **_) -> None:
    if event == CACHE_HIT:
      with self._lock:
        self.cache_hits += 1
    elif event == CACHE_REQUEST:
      with self._lock:
        self.cache_requests += 1

  def start(self) -> "CompileCounter":
    """Starts counting (`with` does this); returns self."""
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def stop(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)

  def __enter__(self) -> "CompileCounter":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def compile_all(progs: Sequence[Program], compile_one: Callable[[Program], None],
                progress: Optional[Callable[[int, int, str], None]] = None, threads: int = 1,
                stop: Optional[threading.Event] = None) -> dict:
  """Compiles `progs` with `compile_one`, `threads` at a time.

  `progress(done, total, what)` is called from this thread: first with done 0 ("what" counts
  the programs of each kind), then as each program is compiled ("what": it and its seconds).
  Setting `stop` ends the warm-up early, once the compilations under way have finished.

  Threads: XLA compiles one program on about one core and releases the GIL meanwhile, so a
  machine with cores to spare compiles several at once (jit's caches are thread-safe). Only
  `threads` are submitted at a time, so that stopping (or an error) waits for those alone.

  Returns:
    {"programs": how many, "done": how many were compiled (fewer when stopped), "seconds":
     wall time, "compiled": XLA compilations, "cache_hits": executables loaded from the
     persistent cache} (the last two process-wide: a request that compiles meanwhile counts).

  Raises:
    The first compilation error, once the compilations under way have ended.
  """
  if threads < 1:
    raise ValueError(f"threads must be >= 1, got {threads}")
  t0 = time.perf_counter()
  total = len(progs)
  kinds = collections.Counter(p.kind for p in progs)
  if progress is not None:
    progress(0, total, ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k]))
  done = 0

  def timed(p: Program) -> float:
    t = time.perf_counter()
    compile_one(p)
    return time.perf_counter() - t

  def finished(p: Program, seconds: float) -> None:
    nonlocal done
    done += 1
    if progress is not None:
      progress(done, total, f"{p.describe()} ({seconds:.1f} s)")

  with CompileCounter() as counter:
    todo = iter(progs)
    if threads == 1:  # in this thread: nothing is left running when it returns or raises
      for p in todo:
        if stop is not None and stop.is_set():
          break
        finished(p, timed(p))
    else:
      with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="warm-up") as pool:
        running = {pool.submit(timed, p): p for p in itertools.islice(todo, threads)}
        while running:
          ended, _ = concurrent.futures.wait(running,
                                             return_when=concurrent.futures.FIRST_COMPLETED)
          for f in ended:
            finished(running.pop(f), f.result())
            nxt = None if stop is not None and stop.is_set() else next(todo, None)
            if nxt is not None:
              running[pool.submit(timed, nxt)] = nxt
  return {"programs": total, "done": done, "seconds": time.perf_counter() - t0,
          "compiled": counter.compiled, "cache_hits": counter.cache_hits}
