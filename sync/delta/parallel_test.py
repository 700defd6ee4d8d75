"""Tests for the thread-pool helpers: order, every item once, errors only after all stop."""

import concurrent.futures
import sys
import threading
import time

import pytest

from sync.delta import parallel
from testlib import waiting


def test_map_all_keeps_order_runs_each_item_once_and_balances():
  seen, lock = [], threading.Lock()
  rest_done = threading.Event()

  def fn(x):
    if x == 0:
      # One item that cannot finish until all the others have: the thread that took it is
      # stuck, so the other thread must take every other item from the shared counter (with
      # the items split in advance, this would wait for the stuck thread's own share forever).
      waiting.wait_event(rest_done, "the other thread to do the other 19 items",
                         timeout_s=30)
    with lock:
      seen.append((x, threading.get_ident()))
      if len(seen) == 19 and all(i != 0 for i, _ in seen):
        rest_done.set()
    return x * x

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert parallel.map_all(pool, fn, range(20), 2) == [x * x for x in range(20)]
  assert sorted(x for x, _ in seen) == list(range(20))
  slow_thread = next(t for x, t in seen if x == 0)
  assert sum(t != slow_thread for _, t in seen) == 19
  assert parallel.map_all(None, fn, [3, 4], 2) == [9, 16]


def test_map_all_raises_only_after_every_thread_stopped():
  running = []
  other_started = threading.Event()

  def fn(x):
    running.append(x)
    if x == 1:
      # Fail only once another item has started (it takes 10 ms, so it is usually still in
      # flight): an error returned before the other thread stopped would show in `running`.
      waiting.wait_event(other_started, "another item to start", timeout_s=30)
      raise ValueError("bad item")
    other_started.set()
    time.sleep(0.01)
    running.remove(x)
    return x

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    with pytest.raises(ValueError, match="bad item"):
      parallel.map_all(pool, fn, range(8), 2)
  assert running == [1]  # nothing else still in flight when the error reached the caller


def test_ordered_bounds_the_window():
  in_flight, peak, lock = [0], [0], threading.Lock()

  def fn(x):
    with lock:
      in_flight[0] += 1
      peak[0] = max(peak[0], in_flight[0])
    time.sleep(0.005)
    with lock:
      in_flight[0] -= 1
    return x

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert list(parallel.ordered(pool, fn, range(30), 3)) == list(range(30))
  assert peak[0] <= 3
  assert parallel.workers(5) == 5 and parallel.workers() >= 1


def test_batches_close_at_the_item_or_size_bound():
  got = list(parallel.batches(iter([5, 1, 1, 9, 2, 2, 2, 2, 2]), 3, 10, lambda x: x))
  assert got == [[5, 1, 1], [9, 2], [2, 2, 2], [2]]
  assert not list(parallel.batches(iter([]), 3, 10, len))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
