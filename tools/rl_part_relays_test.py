"""Relays found by name are followed when they move (#21): a sampler reads its weights through
`--weights_via=@relay_1`, relay_1 pulls from `--upstream=@relay_0`, and each relay is stopped and
started again on another port, its new address written to the launcher's address file, as the
Ray executor does for a relay placed again on another node. The sampler's weight source and
relay_1 re-resolve the names (tools/rl_part's `@job` resolution through launch.discovery, the
code path of a part under either executor) when no relay answers, and reach every new version;
a source given the same names without re-resolution stays stuck on the old address.

No JAX and no Ray: the weight source, the relays and the subscriber the sampler uses, over a
small synthetic model (a few seconds).
"""

import sys
import threading
import urllib.request

import pytest

from launch import discovery
from pipeline import processes
from sync import publisher
from sync import store as store_lib
from sync import subscriber
from sync import testing as sync_testing
from sync import transport
from testlib import waiting
from tools import rl_part

# The `@job` resolution of rl_part's flags (--weights_via, --upstream), as its parts use it.
_resolver = rl_part._resolver  # pylint: disable=protected-access
_url = rl_part._url  # pylint: disable=protected-access
_urls = rl_part._urls  # pylint: disable=protected-access


class _Relays:
  """relay_0 (the origin, over the store) and relay_1 (pulling from @relay_0), each a
  processes.run_relay thread as `rl_part relay` runs it; `move(name)` restarts one elsewhere."""

  def __init__(self, workdir: str, jobs_file: str):
    self.workdir, self.jobs_file = workdir, jobs_file
    self.table = {"sampler_0": {"host": "127.0.0.1", "port": discovery.free_port()}}
    self.running = {}

  def start(self, name: str) -> None:
    port = discovery.free_port()
    self.table[name] = {"host": "127.0.0.1", "port": port}
    discovery.write_jobs_file(self.jobs_file, self.table, work_unit=0)
    upstream = "@relay_0" if name == "relay_1" else ""
    stop = threading.Event()
    t = threading.Thread(target=processes.run_relay, args=(self.workdir,), kwargs=dict(
        port=port, upstream=_urls(upstream) or None, stop=stop,
        resolve_upstream=_resolver(upstream)), daemon=True)
    t.start()
    self.running[name] = (stop, t)
    waiting.wait_until(lambda: _answers(port), f"{name} serving on {port}", timeout_s=30)

  def move(self, name: str) -> None:
    stop, t = self.running.pop(name)
    stop.set()
    t.join(10)
    self.start(name)

  def close(self) -> None:
    for stop, t in self.running.values():
      stop.set()
      t.join(10)


def _answers(port: int) -> bool:
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/o/INDEX.json", timeout=2):
      return True
  except OSError:
    return False


def _reached(sub, version: int) -> bool:
  try:
    sub.poll()
  except subscriber.SyncError:
    pass
  return sub.version == version


def test_a_sampler_and_a_relay_follow_relays_that_moved(tmp_path, monkeypatch):
  workdir = str(tmp_path / "work")
  jobs_file = str(tmp_path / "jobs.json")
  monkeypatch.setenv(discovery.JOBS_JSON, jobs_file)
  monkeypatch.setenv(discovery.JOB_NAME, "sampler_0")
  st = store_lib.Store(processes.paths(workdir)["weights"])
  pub = publisher.Publisher(st, chunk_elems=sync_testing.CHUNK, snapshot_every=100)
  hist = sync_testing.history(3)
  pub.publish(hist[0])
  relays = _Relays(workdir, jobs_file)
  try:
    relays.start("relay_0")
    relays.start("relay_1")
    # The sampler's source, as rl_part builds it from --weights_via=@relay_1.
    source = processes.weight_source(workdir, _urls("@relay_1"),
                                     _resolver("@relay_1"))
    stuck = transport.HttpSource(_urls("@relay_1"), timeout_s=10.0, attempts=2)
    _, sub = processes.wait_for_weights(source, timeout_s=30, name="sampler-test")
    _, stuck_sub = processes.wait_for_weights(stuck, timeout_s=30, name="stuck")
    assert sub.version == stuck_sub.version == 0
    applied = []
    sub.apply_fn = lambda flat, v: applied.append(v)  # the engine's swap, in run_sampler
    stuck_sub.apply_fn = lambda flat, v: None

    # relay_0 moves: relay_1 follows it to reach version 1.
    relays.move("relay_0")
    pub.publish(hist[1])
    waiting.wait_until(lambda: _reached(sub, 1),
                       "the sampler reaching version 1 through relay_1", timeout_s=20)
    assert sub.version == 1 and sync_testing.same_bits(sub.weights, hist[1])
    assert source.moves == 0  # relay_1 itself did not move

    # relay_1 moves: the sampler's source follows it to reach version 2 ...
    relays.move("relay_1")
    pub.publish(hist[2])
    waiting.wait_until(lambda: _reached(sub, 2),
                       "the sampler reaching version 2 through the moved relay_1", timeout_s=20)
    assert sync_testing.same_bits(sub.weights, hist[2])
    assert source.moves == 1 and source.urls == [_url("@relay_1")]
    assert applied == [1, 2]
    # ... and one that does not re-resolve names is left at the old address.
    with pytest.raises((subscriber.SyncError, transport.HttpError)):
      stuck_sub.poll()
    assert stuck_sub.version == 0
    source.close()
    stuck.close()
  finally:
    relays.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
