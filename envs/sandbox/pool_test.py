"""The warm pool sizes itself to demand and refills while a burst holds its slots.

Misses are made certain, not likely: with `max_live` slots held nothing more can start, so the
next acquire must find the pool empty.
"""

import threading

from envs import sandbox
from envs.sandbox import pool as pool_lib
from testlib import waiting


def _acquire_in_thread(pool, got, errors):
  def run():
    try:
      got.append(pool.acquire(timeout_s=120))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
  t = threading.Thread(target=run)
  t.start()
  return t


def test_misses_grow_the_target_and_a_quiet_spell_shrinks_it():
  with pool_lib.WarmPool(size=1, max_live=3, max_idle=3, shrink_after_s=0.5) as pool:
    pool.wait_warm()
    assert pool.target == 1
    held = [pool.acquire() for _ in range(3)]  # max_live: nothing more can start now.
    misses = pool.stats["misses"]
    got, errors = [], []
    t = _acquire_in_thread(pool, got, errors)
    # The fourth acquire finds nothing idle: a miss, which raises the target.
    waiting.wait_until(lambda: pool.stats["misses"] == misses + 1, "the fourth acquire to miss")
    assert pool.target >= 2 and pool.stats["grown"] >= 1, (pool.target, pool.stats)
    pool.release(held.pop())  # Its teardown frees room for the waiting acquire's slot.
    t.join(timeout=120)
    assert not errors and len(got) == 1, errors
    for s in held + got:
      pool.release(s)
    # Demand met: the pool refills to the raised target, then, without misses, steps back to
    # `size` one quiet spell at a time, destroying the idle slots above it.
    waiting.wait_until(lambda: pool.target == 1 and pool.idle_count() == 1,
                       lambda: f"target 1 and one idle slot (target {pool.target}, idle "
                               f"{pool.idle_count()})", timeout_s=60)
    assert pool.stats["shrunk"] == pool.stats["grown"], pool.stats
    r = sandbox.run(command=["true"], pool=pool)
    assert r.ok, r


def test_a_burst_is_served_and_refilled_while_it_holds_its_slots():
  with pool_lib.WarmPool(size=2, max_live=6, max_idle=4) as pool:
    pool.wait_warm()
    got, errors = [], []
    threads = [_acquire_in_thread(pool, got, errors) for _ in range(8)]
    # Eight episodes at once, two sandboxes idle: the pool starts more during the burst, up to
    # max_live, all held at once...
    waiting.wait_until(lambda: len(got) == 6 or errors, lambda: f"six slots ({len(got)} got)")
    assert not errors and pool.stats["spawned"] >= 6, (errors, pool.stats)
    # ...and the two left over missed, raising the target.
    waiting.wait_until(lambda: pool.stats["misses"] >= 2, "the two waiting acquires to miss")
    assert pool.target > 2, pool.target
    for s in got[:2]:  # Their teardown makes room: the two waiting episodes get new slots.
      pool.release(s)
    for t in threads:
      t.join(timeout=120)
    assert not errors and len(got) == 8 and len({s.id for s in got}) == 8, errors
    assert pool.stats["peak_live"] <= pool.max_live and pool.stats["spawned"] >= 8, pool.stats
    for s in got[2:]:
      r = s.exec(["python3", "-c", "print('ok')"])
      assert r.stdout == "ok\n", r
      pool.release(s)
    waiting.wait_until(lambda: pool.idle_count() == pool.target, "the refill after the burst")
