"""Tests for the delta kernels' on-disk cache and their warm-up at a sampler's start-up.

The timing test runs in fresh interpreters (a process that already compiled the kernels would
prove nothing). Its bound: with a warm cache and the start-up warm-up, a process's first pass
(`sync.bench.first_apply`: 2M parameters, every chunk form) may take at most 0.5 s and at most
5x the later passes' median plus 50 ms. Measured here at load 3-4 on 2 cores: 22 ms first vs
8 ms later; without the warm-up (kernels loaded from the cache inside the first pass) 0.68 s;
without the cache, 6.4 s (compiling), so both failures are caught. The kernels' results are
covered by the kernel and codec tests, which run through the cache too.
"""

import json
import os
import subprocess
import sys

import pytest

from sync import bench
from sync.delta import jit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_MAX_S = 0.5
FIRST_VS_SECOND = 5.0
SLACK_S = 0.05


def _run(code: str, cache_dir, *args, timeout=600) -> dict:
  env = dict(os.environ, SYNC_KERNEL_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
  res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.strip().splitlines()[-1])


def test_numba_is_installed():
  assert jit.HAVE_NUMBA  # pinned in requirements.txt: the cache tests below need it


def test_first_apply_in_a_process_with_a_warm_cache_costs_what_later_ones_do(tmp_path):
  # bench.first_apply: every chunk form a sampler meets (bf16 SPARSE_UNIT and DENSE_UNIT, fp32
  # SPARSE), applied in place (check "changes" and "result") and decoded into new arrays.
  fill = bench.first_apply_in_process(str(tmp_path))  # compiles and fills the cache
  assert fill["cache_dir"].startswith(str(tmp_path)) and fill["cache_misses"] > 0
  assert os.listdir(fill["cache_dir"]), "numba wrote nothing to the cache directory"
  got = bench.first_apply_in_process(str(tmp_path))
  assert set(got["chunks"]) >= {"sparse_unit", "dense_unit", "sparse"}, got["chunks"]
  assert got["cache_misses"] == 0 and got["cache_hits"] > 0, got  # loaded, not compiled
  assert got["compiled_in_first"] == 0, got  # warm_up readied every kernel the pass ran
  assert got["first_s"] < FIRST_MAX_S, got
  assert got["first_s"] <= FIRST_VS_SECOND * got["later_s"] + SLACK_S, got
  assert got["warm_up_s"] < fill["warm_up_s"], (got, fill)


def test_a_subscriber_readies_the_kernels_before_its_first_delta(tmp_path):
  # A sampler's subscriber warms the kernels when it is made, so its first update compiles
  # nothing (loaded from the cache filled by the first run here).
  code = r"""
import json, sys
from sync import publisher, store, subscriber
from sync import testing as sync_testing
from sync import bench
from sync.delta import jit
versions = sync_testing.history(3)
st = store.Store(sys.argv[1])
pub = publisher.Publisher(st, chunk_elems=sync_testing.CHUNK)
pub.publish(versions[0])
assert jit.compiled_signatures() == 0, "something compiled the kernels before the subscriber"
sub = subscriber.Subscriber(st, lambda flat, v: None, name="s")
ready = jit.compiled_signatures()
sub.restore()  # version 0 is a snapshot: no delta applied yet
pub.publish(versions[1])
pub.publish(versions[2])
before = jit.compiled_signatures()
report = sub.poll()
print(json.dumps({"ready": ready, "before": before, "after": jit.compiled_signatures(),
                  "steps": report.steps, "warm_up_s": sub.warm_up_s}))
"""
  _run(code, tmp_path, str(tmp_path / "store1"))
  got = _run(code, tmp_path, str(tmp_path / "store2"))
  assert got["steps"] == [["delta", 1], ["delta", 2]], got
  assert got["ready"] > 0, got
  assert got["after"] == got["before"] == got["ready"], got


def test_cache_directory_choice(tmp_path, monkeypatch):
  monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
  monkeypatch.setenv(jit.ENV, str(tmp_path / "chosen"))
  assert jit._cache_dir() == str(tmp_path / "chosen" / jit.source_tag())
  for off in ("", "0", "off"):
    monkeypatch.setenv(jit.ENV, off)
    assert jit._cache_dir() is None
  monkeypatch.delenv(jit.ENV)
  blocked = tmp_path / "file"
  blocked.write_text("not a directory")  # unwritable as a directory: the next one is taken
  monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocked))
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert jit._cache_dir() == str(tmp_path / "xdg" / "sync-delta-kernels" / jit.source_tag())


def test_njit_refuses_a_cache_option():
  with pytest.raises(ValueError, match="chooses the cache"):
    jit.njit(cache=False)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
