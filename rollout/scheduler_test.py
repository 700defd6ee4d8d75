"""The scheduler without a model: admission order and grouping (round-robin across submissions), lowest-first slots, all-or-nothing
queueing, expiry, and the shape buckets the device programs are compiled for."""

import sys
import threading

import numpy as np
import pytest

from rollout.engine_types import EngineConfig, QueueFull, RequestHandle
from rollout.sampling import MAX_TOP_LOGPROBS, SamplingParams
from rollout.scheduler import Scheduler, end_reason, geometric_at_least, pow2_at_least


def _req(prompt_len, n=1, deadline=None):
  return RequestHandle(list(range(prompt_len)), SamplingParams(n=n), (), deadline, None)


def _sched(max_len=256, **kw):
  base = dict(max_slots=8, max_queue=16, prefill_rows=4, min_prefill_len=16, length_bucket=64)
  base.update(kw)
  return Scheduler(EngineConfig(**base), max_len, threading.Condition())


def test_pow2_at_least():
  assert [pow2_at_least(x) for x in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
  assert pow2_at_least(3, 16) == 16 and pow2_at_least(17, 16) == 32
  assert [geometric_at_least(x, 1, 4) for x in (1, 2, 4, 5, 17)] == [1, 4, 4, 16, 64]
  assert geometric_at_least(65, 16, 4) == 256


def test_enqueue_is_all_or_nothing():
  s = _sched(max_queue=5)
  s.enqueue([_req(3, n=2), _req(3, n=2)])
  with pytest.raises(QueueFull):
    s.enqueue([_req(3), _req(3)])  # 4 + 2 > 5: neither is queued
  assert len(s.queue) == 2 and s.queued_completions == 4
  s.enqueue([_req(3)])
  assert s.queued_completions == 5


def test_admission_takes_one_length_bucket_in_order_into_the_lowest_free_slots():
  s = _sched()
  s.assign(0, object(), object())
  a, b, c, d = _req(5, n=2), _req(16), _req(17), _req(3)  # buckets 16, 16, 32, 16
  s.enqueue([a, b, c, d])
  batch, bucket = s.take_prefill_batch()
  assert bucket == 16 and batch == [(a, [1, 2]), (b, [3])]  # c (bucket 32) ends the batch
  assert [h for h in s.queue] == [c, d] and s.queued_completions == 2
  for h, slots in batch:
    for i, slot in enumerate(slots):
      s.assign(slot, h, h.samples[i])
  batch, bucket = s.take_prefill_batch()
  assert bucket == 32 and batch == [(c, [4])]


def test_admission_waits_until_all_n_completions_fit_and_caps_prefill_rows():
  s = _sched(max_slots=4, prefill_rows=2)
  for slot in (0, 1):
    s.assign(slot, object(), object())
  s.enqueue([_req(4, n=3), _req(4)])
  assert s.take_prefill_batch() == ([], None)  # 3 completions, 2 free slots: nothing yet
  s.release(0)
  batch, _ = s.take_prefill_batch()
  assert [slots for _, slots in batch] == [[0, 2, 3]]
  s = _sched(prefill_rows=2)
  s.enqueue([_req(4) for _ in range(3)])
  assert len(s.take_prefill_batch()[0]) == 2


def test_expiry_removes_cancelled_and_timed_out_requests():
  s = _sched()
  keep, gone, late = _req(3), _req(3, n=2), _req(3, deadline=10.0)
  gone.cancel()
  s.enqueue([keep, gone, late])
  assert s.expired_queued(now=11.0) == [(gone, "cancelled"), (late, "timeout")]
  assert list(s.queue) == [keep] and s.queued_completions == 1
  run = _req(3, deadline=20.0)
  s.assign(5, run, run.samples[0])
  assert s.expired_slots(now=19.0) == [] and s.expired_slots(now=20.0) == [(5, "timeout")]
  assert end_reason(keep, 1e9) is None


def test_shape_buckets():
  s = _sched(decode_steps=16)
  assert s.prompt_bucket(1) == 16 and s.prompt_bucket(33) == 64 and s.prompt_bucket(300) == 256
  pos = np.zeros(8, np.int32)
  pos[[0, 4]] = (10, 100)
  assert s.decode_shape([0, 4], pos) == (8, 128)  # slot 4 -> 8 rows; 100 + 16 -> 128
  assert s.decode_shape([0], pos) == (1, 64)
  pos[0] = 250
  assert s.decode_shape([0], pos) == (1, 256)  # never past the cache
  det = _sched(deterministic=True)
  assert det.decode_shape([0], pos) == (8, 256) and det.prefill_rows(1, 16) == 4


def test_coarse_decode_lengths_double_and_fine_ones_step_by_length_bucket():
  coarse, fine = (_sched(max_len=1024, decode_steps=16, length_bucket=64, shape_buckets=b)
                  for b in ("coarse", "fine"))
  pos = np.zeros(8, np.int32)
  spans = {}
  for s, name in ((coarse, "coarse"), (fine, "fine")):
    spans[name] = []
    for p in (10, 48, 49, 100, 150, 300, 600, 1000):
      pos[2] = p
      spans[name].append(s.decode_shape([2], pos))
  # furthest position + 16 steps: 26, 64, 65, 116, 166, 316, 616, 1016
  assert spans["coarse"] == [(4, n) for n in (64, 64, 128, 128, 256, 512, 1024, 1024)]
  assert spans["fine"] == [(4, n) for n in (64, 64, 128, 128, 192, 320, 640, 1024)]
  assert len({n for _, n in spans["coarse"]}) == 5  # 64 x 2**i up to the cache


def test_coarse_prefill_rows_are_fixed_per_bucket_by_prefill_tokens():
  s = _sched(prefill_rows=4, prefill_tokens=64)
  assert [s.max_prompts(b) for b in (16, 32, 64, 128, 256)] == [4, 2, 1, 1, 1]
  assert s.prefill_rows(1, 16) == 4 and s.prefill_rows(3, 16) == 4  # padded to the bucket's
  assert s.prefill_rows(1, 32) == 2 and s.prefill_rows(1, 256) == 1
  fine = _sched(prefill_rows=4, prefill_tokens=64, shape_buckets="fine")
  assert [fine.max_prompts(b) for b in (16, 256)] == [4, 4]
  assert [fine.prefill_rows(p, 256) for p in (1, 2, 3, 4)] == [1, 2, 4, 4]
  det = _sched(prefill_rows=4, prefill_tokens=64, deterministic=True)
  assert det.max_prompts(256) == 4 and det.prefill_rows(1, 256) == 4


def test_coarse_admission_takes_at_most_the_buckets_prompts():
  s = _sched(prefill_rows=4, prefill_tokens=64)
  longs = [_req(20) for _ in range(3)]  # bucket 32: 2 per call
  s.enqueue(longs)
  batch, bucket = s.take_prefill_batch()
  assert bucket == 32 and [h for h, _ in batch] == longs[:2]
  _admit(s, batch)
  shorts = [_req(3) for _ in range(5)]  # bucket 16: 4 per call
  s.enqueue(shorts)
  batch, bucket = s.take_prefill_batch()
  assert bucket == 32 and [h for h, _ in batch] == longs[2:]  # its turn came first
  _admit(s, batch)
  batch, bucket = s.take_prefill_batch()
  assert bucket == 16 and [h for h, _ in batch] == shorts[:4]
  fine = _sched(prefill_rows=4, prefill_tokens=64, shape_buckets="fine")
  fine.enqueue([_req(20) for _ in range(3)])
  assert len(fine.take_prefill_batch()[0]) == 3


def test_coarse_calls_always_return_top_logprobs():
  assert [_sched().top_n(w) for w in (False, True)] == [MAX_TOP_LOGPROBS] * 2
  assert [_sched(shape_buckets="fine").top_n(w) for w in (False, True)] == [0, MAX_TOP_LOGPROBS]


def test_drain_empties_the_queue():
  s = _sched()
  reqs = [_req(2, n=2), _req(2)]
  s.enqueue(reqs)
  assert s.drain() == reqs and not s.queue and s.queued_completions == 0
  assert not s.has_work()
  s.assign(2, reqs[0], reqs[0].samples[0])
  assert s.has_work() and s.owned_slots() == [2] and s.num_running() == 1



def _admit(s, batch):
  for h, slots in batch:
    for i, slot in enumerate(slots):
      s.assign(slot, h, h.samples[i])


def test_admission_is_round_robin_across_submissions():
  s = _sched()  # 8 slots, 4 prefill rows
  a = [_req(3) for _ in range(5)]
  b, c = [_req(3)], [_req(3) for _ in range(2)]
  for group in (a, b, c):
    s.enqueue(group)
  batch, _ = s.take_prefill_batch()
  assert [h for h, _ in batch] == [a[0], b[0], c[0], a[1]]  # one from each, then round again
  assert [slots for _, slots in batch] == [[0], [1], [2], [3]]
  _admit(s, batch)
  batch, _ = s.take_prefill_batch()  # b is done; c's turn comes before a's
  assert [h for h, _ in batch] == [c[1], a[2], a[3], a[4]]
  assert not s.queue and s.queued_completions == 0


def test_a_later_small_submission_is_admitted_as_soon_as_slots_free():
  """One submission of 20 holds all 8 slots; a small one that comes later gets one of the next
  two slots to free, not a slot after all 12 queued prompts of the big one."""
  s = _sched(max_queue=32)
  big = [_req(3) for _ in range(20)]
  s.enqueue(big)
  for _ in range(2):
    _admit(s, s.take_prefill_batch()[0])
  assert s.num_running() == 8 and s.take_prefill_batch() == ([], None)
  small = _req(3)
  s.enqueue([small])
  s.release(5)
  first = s.take_prefill_batch()[0]
  _admit(s, first)
  s.release(6)
  second = s.take_prefill_batch()[0]
  assert [h for h, _ in first + second] == [big[8], small]
  assert s.queue_depth() == 11


def test_the_submission_whose_turn_it_is_is_not_overtaken_but_other_buckets_wait_in_place():
  s = _sched(max_slots=4)
  for slot in (0, 1):
    s.assign(slot, object(), object())
  wide, narrow = _req(3, n=3), _req(3)
  s.enqueue([wide])
  s.enqueue([narrow])
  assert s.take_prefill_batch() == ([], None)  # wide needs 3 of the 2 free slots: all wait
  s.release(0)
  assert s.take_prefill_batch()[0] == [(wide, [0, 2, 3])]
  # A submission whose head is in another length bucket keeps its place for the next call.
  s = _sched()
  long_, short = _req(20), _req(3)  # buckets 32 and 16
  s.enqueue([long_])
  s.enqueue([short])
  assert s.take_prefill_batch() == ([(long_, [0])], 32)
  assert s.take_prefill_batch() == ([(short, [0])], 16)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
