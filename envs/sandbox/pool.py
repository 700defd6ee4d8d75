"""A warm pool of pre-started sandboxes, so acquiring one costs a queue pop, not a start.

Spawner threads keep idle slots started and ready, off the critical path: each asks the pool's
spawn helper (`launcher`, `spawner`) for a sandbox, a fork of an interpreter that has the zygote
imported plus the namespace and mount set-up (a few ms of CPU, no interpreter start). `acquire`
hands one out; `release` destroys it and a replacement starts in the background.

Sizing to demand: the pool keeps `target` idle slots, at least `size`. An acquire that finds no
idle slot (a miss: demand outran the refill) raises the target by one, up to `max_idle`, so a
sustained stream or a burst soon finds slots waiting; after `shrink_after_s` without a miss the
target falls back by one at a time, and an idle slot above it is destroyed, so a quiet pool holds
no more memory than `size` sandboxes. Refills run concurrently with the episodes. While demand is
low (the target is `size`) and idle slots remain, a refill waits `refill_delay_s` after the last
acquire, so on a small host its start-up CPU does not compete with the first command of the
episode just handed out (bench_sandbox's warm rows); once demand has raised the target, refills
start as soon as a slot is taken, to keep up.

`max_live` caps idle plus in-use slots, so a burst of a thousand queued episodes waits for slots
instead of starting a thousand sandboxes at once: memory stays bounded at roughly `max_live`
times the per-sandbox footprint. A released slot counts until every one of its processes is gone
(reaped; `Slot.close`, in a teardown thread): until then its memory and processes are still
there, and counting it keeps a replacement from running beside them.
"""

from __future__ import annotations

import collections
import os
import queue
import shutil
import tempfile
import threading
import time

from envs.sandbox import hostcheck
from envs.sandbox import launcher as launcher_lib
from envs.sandbox import slot as slot_lib


