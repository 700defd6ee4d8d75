"""Weight-sync faults between the learner and a sampler (issue #17, items 2 and 3): a delta
damaged in the store, a torn INDEX.json, and `/health` naming a sampler whose weights are stale.

The sampler is the real one: a rollout Engine fed by a sync.Subscriber through
pipeline.local.swap_into, in this process and as a `processes.run_sampler` child process; the
learner's side is the real pipeline.local.WeightChannel (a sync.Publisher that answers snapshot
requests). Faults are placed deterministically: a delta is damaged as it is written (the manifest
keeps the good bytes' hash), the index is torn by writing half of it over the file.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe import build
from moe import params as moe_params
from moe.tokenizer import ByteTokenizer
from pipeline import local
from pipeline import testing
from rollout import testing as rollout_testing
from rollout.engine import Engine
from sync import manifest as manifest_lib
from sync import publisher as publisher_lib
from sync import subscriber as subscriber_lib
from testlib import waiting

TIMEOUT_S = 300.0  # bound on each wait; the machine may be loaded, a hang still fails


def _versions(n):
  """n distinct flat weight sets of the tiny pipeline model (what the learner publishes)."""
  return [moe_params.flatten(build.create(testing.MODEL, seed=s)) for s in range(n)]


def _workdir_channel(tmp_path):
  work = str(tmp_path / "work")
  url = "file://" + os.path.join(os.path.abspath(work), "weights")
  return work, local.WeightChannel(url, model_cfg=testing.MODEL)


def _damage_when_written(store, version):
  """Makes `store` damage `version`'s delta as it is written (one flipped byte), as a bad disk
  or a broken copy would: the manifest still names the good bytes' size and hash."""
  key = manifest_lib.delta_key(version)
  put = store.put

  def damaging(k, data):
    if k == key:
      data = data[:64] + bytes([data[64] ^ 1]) + data[65:]
    put(k, data)
  store.put = damaging


def _tear_index(work):
  path = os.path.join(work, "weights", manifest_lib.INDEX_KEY)
  whole = open(path, "rb").read()
  with open(path, "wb") as f:  # not atomic: what a half-done copy leaves
    f.write(whole[:len(whole) // 2])


def _until(cond, what, timeout=TIMEOUT_S):
  """Polls cond() until it is true; fails naming `what` after `timeout` seconds."""
  t0 = time.monotonic()
  while True:
    got = cond()
    if got:
      return got
    assert time.monotonic() - t0 < timeout, f"timed out after {timeout:.0f} s waiting for {what}"
    time.sleep(0.05)


def _health(port):
  """(status, body) of GET /health."""
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


class _InProcessSampler:
  """An Engine + Subscriber (+ its sync thread once started) on the channel's store."""

  def __init__(self, channel, flat0, **sub_kw):
    self.engine = Engine.from_flat(flat0, testing.MODEL, config=testing.ENGINE, version=0,
                                   tokenizer=ByteTokenizer())
    self.sub = subscriber_lib.Subscriber(channel.store, local.swap_into(self.engine), **sub_kw)
    self.sub.adopt(flat0, 0, publisher_lib.read_manifest(channel.store, 0).digest)
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self.sub.run, args=(self.stop, 0.02),
                                   kwargs={"max_backoff_s": 0.2}, daemon=True)

  def close(self):
    self.stop.set()
    if self.thread.is_alive():
      self.thread.join(timeout=60)
    self.engine.stop()


def test_in_process_sampler_gets_past_a_damaged_delta_and_a_torn_index(tmp_path):
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(5)
  channel.publish(ws[0], 0)
  s = _InProcessSampler(channel, ws[0])
  try:
    # Item 2: delta 1 is damaged and no snapshot follows it (snapshot_every=20); the learner then
    # publishes nothing (it waits for data). The sampler asks; the channel answers with a
    # snapshot of version 2, and the engine serves version 2.
    _damage_when_written(channel.store, 1)
    channel.publish(ws[1], 1)
    channel.publish(ws[2], 2)
    s.thread.start()
    _until(lambda: s.engine.version == 2, "the engine to reach version 2 past damaged delta 1")
    r = s.sub.reports[-1]
    assert r.fallback and r.skipped == ["delta 1"] and r.steps == [("snapshot", 2)]
    assert s.sub.fallbacks == 1 and channel.publisher.requested_snapshots == 1
    assert all((s.sub.weights[k] == ws[2][k]).all() for k in ws[2])
    # Item 3: INDEX.json torn; polls fail and are retried, the thread stays up, and once the
    # next publish rewrites the index the engine moves on.
    errors = s.sub.errors
    _tear_index(work)
    _until(lambda: s.sub.errors > errors, "a poll to fail on the torn index")
    assert s.thread.is_alive() and s.sub.thread_state == "running"
    channel.publish(ws[3], 3)
    _until(lambda: s.engine.version == 3, "the engine to reach version 3 after the tear")
    assert s.sub.health_problem(max_behind_versions=0, max_stale_s=60) is None
  finally:
    s.close()
    channel.publisher.close()


def test_health_is_503_while_the_sampler_is_stale_beyond_the_bound(tmp_path):
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(3)
  channel.publish(ws[0], 0)
  s = _InProcessSampler(channel, ws[0], request_snapshot=False)
  live = rollout_testing.LiveServer(s.engine, health_checks=[
      lambda: s.sub.health_problem(max_behind_versions=1, max_stale_s=0.0)])
  try:
    assert _health(live.port)[0] == 200
    _damage_when_written(channel.store, 1)
    channel.publish(ws[1], 1)
    channel.publish(ws[2], 2)
    with pytest.raises(subscriber_lib.SyncError):
      s.sub.poll()  # stuck at 0 behind damaged delta 1 (and it only waits: no request)
    status, body = _health(live.port)
    assert status == 503 and body["policy_version"] == 0, body
    assert any("serving version 0, 2 behind the published 2" in p for p in body["problems"])
    # A snapshot past the damage (asked for by someone else) lets it catch up: healthy again.
    publisher_lib.request_snapshot(channel.store, "operator", 1, "test")
    _until(lambda: not channel.store.list(manifest_lib.SNAPSHOT_REQUESTS),
           "the channel to answer the snapshot request")
    assert s.sub.poll().version == 2
    assert _health(live.port) == (200, {"status": "ok", "policy_version": 2})
  finally:
    live.close()
    s.close()
    channel.publisher.close()


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _start_sampler_process(tmp_path, work):
  """(process, its log path, health()) of a `run_sampler` child on a free port; health() fails
  the test if the process has exited, and is None while it does not answer yet."""
  port = _free_port()
  log_path = str(tmp_path / "sampler.log")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             PYTHONUNBUFFERED="1")
  code = textwrap.dedent(f"""
      import logging
      logging.basicConfig(level=logging.WARNING)
      from pipeline import processes
      processes.run_sampler({work!r}, port={port}, max_slots=8, max_len=128,
                            stale_versions=0, stale_s=1.0)
      """)
  with open(log_path, "w") as log_file:
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log_file,
                            stderr=subprocess.STDOUT, start_new_session=True)

  def health():
    assert proc.poll() is None, "sampler exited:\n" + open(log_path).read()[-3000:]
    try:
      return _health(port)
    except OSError:
      return None
  return proc, log_path, health


