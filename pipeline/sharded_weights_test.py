"""The weight sync of a learner of several processes (pipeline/sharded_weights.py), in one process:
two learner processes as threads with a barrier publish their blocks through
`ShardedWeightChannel`, a sampler's `ShardedFollower` (as `processes.wait_for_weights` gives it)
hands over whole tensors equal to the model's, each version's figures reach the step metrics,
/health's check names a follower left behind or a dead sync thread, and a store of one kind
refuses a learner of the other. The real learner processes: tools/rl_part_multihost_test.py."""

import sys
import threading

import numpy as np
import pytest

from moe import checkpoint as moe_checkpoint
from pipeline import learner_loop
from pipeline import processes
from pipeline import sharded_weights
from pipeline import testing
from sync import publisher as publisher_lib
from sync import store as store_lib
from testlib import waiting

TIMEOUT_S = 60


def _model(version: int) -> dict:
  rng = np.random.default_rng(version)
  return {"w": rng.normal(size=(4, 6)).astype(np.float32),
          "b": rng.normal(size=(3,)).astype(np.float32)}


def _blocks(flat: dict, part: int) -> list:
  """Part 0 holds rows 0-1 of w and all of b, part 1 rows 2-3 of w (as two processes of a mesh
  would: each block once)."""
  w = flat["w"]
  if part == 0:
    return [("b", ((0, 3),), (3,), flat["b"]), ("w", ((0, 2), (0, 6)), (4, 6), w[:2])]
  return [("w", ((2, 4), (0, 6)), (4, 6), w[2:])]


