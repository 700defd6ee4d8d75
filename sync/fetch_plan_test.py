"""Tests for catch-up planning: fewest bytes between the delta chain and a snapshot jump."""

import sys

import pytest

from sync import fetch_plan
from sync import manifest as manifest_lib


def _index(entries):
  idx = manifest_lib.Index()
  idx.versions = dict(entries)
  idx.latest = max(entries)
  return idx


def test_short_gap_takes_the_chain():
  idx = _index({0: (None, 1000), 1: (10, None), 2: (10, None), 3: (10, None)})
  p = fetch_plan.plan(idx, 1)
  assert p.steps == [("delta", 2), ("delta", 3)] and p.bytes == 20


def test_long_gap_jumps_to_the_newest_snapshot():
  entries = {0: (None, 100)}
  entries.update({v: (30, None) for v in range(1, 10)})
  entries[8] = (30, 100)
  idx = _index(entries)
  p = fetch_plan.plan(idx, 2)  # chain 7*30=210 > snapshot 100 + delta 30
  assert p.steps == [("snapshot", 8), ("delta", 9)] and p.bytes == 130
  assert fetch_plan.plan(idx, 7).steps == [("delta", 8), ("delta", 9)]  # 60 < 130


def test_missing_delta_forces_snapshot_and_nothing_held():
  idx = _index({4: (None, 500), 5: (10, None), 7: (10, None), 6: (None, None)})
  assert fetch_plan.plan(idx, 5, target=5).steps == []
  with pytest.raises(fetch_plan.PlanError):
    fetch_plan.plan(idx, 5)  # 6 has no delta, no snapshot after it
  idx.versions[6] = (None, 300)
  assert fetch_plan.plan(idx, 5).steps == [("snapshot", 6), ("delta", 7)]
  assert fetch_plan.plan(idx, None, target=5).steps == [("snapshot", 4), ("delta", 5)]
  assert fetch_plan.plan(idx, 5, avoid_deltas_from=5).steps == [("snapshot", 6), ("delta", 7)]
  with pytest.raises(fetch_plan.PlanError):
    fetch_plan.plan(manifest_lib.Index(), None)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