class WarmPool:
  """Pre-started single-use sandboxes.

  Args:
    size: idle sandboxes kept ready at least (the target when demand is low).
    max_live: cap on idle plus in-use sandboxes (default 4 * size).
    max_idle: the most idle sandboxes the target grows to under demand (default max_live).
    shrink_after_s: how long without a miss before the target falls by one toward `size`.
    allow_degraded: when the host cannot isolate (no user namespaces), run in the
      documented weaker mode instead of raising `SandboxUnavailable`. Every result then carries
      a "degraded_isolation" violation and an `isolation` string starting with "DEGRADED".
    force_degraded: use the weaker mode even where isolation is available (for tests).
    spawn_threads: concurrent starts. A start is partly waiting (the sandbox's set-up runs in
      its own processes, then the ready handshake), so several in flight keep both cores busy.
    root: where slot directories live (default: a fresh temporary directory).
    refill_delay_s: how long a replacement waits after the last acquire while idle slots remain
      and the target is `size` (0: start replacements at once, always).
  """

  def __init__(self, size: int = 4, *, max_live: int | None = None, allow_degraded: bool = False,
               force_degraded: bool = False, spawn_threads: int = 4, root: str | None = None,
               refill_delay_s: float = 0.03, max_idle: int | None = None,
               shrink_after_s: float = 5.0):
    if refill_delay_s < 0:
      raise ValueError(f"refill_delay_s must be >= 0, got {refill_delay_s}")
    self.features = hostcheck.detect()
    self.degraded = force_degraded or not self.features.full_isolation
    if self.degraded and not (allow_degraded or force_degraded):
      raise hostcheck.SandboxUnavailable(
          "cannot isolate sandboxes on this host: " + "; ".join(self.features.problems) +
          ". Fix the host, or pass allow_degraded=True (or set ENVS_SANDBOX_ALLOW_DEGRADED=1) to "
          "run with rlimits only, which every result will then report.")
    self.size = size
    self.max_live = max(max_live or 4 * size, size, 1)
    self.max_idle = min(max(max_idle or self.max_live, size), self.max_live)
    self.target = size  # Idle slots wanted now: grows on a miss, shrinks when quiet.
    self.shrink_after_s = shrink_after_s
    self.refill_delay_s = refill_delay_s
    self._last_acquire = float("-inf")
    self._last_miss = float("-inf")
    self._own_root = root is None
    # Under /tmp (not $TMPDIR, which Bazel points under /root): the sandbox uid must be able to
    # traverse every directory above a bind-mounted path.
    tmp_root = os.environ.get("ENVS_SANDBOX_ROOT", "/tmp")
    slot_lib.sweep_stale(self.features, tmp_root)
    self.root = root or tempfile.mkdtemp(prefix=f"envs-fleet-{os.getpid()}-", dir=tmp_root)
    os.chmod(self.root, 0o711)
    self.opt_dir = slot_lib.prepare_opt(self.features, self.root)
    self.launcher = launcher_lib.Launcher(self.features, self.opt_dir, self.root,
                                          namespaces=not self.degraded)
    self._idle: collections.deque[slot_lib.Slot] = collections.deque()
    # Two conditions on one lock, so each change wakes only the threads it concerns: an idle
    # slot appeared (`_ready`: acquire, wait_warm) or a spawner may have work (`_wanted`: a slot
    # was taken or is gone, the target grew). One condition notified to all woke every waiting
    # episode and spawner for each change: dozens of futex sleeps per episode in a burst.
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)
    self._wanted = threading.Condition(self._lock)
    self._warm = threading.Condition(self._lock)  # Any idle slot appeared (wait_warm).
    self._live = 0  # idle + in use + starting
    self._starting = 0
    self._closed = False
    self.stats = collections.Counter()
    self.last_spawn_error: str | None = None
    self._teardown: queue.Queue = queue.Queue()
    self._threads = [threading.Thread(target=self._spawn_loop, daemon=True, name=f"spawn-{i}")
                     for i in range(max(1, spawn_threads))]
    self._teardown_threads = [threading.Thread(target=self._teardown_loop, daemon=True,
                                               name=f"teardown-{i}") for i in range(2)]
    for t in self._threads + self._teardown_threads:
      t.start()

  @property
  def isolation(self) -> str:
    if self.degraded:
      return hostcheck.HostFeatures(**{**self.features.__dict__, "namespaces": False}).describe()
    return self.features.describe()

  def _shrink(self) -> float | None:
    """Lowers the target by one after a quiet spell; returns when to look again (None: never,
    the target is at its floor). Called with the lock held."""
    if self.target <= self.size:
      return None
    quiet_until = self._last_miss + self.shrink_after_s
    now = time.monotonic()
    if now < quiet_until:
      return quiet_until - now
    self.target -= 1
    self._last_miss = now  # The next step down waits another quiet spell.
    self.stats["shrunk"] += 1
    if len(self._idle) > self.target:
      slot = self._idle.pop()  # The newest: the oldest go out first through acquire.
      slot.kill()
      self._teardown.put((slot, True))
    return self.shrink_after_s

  def _spawn_loop(self) -> None:
    while True:
      with self._lock:
        while not self._closed:
          shrink_in = self._shrink()
          if len(self._idle) + self._starting >= self.target or self._live >= self.max_live:
            self._wanted.wait(shrink_in)
            continue
          defer = self._last_acquire + self.refill_delay_s - time.monotonic()
          if self._idle and defer > 0 and self.target <= self.size:
            self._wanted.wait(defer)
            continue
          break
        if self._closed:
          return
        self._starting += 1
        self._live += 1
        self.stats["peak_live"] = max(self.stats["peak_live"], self._live)
      slot = None
      try:
        slot = slot_lib.Slot(self.root, self.features, degraded=self.degraded,
                             launcher=self.launcher)
        slot.wait_ready()
      except Exception as e:  # pylint: disable=broad-except
        self.stats["spawn_failures"] += 1
        self.last_spawn_error = str(e)
        if slot is not None:
          slot.cleanup()  # Here, not queued: close() may have stopped the teardown threads.
        with self._lock:
          self._starting -= 1
          self._live -= 1
          self._wanted.notify()
        time.sleep(0.05)
        continue
      with self._lock:
        self._starting -= 1
        self.stats["spawned"] += 1
        closed = self._closed
        if closed:
          self._live -= 1
        else:
          self._idle.append(slot)
          self._ready.notify()
          self._warm.notify_all()
      if closed:
        slot.cleanup()  # As above.

  def _teardown_loop(self) -> None:
    while True:
      item = self._teardown.get()
      if item is None:
        return
      slot, counted = item if isinstance(item, tuple) else (item, False)
      try:
        slot.cleanup()
        if slot.processes_gone is False:
          self.stats["teardown_incomplete"] += 1
      except Exception:  # pylint: disable=broad-except
        self.stats["cleanup_failures"] += 1
      finally:
        if counted:
          with self._lock:
            self._live -= 1
            self._wanted.notify()

  def acquire(self, timeout_s: float | None = 60.0) -> slot_lib.Slot:
    """Returns a ready, unused sandbox; blocks while none is idle."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with self._lock:
      if not self._idle and not self._closed:
        # A miss: demand outran the refill. Keep more slots ready from now on.
        self.stats["misses"] += 1
        self._last_miss = time.monotonic()
        if self.target < self.max_idle:
          self.target += 1
          self.stats["grown"] += 1
        self._wanted.notify()
      while True:
        if self._closed:
          raise slot_lib.SlotError("pool is closed")
        while self._idle:
          slot = self._idle.popleft()
          self._wanted.notify()  # One idle slot fewer: a spawner may start its replacement.
          if slot.alive():
            self.stats["acquired"] += 1
            self._last_acquire = time.monotonic()
            if self._idle:
              self._ready.notify()  # Passed on, in case this wait took another's wake-up.
            return slot
          self._live -= 1
          self._teardown.put(slot)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise slot_lib.SlotError(f"no sandbox became ready in {timeout_s}s")
        self._ready.wait(left)

  def release(self, slot: slot_lib.Slot) -> None:
    """Destroys a used sandbox: kills it now; in the background, waits until its processes are
    gone, then no longer counts it against `max_live` and removes its files."""
    slot.kill()
    with self._lock:
      self.stats["released"] += 1
    self._teardown.put((slot, True))

  def wait_warm(self, timeout_s: float = 30.0) -> None:
    """Blocks until `target` sandboxes are idle (for benchmarks and tests)."""
    deadline = time.monotonic() + timeout_s
    with self._lock:
      while len(self._idle) < self.target:
        left = deadline - time.monotonic()
        if left <= 0:
          raise slot_lib.SlotError(f"pool did not warm up in {timeout_s}s")
        self._warm.wait(left)

  def idle_pids(self) -> list[int]:
    """Host pids of the idle sandboxes' outer processes (for memory accounting)."""
    with self._lock:
      return [s.pid for s in self._idle]

  def idle_count(self) -> int:
    with self._lock:
      return len(self._idle)

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      idle = list(self._idle)
      self._idle.clear()
      self._ready.notify_all()
      self._wanted.notify_all()
      self._warm.notify_all()
    for slot in idle:
      slot.kill()
      self._teardown.put(slot)
    for t in self._threads:
      t.join(timeout=20)  # A start in flight ends in a cleanup of its own (see _spawn_loop).
    for _ in self._teardown_threads:
      self._teardown.put(None)
    for t in self._teardown_threads:
      t.join(timeout=60)
    self.launcher.close()  # Kills anything still there, which nothing should be.
    if self._own_root:
      shutil.rmtree(self.root, ignore_errors=True)

  def __enter__(self) -> "WarmPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
