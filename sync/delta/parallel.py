"""Thread-pool helpers for the delta codec: bounded in-order maps and self-balancing batches.

What: `ordered` maps over a stream with a bounded window of tasks in flight (results in order,
memory O(window)); `batches` cuts a stream into bounded lists; `map_all` runs a function over
a list with a few threads, the caller's among them, each taking the next item from a shared
counter; `Local` holds one zstd compressor and decompressor per thread. Why here: `delta`
encodes, decodes and applies chunks with them, and their scheduling choices were measured on
the loaded 2-core machine (see `map_all`).
"""

import concurrent.futures
import os
import threading

import zstandard


def workers(n=None) -> int:
  """`n`, or by default the cores (at most 8)."""
  return n or min(8, os.cpu_count() or 1)


class Local(threading.local):
  """Per-thread zstd contexts (they are not thread-safe)."""

  def __init__(self, level):
    super().__init__()
    self.cctx = zstandard.ZstdCompressor(level=level, write_checksum=True,
                                         write_content_size=True)
    self.dctx = zstandard.ZstdDecompressor()


def ordered(pool, fn, items, window):
  """pool.map with at most `window` tasks in flight (bounded memory), results in order."""
  pending = []
  for item in items:
    pending.append(pool.submit(fn, item))
    if len(pending) >= window:
      yield pending.pop(0).result()
  for f in pending:
    yield f.result()


def batches(items, max_items, max_size, size):
  """Lists of consecutive items from a stream, each closed at `max_items` items or once the
  items' `size(item)` add up to `max_size` (bounded memory for a stream fed to `map_all`)."""
  batch, total = [], 0
  for item in items:
    batch.append(item)
    total += size(item)
    if len(batch) >= max_items or total >= max_size:
      yield batch
      batch, total = [], 0
  if batch:
    yield batch


def map_all(pool, fn, items, w):
  """fn over every item with `w` threads (the caller's among them), results in order.

  One hand-off per worker rather than per chunk: on a loaded machine every thread wake-up can
  wait for a scheduler slice, which cost ~20% of an in-place apply when tasks were chunks.
  Items are taken from a shared counter rather than split in advance, so when another process
  holds one core the thread that runs does the rest instead of waiting for its slower half.
  """
  items = list(items)
  if pool is None or w <= 1 or len(items) <= 1:
    return [fn(x) for x in items]
  out = [None] * len(items)
  nxt = iter(range(len(items)))
  lock = threading.Lock()

  def run():
    while True:
      with lock:
        i = next(nxt, None)
      if i is None:
        return
      out[i] = fn(items[i])

  helpers = [pool.submit(run) for _ in range(min(w, len(items)) - 1)]
  try:
    run()
  finally:
    concurrent.futures.wait(helpers)  # nothing may still write when this returns or raises
  for f in helpers:
    f.result()
  return out
