"""Tests for publishing, restore, retention GC, atomic publish and publisher restart."""

import sys

import pytest

from sync import fetch_plan
from sync import manifest as manifest_lib
from sync import publisher
from sync import store as store_lib
from sync import testing
from sync import weights


def _publish(tmp_path, n, **kw):
  st = store_lib.Store(str(tmp_path))
  pub = publisher.Publisher(st, chunk_elems=testing.CHUNK, **kw)
  hist = testing.history(n)
  reports = [pub.publish(w) for w in hist]
  return st, pub, hist, reports


def test_deltas_snapshots_and_restore_any_retained_version(tmp_path):
  st, pub, hist, reports = _publish(tmp_path, 7, snapshot_every=3, keep_snapshots=5)
  assert [r.snapshot for r in reports] == [True, False, False, True, False, False, True]
  assert reports[0].delta_bytes is None and all(r.delta_bytes for r in reports[1:])
  assert all(r.raw_bytes / r.delta_bytes > 20 for r in reports[1:])
  for v in range(7):
    flat, got = publisher.restore(st, v)
    assert got == v and testing.same_bits(flat, hist[v])
  m = publisher.read_manifest(st, 5)
  assert (m.parent, m.parent_digest) == (4, weights.digest(hist[4], testing.CHUNK))
  assert m.digest == weights.digest(hist[5], testing.CHUNK)
  assert publisher.read_index(st).latest == 6 == pub.version


def test_a_version_in_another_dtype_or_layout_is_refused(tmp_path):
  # Samplers hold the published layout in the sampler's dtype: a version that changes it (a
  # learner restarted with another sampler_dtype) would ship whole tensors and hand them
  # another dtype, so it is refused, by a restarted publisher too, and nothing is written.
  st, pub, hist, _ = _publish(tmp_path, 2)
  as_f32 = {k: v.astype("float32") for k, v in hist[1].items()}
  with pytest.raises(ValueError, match=r"'embed': bfloat16 \(64, 33\) there, float32"):
    pub.publish(as_f32)
  restarted = publisher.Publisher(st, chunk_elems=testing.CHUNK)
  with pytest.raises(ValueError, match="does not have the published version 1's tensors"):
    restarted.publish(as_f32)
  fewer = {k: v for k, v in hist[1].items() if k != "embed"}
  with pytest.raises(ValueError, match=r"'embed': bfloat16 \(64, 33\) there, absent here"):
    restarted.publish(fewer)
  assert publisher.read_index(st).latest == 1 and not st.exists(manifest_lib.manifest_key(2))
  assert not restarted.publish(hist[1]).snapshot  # the same layout: a delta as before


def test_gc_keeps_the_newest_snapshots_and_what_follows(tmp_path):
  st, pub, hist, _ = _publish(tmp_path, 8, snapshot_every=2, keep_snapshots=2)
  index = publisher.read_index(st)
  assert sorted(index.versions) == [4, 5, 6, 7]
  assert not st.list(manifest_lib.version_dir(3)) and st.list(manifest_lib.version_dir(4))
  with pytest.raises(fetch_plan.PlanError):
    publisher.restore(st, 3)
  flat, _ = publisher.restore(st, 5)
  assert testing.same_bits(flat, hist[5])


def test_objects_without_index_entry_are_invisible(tmp_path):
  """A publish that died before writing the index leaves the old version current."""
  st, _, hist, _ = _publish(tmp_path, 2, snapshot_every=10)
  st.put(manifest_lib.delta_key(2), b"half-written")
  flat, v = publisher.restore(st)
  assert v == 1 and testing.same_bits(flat, hist[1])


def test_publisher_resumes_after_restart(tmp_path):
  st, pub, hist, _ = _publish(tmp_path, 3, snapshot_every=10)
  more = testing.history(5)
  pub2 = publisher.Publisher(st, snapshot_every=10, chunk_elems=testing.CHUNK)
  assert pub2.version == 2
  r = pub2.publish(more[4])
  assert r.version == 3 and not r.snapshot
  flat, _ = publisher.restore(st, 3)
  assert testing.same_bits(flat, more[4])


def test_manifest_roundtrip_and_validation():
  m = manifest_lib.Manifest(version=3, digest="d", chunk_elems=8, tensors={"a": ["float32", [2]]},
                            parent=2, parent_digest="p",
                            delta=manifest_lib.ObjectRef("k", 10, 99))
  assert manifest_lib.Manifest.from_bytes(m.to_bytes()) == m
  with pytest.raises(manifest_lib.ManifestError):
    manifest_lib.Manifest.from_bytes(b"{not json")
  bad = manifest_lib.Manifest(version=3, digest="d", chunk_elems=8, tensors={})
  with pytest.raises(manifest_lib.ManifestError):
    manifest_lib.Manifest.from_bytes(bad.to_bytes())


def test_snapshot_requests_are_answered_and_bad_ones_dropped(tmp_path):
  st, pub, hist, _ = _publish(tmp_path, 3, snapshot_every=10)
  assert pub.answer_requests() is None  # none pending
  st.put(manifest_lib.snapshot_request_key("garbled"), b"{not json")
  publisher.request_snapshot(st, "s0", 2, "delta 2 damaged")
  publisher.request_snapshot(st, "s1", 9, "past the newest: waits for a publish")
  assert publisher.read_manifest(st, 2).snapshot is None
  assert pub.answer_requests() == 2
  m = publisher.read_manifest(st, 2)
  assert m.snapshot and m.delta is not None  # the delta is kept, a snapshot added
  assert publisher.read_index(st).versions[2][1] == m.snapshot_bytes
  assert st.list(manifest_lib.SNAPSHOT_REQUESTS) == [manifest_lib.snapshot_request_key("s1")]
  st.delete(manifest_lib.delta_key(1))  # restore now needs the added snapshot
  flat, v = publisher.restore(st, 2)
  assert v == 2 and testing.same_bits(flat, hist[2])
  with pytest.raises(ValueError):
    manifest_lib.snapshot_request_key("../x")


def test_index_naming_an_unlisted_latest_is_malformed():
  with pytest.raises(manifest_lib.ManifestError):
    manifest_lib.Index.from_bytes(b'{"latest": 4, "versions": [[3, 10, null]]}')


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
