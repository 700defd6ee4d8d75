"""//tools:serve's start-up: it listens, warms up (a log line per program, /health 503 until the
last is compiled, then a "ready" line on stdout), and keeps JAX's persistent compilation cache
in --compilation_cache_dir, so that a second start loads every program instead of compiling it;
--no_warmup is ready at once.

Each start is its own process (`python -m tools.serve`, this test's import path): JAX decides
once per process whether the persistent cache is used.
"""

import json
import os
import queue
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

WAIT_S = 600  # a process that imports JAX, builds an engine and compiles its programs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Deterministic, 2 slots, a context of 32, one prompt per prefill: 4 programs (prefills after
# a cached prefix of 0 or 1 blocks for prompt buckets 16 and 32, one decode shape, each
# returning top logprobs, and one prefix-cache copy).
ARGS = ["--gin_file=moe/configs/tiny.gin", "--gin_file=tools/configs/runs/serve.gin",
        "--deterministic", "--max_slots=2", "--max_len=32", "--gin.EngineConfig.prefill_rows=1",
        "--port=0", "--admin_port=-1", "--warmup_threads=1"]
READY = re.compile(r"rollout server ready: warm-up took ([\d.]+) s for (\d+) programs "
                   r"\((\d+) compiled, (\d+) loaded from the persistent compilation cache\)")


class _Serve:
  """`python -m tools.serve ARGS` with its stdout lines in a queue and its stderr in a file."""

  def __init__(self, args, stderr_path):
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_ADMIN_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    self._stderr = open(stderr_path, "w+")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen([sys.executable, "-m", "tools.serve", *args],
                                 stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
                                 cwd=ROOT)
    self._lines = queue.Queue()
    threading.Thread(target=lambda: [self._lines.put(x) for x in self.proc.stdout]
                     + [self._lines.put(None)], daemon=True).start()

  def stderr(self) -> str:
    self._stderr.flush()
    self._stderr.seek(0)
    return self._stderr.read()

  def next_line(self) -> str:
    """The next stdout line; AssertionError (with stderr) if none comes within WAIT_S."""
    try:
      line = self._lines.get(timeout=WAIT_S)
    except queue.Empty:
      line = None
    if line is None:
      raise AssertionError(f"//tools:serve printed no further line within {WAIT_S} s (exit "
                           f"{self.proc.poll()}); stderr:\n{self.stderr()[-4000:]}")
    return line.rstrip("\n")

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
    self.proc.wait(WAIT_S)
    self._stderr.close()


def _health(port) -> tuple:
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _port(line: str) -> str:
  m = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", line)
  assert m, line
  return m.group(1)


def test_a_restart_loads_the_warm_up_from_the_persistent_cache(tmp_path):
  cache = tmp_path / "xla"
  runs = []
  for i in range(2):
    srv = _Serve(ARGS + [f"--compilation_cache_dir={cache}"], tmp_path / f"serve{i}.stderr")
    try:
      port = _port(srv.next_line())
      if i == 0:  # compiling 4 programs takes far longer than this request
        status, body = _health(port)
        assert status == 503 and body["status"] == "warming_up", body
      m = READY.fullmatch(srv.next_line())
      assert m, "no ready line"
      assert _health(port) == (200, {"status": "ok", "policy_version": 0})
      err = srv.stderr()
    finally:
      srv.close()
    assert f"persistent compilation cache: {cache}" in err
    assert "warm-up: compiling 4 device programs (2 extend, 1 decode, 1 copy)" in err
    assert all(f"warm-up: compiled {k}/4: " in err for k in range(1, 5))
    runs.append((float(m.group(1)), *(int(g) for g in m.groups()[1:])))
  (s1, n1, compiled1, hits1), (s2, n2, compiled2, hits2) = runs
  assert (n1, compiled1, hits1) == (4, 4, 0)
  assert (n2, compiled2, hits2) == (4, 0, 4)  # nothing compiled: all loaded
  assert s2 < s1
  assert os.listdir(cache)


def test_no_warmup_is_ready_at_once(tmp_path):
  srv = _Serve(ARGS + ["--no_warmup", "--compilation_cache_dir="], tmp_path / "serve.stderr")
  try:
    port = _port(srv.next_line())
    assert _health(port) == (200, {"status": "ok", "policy_version": 0})
    err = srv.stderr()
  finally:
    srv.close()
  assert "persistent compilation cache: off" in err and "warm-up" not in err


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
