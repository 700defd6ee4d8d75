"""Trajectory shards: names, writer_index stamping, a reused writer continuing its stream, and the
reader's rule for a hole in a writer's sequence (rl.rl_data.TrajectorySource)."""

import os
import sys

import numpy as np
import pytest

from rl import rl_data
from rl import trajectory_io
from rl.episodes import Episode


def _ep(i):
  return Episode(group_id=f"g{i}", reward=1.0, tokens=np.arange(4, dtype=np.int32),
                 loss_mask=np.array([0, 1, 1, 1], np.int32),
                 behaviour_logprobs=np.zeros(4, np.float32),
                 policy_versions=np.zeros(4, np.int32))


def test_names_and_writer_index(tmp_path):
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "ctl-17", records_per_shard=2) as w:
    w.write_all([_ep(i) for i in range(5)])
  names = trajectory_io.list_shards(d)
  assert names == [trajectory_io.shard_name("ctl-17", j) for j in range(3)]
  assert trajectory_io.parse_name(names[2]) == ("ctl-17", 2)
  with pytest.raises(ValueError, match="not a trajectory shard name"):
    trajectory_io.parse_name("ctl-17-3.msgpack")
  recs = [trajectory_io.read_shard(os.path.join(d, n)) for n in names]
  assert [[r[trajectory_io.INDEX_KEY] for r in s] for s in recs] == [[0, 1], [2, 3], [4]]
  assert [trajectory_io.first_index(s) for s in recs] == [0, 2, 4]
  # A writer reusing the id continues both its sequence and its index.
  with trajectory_io.TrajectoryWriter(d, "ctl-17", records_per_shard=2) as w:
    w.write(_ep(5))
  last = trajectory_io.read_shard(os.path.join(d, trajectory_io.shard_name("ctl-17", 3)))
  assert last[0][trajectory_io.INDEX_KEY] == 5
  assert trajectory_io.missing_before(names[2], {"ctl-17": 0}) == names[:2]
  assert trajectory_io.missing_before(names[2], {"ctl-17": 2}) == []
  assert trajectory_io.missing_before(names[0], {}) == []


def test_a_hole_is_reported_with_its_record_count_or_raises(tmp_path):
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "a", records_per_shard=3) as w:
    w.write_all([_ep(i) for i in range(9)])
  os.remove(os.path.join(d, trajectory_io.shard_name("a", 1)))
  items = list(rl_data.TrajectorySource(d, on_missing="report"))
  lost = [it for it in items if "lost" in it]
  assert lost == [{"loc": ["a-00000001.msgpack", -1], "record": None,
                   "lost": {"shards": ["a-00000001.msgpack"], "records": 3}}]
  assert [it["record"]["group_id"] for it in items if "lost" not in it] == [
      "g0", "g1", "g2", "g6", "g7", "g8"]
  with pytest.raises(rl_data.MissingShardError, match=r"a-00000001.msgpack.*3 records"):
    list(rl_data.TrajectorySource(d))


def test_a_lost_tail_is_seen_through_the_writers_progress(tmp_path):
  """The last shards of a stream have no later shard to reveal them: the writer's progress file
  does. A following reader waits for them, then counts them as lost, and reads on when the
  writer goes on (which continues after the lost shards, not over them)."""
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "a", records_per_shard=2) as w:
    w.write_all([_ep(i) for i in range(6)])
  assert trajectory_io.read_progress(d) == {"a": {"next_seq": 3, "next_index": 6}}
  os.remove(os.path.join(d, trajectory_io.shard_name("a", 2)))
  os.remove(os.path.join(d, trajectory_io.shard_name("a", 1)))
  items = list(rl_data.TrajectorySource(d, on_missing="report"))
  assert [it["record"]["group_id"] for it in items if "lost" not in it] == ["g0", "g1"]
  assert [it["lost"] for it in items if "lost" in it] == [
      {"shards": ["a-00000001.msgpack", "a-00000002.msgpack"], "records": 4}]
  with pytest.raises(rl_data.MissingShardError, match=r"end of writer a's stream.*4 records"):
    list(rl_data.TrajectorySource(d))
  # A restarted writer with the same id continues after what it recorded, not over it.
  with trajectory_io.TrajectoryWriter(d, "a", records_per_shard=2) as w:
    w.write_all([_ep(i) for i in range(6, 8)])
  assert trajectory_io.list_shards(d) == ["a-00000000.msgpack", "a-00000003.msgpack"]
  # A following reader: counts the tail as lost after its timeout, then reads the new shard.
  it = iter(rl_data.TrajectorySource(d, on_missing="report", follow=True, poll_interval_s=0.01,
                                     missing_timeout_s=0.05))
  got = [next(it) for _ in range(5)]
  assert [g["record"]["group_id"] if "lost" not in g else "lost" for g in got] == [
      "g0", "g1", "lost", "g6", "g7"]


def test_a_shard_published_while_the_reader_looks_is_not_reported_missing(tmp_path, monkeypatch,
                                                                           caplog):
  """The reader lists the shards, then reads the progress files. A shard the writer publishes
  in between is counted in its progress but absent from the listing: it is late, not missing,
  and must not be reported as a hole (this warned in every agentic calibration run)."""
  d = str(tmp_path)
  with trajectory_io.TrajectoryWriter(d, "a", records_per_shard=2) as w:
    w.write_all([_ep(i) for i in range(4)])
  real = trajectory_io.list_shards
  calls = []

  def listing(directory):
    calls.append(1)
    names = real(directory)
    # The reader's second look (after reading shard 0) runs just before shard 1 lands.
    return [n for n in names if n != trajectory_io.shard_name("a", 1)] if len(calls) == 2 \
        else names
  monkeypatch.setattr(trajectory_io, "list_shards", listing)
  it = iter(rl_data.TrajectorySource(d, on_missing="report", follow=True, poll_interval_s=0.01,
                                     missing_timeout_s=30.0))
  with caplog.at_level("WARNING", logger="rl.rl_data"):
    got = [next(it)["record"]["group_id"] for _ in range(4)]
  assert got == ["g0", "g1", "g2", "g3"]
  assert len(calls) >= 3  # the stale listing was seen
  assert not [r for r in caplog.records if "missing" in r.getMessage()], caplog.text


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
