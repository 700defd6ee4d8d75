"""tools.compilation_cache: a second process with the same directory loads every executable the
first one compiled (even the fast ones) instead of compiling it; where the cache lives by default.

Each run is its own Python process: JAX decides once per process whether the cache is used.
"""

import json
import os
import subprocess
import sys

from tools import compilation_cache

WAIT_S = 300  # a process that imports JAX, on a loaded machine

_RUN = r"""
import json, sys
import jax
from rollout import warmup
from tools import compilation_cache
counter = warmup.CompileCounter().start()
directory = compilation_cache.enable(sys.argv[1])
y = jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3))
print(json.dumps({"dir": directory, "y": y.tolist(), "executables": counter.executables,
                  "requests": counter.cache_requests, "hits": counter.cache_hits}))
"""


def _run(directory) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  out = subprocess.run([sys.executable, "-c", _RUN, str(directory)], env=env, check=True,
                       capture_output=True, text=True, timeout=WAIT_S)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  directory = tmp_path / "nested" / "jax"  # created by enable
  first = _run(directory)
  assert first["dir"] == str(directory) and first["y"] == [1, 3, 5]
  # Every executable (the jitted function and arange's) took well under JAX's default 1 s
  # minimum, so only min_compile_time_secs=0 writes them.
  assert first["executables"] >= 1 and first["hits"] == 0
  assert first["requests"] == first["executables"]  # each compilation asked the cache
  assert len(os.listdir(directory)) >= first["executables"]
  second = _run(directory)
  assert second["y"] == [1, 3, 5]
  assert second["hits"] == second["requests"] == second["executables"] == first["executables"]


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.default_dir() == os.path.join(str(tmp_path), "moe-rl", "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.default_dir() == os.path.join(str(tmp_path), "home", ".cache",
                                                         "moe-rl", "jax")


if __name__ == "__main__":
  sys.exit(__import__("pytest").main([__file__, "-q", "-p", "no:cacheprovider"]))