def test_sampler_process_gets_past_a_damaged_delta_and_reports_a_torn_index(tmp_path):
  """The same faults against a `run_sampler` child process, observed through its /health."""
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(5)
  channel.publish(ws[0], 0)
  proc, log_path, version = _start_sampler_process(tmp_path, work)
  try:
    _until(lambda: (version() or (0, {}))[1].get("policy_version") == 0, "the sampler to serve")
    _damage_when_written(channel.store, 1)
    channel.publish(ws[1], 1)
    channel.publish(ws[2], 2)
    _until(lambda: (version() or (0, {}))[1].get("policy_version") == 2,
           "the sampler process to reach version 2 past damaged delta 1")
    _tear_index(work)  # and it stays torn: /health must say the weights are going stale
    status, body = _until(lambda: (lambda h: h if h and h[0] == 503 else None)(version()),
                          "/health to answer 503 while the index is torn")
    assert any("no weight index read succeeded" in p and "bad index" in p
               for p in body["problems"]), body
    channel.publish(ws[3], 3)  # rewrites the index whole: the sync thread is still there
    _until(lambda: version() == (200, {"status": "ok", "policy_version": 3}),
           "the sampler to serve version 3, healthy, after the tear")
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    channel.publisher.close()
  out = open(log_path).read()
  assert "fell back to snapshot 2 to reach version 2" in out, out[-3000:]
  assert "poll failed (ManifestError: bad index" in out, out[-3000:]



