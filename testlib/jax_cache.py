"""JAX's persistent compilation cache for the processes a test starts, in the test's directory.

Why: a test that starts the same part several times (a learner killed and restarted, a sampler
started again, one learner per fault) compiles the same programs in every process. With one
cache directory per test module, each program is compiled once and loaded after that, as a
restarted part of a real run loads it (`//tools:rl_part --compilation_cache_dir`). The
directory is always the test's own (never the user's cache, nor another run's).

In a child process, before anything compiles (JAX decides at its first compilation whether
the cache is used):

  from testlib import jax_cache
  jax_cache.enable(DIRECTORY)

`enable` writes every program (however fast it compiled) and, when the process exits normally,
prints one line, `jax cache {"requests": N, "hits": H}`: the compilations that consulted the
cache and those of them it answered; `parse(output)` reads it back.

The same three JAX options as tools/compilation_cache.py (this bottom layer imports nothing of
ours).
"""

import atexit
import json
import os

LINE = "jax cache "


def enable(directory: str) -> None:
  """Turns the cache on in `directory` (created) for this process and reports at exit."""
  import jax  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  counts = {"requests": 0, "hits": 0}

  def event(name, **_):
    if name == "/jax/compilation_cache/compile_requests_use_cache":
      counts["requests"] += 1
    elif name == "/jax/compilation_cache/cache_hits":
      counts["hits"] += 1
  jax.monitoring.register_event_listener(event)
  atexit.register(lambda: print(LINE + json.dumps(counts), flush=True))


def parse(output: str) -> dict:
  """The counts `enable` printed in a process's `output`; AssertionError if it printed none."""
  lines = [l for l in output.splitlines() if l.startswith(LINE)]
  assert lines, f"no {LINE!r} line in:\n{output[-3000:]}"
  return json.loads(lines[-1][len(LINE):])
