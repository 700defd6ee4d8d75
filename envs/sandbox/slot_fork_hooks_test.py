"""Slots spawn bubblewrap with a `preexec_fn`, so CPython runs the interpreter's at-fork hooks
around each spawn, on whichever thread is spawning. A module that registers a before/after pair
while a spawn is between its two halves gets its `after_in_parent` hook without the `before` one.
`concurrent.futures.thread` registers such a pair for its `_global_shutdown_lock` on its first
import (which `concurrent.futures` does lazily, at the first `ThreadPoolExecutor` lookup): the
unmatched release then frees the lock under a thread inside `submit`, which fails with
"release unlocked lock" (seen once in CI: a test's first executor while the warm pool spawned).
`slot` imports it up front; this test replays that interleaving deterministically.
"""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
  import os, subprocess, sys, threading
  {prelude}
  errors = []
  sys.unraisablehook = lambda u: errors.append(repr(u.exc_value))
  in_window, imported = threading.Event(), threading.Event()

  def hold_the_fork():  # runs in the spawning thread, between the before and after hooks
    if threading.current_thread().name == "spawner":
      in_window.set()
      assert imported.wait(30), "the main thread never imported"

  os.register_at_fork(before=hold_the_fork)
  t = threading.Thread(target=lambda: subprocess.run(["true"], preexec_fn=lambda: None),
                       name="spawner")
  t.start()
  assert in_window.wait(30), "the spawn never reached its before-fork hooks"
  import concurrent.futures.thread  # what a first ThreadPoolExecutor lookup does
  imported.set()
  t.join(30)
  assert not t.is_alive()
  print("ERRORS", errors)
""")


def _run(prelude):
  out = subprocess.run([sys.executable, "-c", _SCRIPT.format(prelude=prelude)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert out.returncode == 0, out.stderr
  return out.stdout.strip()


def test_the_interleaving_breaks_a_lazily_imported_executor():
  """Without the up-front import the replay reproduces the failure (so the next test means it)."""
  assert "release unlocked lock" in _run("")


def test_importing_slot_registers_the_executor_hooks_first():
  assert _run("import envs.sandbox.slot") == "ERRORS []"