def test_sampler_restarted_across_a_damaged_delta_starts_and_catches_up(tmp_path):
  """A sampler (re)started while delta 2 lies damaged between the newest snapshot (0) and the
  newest version (3): it used to fail to start (its restore chained through delta 2). It starts
  on version 1, says so, asks for a snapshot, and the channel's answer brings it to version 3."""
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(4)
  channel.publish(ws[0], 0)
  _damage_when_written(channel.store, 2)
  for v in range(1, 4):
    channel.publish(ws[v], v)
  proc, log_path, health = _start_sampler_process(tmp_path, work)
  try:
    _until(lambda: health() == (200, {"status": "ok", "policy_version": 3}),
           "the restarted sampler to serve version 3, healthy")
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    channel.publisher.close()
  out = open(log_path).read()
  assert "cannot restore the newest version 3 (damaged delta 2); restored version 1" in out, \
      out[-3000:]
  assert "fell back to snapshot 3 to reach version 3 from 1, skipping damaged delta 2" in out, \
      out[-3000:]
  assert channel.publisher.requested_snapshots == 1


def test_learner_restarted_across_a_damaged_delta_publishes_what_it_holds(tmp_path):
  """A learner (its WeightChannel's publisher) restarted while delta 2 is damaged cannot rebuild
  version 3, so its next version is a full snapshot, not a delta on weights it does not hold; a
  sampler stuck behind the damage then serves exactly the learner's weights."""
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(6)
  channel.publish(ws[0], 0)
  s = _InProcessSampler(channel, ws[0])
  _damage_when_written(channel.store, 2)
  for v in range(1, 4):
    channel.publish(ws[v], v)
  channel.publisher.close()  # the learner is killed
  with pytest.raises(subscriber_lib.SyncError):
    s.sub.poll()  # stuck at 0 behind delta 2 (and it asks for a snapshot)
  assert s.sub.version == 0 and s.sub.waiting_for_snapshot == 2
  restarted = local.WeightChannel(channel.store.url, model_cfg=testing.MODEL)
  try:
    assert restarted.latest() == 3
    report = restarted.publish(ws[4], 4)
    assert report.snapshot and report.delta_bytes is None
    r = s.sub.poll()
    assert r.version == 4 and r.steps == [("snapshot", 4)] and s.engine.version == 4
    assert all((s.sub.weights[k] == ws[4][k]).all() for k in ws[4]) and \
        s.sub.weights.keys() == ws[4].keys()
    assert not restarted.publish(ws[5], 5).snapshot  # deltas again, on what it now holds
    r = s.sub.poll()
    assert r.steps == [("delta", 5)] and all((s.sub.weights[k] == ws[5][k]).all() for k in ws[5])
  finally:
    s.close()
    restarted.publisher.close()


class _RestoredLearner:
  """What LearnerLoop reads of a learner restored from its checkpoint at `step` (weights ws)."""

  def __init__(self, step, flat):
    self.step = self.policy_version = step
    self._flat = flat

  def sampler_weights(self):
    return self._flat, self.step


def test_restarted_learner_backs_its_publisher_so_stuck_samplers_get_a_snapshot(tmp_path):
  """The restarted learner's LearnerLoop hands its checkpointed weights (version 3 == step 3) to
  the publisher that could not rebuild version 3, which then answers the stuck sampler's snapshot
  request while the learner is idle (waiting for that sampler's data): no deadlock."""
  from pipeline.learner_loop import LearnerLoop
  work, channel = _workdir_channel(tmp_path)
  ws = _versions(4)
  channel.publish(ws[0], 0)
  s = _InProcessSampler(channel, ws[0])
  _damage_when_written(channel.store, 2)
  for v in range(1, 4):
    channel.publish(ws[v], v)
  channel.publisher.close()  # the learner is killed
  with pytest.raises(subscriber_lib.SyncError):
    s.sub.poll()
  assert s.sub.waiting_for_snapshot == 2
  restarted = local.WeightChannel(channel.store.url, model_cfg=testing.MODEL)
  try:
    assert not restarted.publisher.holds_latest
    assert restarted.publisher.answer_requests() is None  # nothing to answer with yet
    loop = LearnerLoop(_RestoredLearner(3, ws[1]), batcher=None, publish=restarted.publish,
                       published_version=restarted.latest, hold=restarted.hold)
    loop.run(3)  # wrong weights for version 3: refused (digest), still holds nothing
    assert not restarted.publisher.holds_latest
    loop = LearnerLoop(_RestoredLearner(3, ws[3]), batcher=None, publish=restarted.publish,
                       published_version=restarted.latest, hold=restarted.hold)
    loop.run(3)  # already at its last step: it only takes stock, and backs the publisher
    assert restarted.publisher.holds_latest
    def reached():
      try:
        s.sub.poll()
      except subscriber_lib.SyncError:
        pass  # still stuck: the snapshot is not written yet
      return s.engine.version == 3

    waiting.wait_until(reached, "the stuck sampler to reach version 3 through the answered "
                       "snapshot", timeout_s=120)
    assert all((s.sub.weights[k] == ws[3][k]).all() for k in ws[3])
  finally:
    s.close()
    restarted.publisher.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