class _Learner:
  """Two learner processes' channels as threads meeting at a barrier."""

  def __init__(self, url: str):
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    self.channels = [sharded_weights.ShardedWeightChannel(
        url, part=p, parts=2, barrier=barrier.wait, model_cfg=testing.MODEL,
        answer_requests_s=None) for p in range(2)]

  def publish(self, version: int) -> list:
    flat = _model(version)
    reports, errors = [None, None], []

    def one(p):
      try:
        reports[p] = self.channels[p].publish(_blocks(flat, p), version)
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    threads = [threading.Thread(target=one, args=(p,)) for p in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(TIMEOUT_S)
    assert not errors, errors
    return reports


def test_a_follower_assembles_what_the_learner_processes_published(tmp_path):
  url = "file://" + str(tmp_path / "weights")
  learner = _Learner(url)
  with pytest.raises(RuntimeError, match="learner version 1 does not follow the published None"):
    learner.channels[0].publish(_blocks(_model(1), 0), 1)
  reports = learner.publish(0)
  assert [r.shards for r in reports] == [2, 1]
  assert reports[0].manifest is not None and reports[1].manifest is None  # process 0 writes it
  # Version 0 is stored whole: its fetched bytes are unknown per process, so not reported.
  m0 = learner_loop.publish_metrics(reports[0])
  assert m0["publish_delta"] == 0 and m0["publish_raw_bytes"] == (3 + 12) * 4
  assert "publish_bytes" not in m0 and "publish_ratio" not in m0
  assert sharded_weights.published(store_lib.Store(url)) == (0, True)

  # A sampler starting now finds the sharded store and holds whole tensors of version 0.
  store, follower = processes.wait_for_weights(url, timeout_s=TIMEOUT_S, name="s")
  assert isinstance(follower, sharded_weights.ShardedFollower) and follower.version == 0
  for name, want in _model(0).items():
    np.testing.assert_array_equal(follower.weights[name], want)
  cfg = moe_checkpoint.config_from_json(
      sharded_weights.manifest_info(store, 0, sharded=True)["model_config"])
  assert cfg == testing.MODEL

  # Then it follows new versions into its apply_fn (a sampler's engine swap).
  applied = []
  follower.apply_fn = lambda flat, v: applied.append((v, flat))
  m1 = learner_loop.publish_metrics(learner.publish(1)[0])
  assert m1["publish_delta"] == 1 and m1["publish_bytes"] > 0
  assert follower.poll().version == 1 and follower.poll() is None
  assert [v for v, _ in applied] == [1] and follower.weights is None
  for name, want in _model(1).items():
    np.testing.assert_array_equal(applied[0][1][name], want)
  assert follower.health_problem(max_behind_versions=0, max_stale_s=0) is None


def test_a_sampler_follows_a_sharded_store_through_a_relay(tmp_path):
  """The relays move the blocks of a sharded store like any other object: a follower reading
  through a relay assembles the same tensors and follows new versions."""
  work = str(tmp_path / "work")
  learner = _Learner(processes.paths(work)["weights"])
  learner.publish(0)
  port, stop = testing.free_port(), threading.Event()
  relay = threading.Thread(target=processes.run_relay, args=(work,),
                           kwargs=dict(port=port, stop=stop), daemon=True)
  relay.start()
  source = processes.weight_source(work, [f"http://127.0.0.1:{port}"])
  try:
    store, follower = processes.wait_for_weights(source, timeout_s=TIMEOUT_S, name="s")
    assert isinstance(follower, sharded_weights.ShardedFollower) and follower.version == 0
    for name, want in _model(0).items():
      np.testing.assert_array_equal(follower.weights[name], want)
    applied = []
    follower.apply_fn = lambda flat, v: applied.append((v, flat))
    learner.publish(1)
    waiting.wait_until(lambda: follower.poll() is not None or applied,
                       "the follower to reach version 1 through the relay", timeout_s=TIMEOUT_S)
    assert [v for v, _ in applied] == [1]
    for name, want in _model(1).items():
      np.testing.assert_array_equal(applied[0][1][name], want)
    assert store is source
  finally:
    source.close()  # Its HTTP session and connections, before the relay goes.
    stop.set()
    relay.join(TIMEOUT_S)


# The sync thread ends on the SystemExit it is made to die of, which pytest reports as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_names_a_follower_left_behind_and_a_dead_sync_thread(tmp_path):
  url = "file://" + str(tmp_path / "weights")
  learner = _Learner(url)
  learner.publish(0)
  _, follower = processes.wait_for_weights(url, timeout_s=TIMEOUT_S, name="s")

  def refuse(flat, version):
    raise RuntimeError("engine refused the weights")
  follower.apply_fn = refuse
  stop = threading.Event()
  t = threading.Thread(target=follower.run, args=(stop, 0.01), daemon=True)
  t.start()
  try:
    learner.publish(1)
    learner.publish(2)
    def behind_with_its_error():
      # A poll records the published version before its apply fails: wait for both.
      p = follower.health_problem(max_behind_versions=1, max_stale_s=0)
      return p if p and "last error" in p else None
    problem = waiting.wait_until(
        behind_with_its_error,
        "the follower's health to name the versions it is behind and why", timeout_s=TIMEOUT_S)
    assert "serving sharded version 0, 2 behind the published 2" in problem
    assert "engine refused the weights" in problem
    assert follower.health_problem(max_behind_versions=2, max_stale_s=0) is None
  finally:
    stop.set()
    t.join(TIMEOUT_S)
  assert follower.thread_state == "stopped" and follower.health_problem() is None

  def die(flat, version):
    raise SystemExit("the sampler shut down")
  follower.apply_fn = die
  dead = threading.Thread(target=follower.run, args=(threading.Event(), 0.01), daemon=True)
  dead.start()
  dead.join(TIMEOUT_S)
  assert "the sync thread died: SystemExit: the sampler shut down" in follower.health_problem()


def test_a_store_of_one_kind_refuses_a_learner_of_the_other(tmp_path):
  plain_url = "file://" + str(tmp_path / "plain")
  publisher_lib.Publisher(store_lib.Store(plain_url)).publish(_model(0))
  assert sharded_weights.published(store_lib.Store(plain_url)) == (0, False)
  with pytest.raises(ValueError, match=r"holds unsharded versions .*\(a learner of several "
                     r"processes\)"):
    _Learner(plain_url)
  sharded_url = "file://" + str(tmp_path / "sharded")
  _Learner(sharded_url).publish(0)
  with pytest.raises(ValueError, match=r"holds sharded versions .*\(a learner of one process\)"):
    sharded_weights.check_kind(store_lib.Store(sharded_url), sharded=False)
  assert sharded_weights.published(store_lib.Store("file://" + str(tmp_path / "new"))) == (
      None, False)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
