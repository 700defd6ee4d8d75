"""JAX's persistent compilation cache for the entry points: where it lives, and turning it on.

What:
  * `enable(directory, min_compile_time_secs=0.0)`: JAX writes every executable it compiles
    (taking at least that long) under `directory` (created) and loads it from there the next
    time the same program is compiled, in this process or a later one; returns the directory.
  * `default_dir()`: `$XDG_CACHE_HOME/moe-rl/jax`, else `~/.cache/moe-rl/jax`.

Why one helper: `//tools:main` keeps one cache per experiment run (its engines and learner
compile the same shapes again) and `//tools:serve` one per user (a restarted server loads the
programs its warm-up compiled, `rollout.warmup`); both set the same three JAX options. Only
entry points configure JAX globally, so it lives in tools/.

Call it before the first compilation: JAX decides once per process, at its first compilation,
whether the cache is used. Entries are executables for this machine's backend (JAX keys them
by program, jaxlib version, backend and XLA flags, not by CPU model): a directory shared by
machines with different CPUs (a network home directory) should be given per machine type.
"""

from __future__ import annotations

import os

APP = "moe-rl"


def default_dir() -> str:
  """Where a user's cache lives unless told otherwise (XDG base directory convention)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, APP, "jax")


def enable(directory: str, *, min_compile_time_secs: float = 0.0) -> str:
  """Turns on JAX's persistent compilation cache in `directory`; returns its absolute path.

  Args:
    directory: the cache directory (created if missing; `~` expanded).
    min_compile_time_secs: compilations faster than this are not written (0: all of them, so
      that a restart compiles nothing the last run compiled).
  """
  import jax  # pylint: disable=g-import-not-at-top  -- entry points import JAX late
  directory = os.path.abspath(os.path.expanduser(directory))
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
  # -1: no minimum entry size, and no backend may raise it (0 would let one).
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return directory
