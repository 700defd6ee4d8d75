"""Tests for the decode buffer pool: memory is reused only once nothing references it."""

import sys
import threading

import numpy as np
import pytest

from sync.delta import buffers


def _addr(a):
  return a.__array_interface__["data"][0]


def test_arrays_have_the_asked_dtype_shape_and_alignment():
  r = buffers.Recycler()
  a, b, c = r.arrays([(np.uint16, (4, 1000)), (np.float32, (3,)), (np.int8, (0,))])
  assert (a.shape, a.dtype, b.shape, b.dtype, c.size) == ((4, 1000), np.uint16, (3,),
                                                          np.float32, 0)
  assert a.flags.c_contiguous and a.flags.writeable and _addr(a) % 64 == 0
  assert r.kept_bytes == 8000 + 12


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
  r = buffers.Recycler(keep=3)
  (a,) = r.arrays([(np.uint16, (1000,))])
  first = _addr(a)
  (b,) = r.arrays([(np.uint16, (1000,))])  # `a` is alive: new memory
  assert _addr(b) != first and r.reused == 0
  row = a.reshape(10, 100)[3]  # a view of a view pins the buffer
  mv = memoryview(a[:10])  # and so does an exported buffer
  del a, b
  (c,) = r.arrays([(np.uint16, (1000,))])  # b's buffer is free, a's is not
  assert _addr(c) != first and r.reused == 1
  del row
  (d,) = r.arrays([(np.uint16, (1000,))])  # the memoryview still holds the first buffer
  assert _addr(d) != first and r.reused == 1
  mv.release()
  del mv
  (e,) = r.arrays([(np.uint16, (1000,))])
  assert _addr(e) == first and r.reused == 2
  del c, d, e
  assert r.arrays([(np.uint32, (500,))]) and r.reused == 3  # same bytes, other dtype


def test_only_the_last_calls_buffers_are_kept():
  r = buffers.Recycler(keep=2)
  (a,) = r.arrays([(np.uint8, (64,))])
  first = _addr(a)
  (b,) = r.arrays([(np.uint8, (64,))])
  (c,) = r.arrays([(np.uint8, (64,))])  # the first call falls out of the pool
  del a, b, c
  got = {_addr(r.arrays([(np.uint8, (64,))])[0]) for _ in range(3)}
  assert first not in got and r.reused == 3


def test_the_ping_pong_of_a_decode_loop_allocates_two_sets():
  r = buffers.Recycler(keep=2)
  seen = set()
  w = r.arrays([(np.float32, (256,)), (np.float32, (16,))])
  for _ in range(6):
    w = r.arrays([(np.float32, (256,)), (np.float32, (16,))])  # the old `w` is alive here
    seen.add(_addr(w[0]))
  assert len(seen) == 2 and r.reused == 10  # 7 calls: 2 allocate, 5 reuse both tensors
  r.release()
  assert r.kept_bytes == 0
  del w
  r.arrays([(np.float32, (256,))])
  assert r.reused == 10  # released buffers are not handed out again


def test_keep_zero_never_reuses_and_bad_keep_is_rejected():
  r = buffers.Recycler(keep=0)
  for _ in range(3):
    r.arrays([(np.uint8, (100,))])
  assert r.reused == 0 and r.kept_bytes == 0
  with pytest.raises(ValueError):
    buffers.Recycler(keep=-1)


def test_concurrent_callers_never_get_the_same_live_buffer():
  r = buffers.Recycler(keep=4)
  live, errors, lock = set(), [], threading.Lock()

  def worker():
    for _ in range(200):
      (a,) = r.arrays([(np.uint8, (4096,))])
      with lock:
        if _addr(a) in live:
          errors.append(_addr(a))
        live.add(_addr(a))
      a[:] = 1
      with lock:
        live.discard(_addr(a))
      del a

  threads = [threading.Thread(target=worker) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and r.reused > 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
