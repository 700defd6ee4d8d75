"""Tests for the thread-pool helpers: order, every item once, errors only after all stop."""

import concurrent.futures
import sys
import threading
import time

import pytest

from sync import parallel


def test_map_all_keeps_order_runs_each_item_once_and_balances():
  seen, lock = [], threading.Lock()

  def fn(x):
    if x == 0:
      time.sleep(0.2)  # one slow item: the other thread takes the rest
    with lock:
      seen.append((x, threading.get_ident()))
    return x * x

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert parallel.map_all(pool, fn, range(20), 2) == [x * x for x in range(20)]
  assert sorted(x for x, _ in seen) == list(range(20))
  slow_thread = next(t for x, t in seen if x == 0)
  assert sum(t != slow_thread for _, t in seen) >= 15
  assert parallel.map_all(None, fn, [3, 4], 2) == [9, 16]


def test_map_all_raises_only_after_every_thread_stopped():
  running = []

  def fn(x):
    running.append(x)
    if x == 1:
      raise ValueError("bad item")
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
