"""Tests for the public delta interface: bit-exact round trips and rejection of bad blobs."""

import io
import struct
import sys

import ml_dtypes
import numpy as np
import pytest

from sync import delta
from sync import synthetic
from sync import weights
from sync.delta import api

BF16 = ml_dtypes.bfloat16


def _same_bits(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
      np.array_equal(weights.words(a[k]), weights.words(b[k])) for k in a)


def _pair(seed=0, frac=0.04):
  master = synthetic.init_master({"a/w": (300, 700), "a/b": (700,), "c": (3, 5, 7)}, seed)
  base = synthetic.cast(master)
  synthetic.rl_step(master, frac, seed + 1)
  return base, synthetic.cast(master)


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.04, 0.25, 1.0])
def test_roundtrip_bit_exact(dtype, frac):
  master = synthetic.init_master({"x/w": (257, 129), "x/b": (129,)}, 3)
  base = synthetic.cast(master, dtype)
  synthetic.rl_step(master, frac, 4)
  new = synthetic.cast(master, dtype)
  if frac == 1.0:  # every element changes by arbitrary bits
    new = {k: (weights.words(v) ^ np.random.default_rng(0).integers(
        1, 1 << 15, v.size).astype(weights.words(v).dtype)).view(dtype).reshape(v.shape)
           for k, v in base.items()}
  blob = delta.encode(base, new, chunk_elems=4096)
  assert _same_bits(delta.decode(base, blob), new)


def test_specials_nan_payloads_and_signed_zero():
  base = {"t": np.array([0.0, -0.0, np.inf, np.nan, 1.0, -1.0], np.float32)}
  bits = np.array([0x80000000, 0x00000000, 0x7FC00001, 0xFFC00123, 0x3F800001, 0x00000001],
                  np.uint32)
  new = {"t": bits.view(np.float32)}
  assert _same_bits(delta.decode(base, delta.encode(base, new)), new)


def test_new_removed_reshaped_empty_and_scalar_tensors():
  base = {"keep": np.ones((4, 4), BF16), "gone": np.ones(3, np.float32),
          "reshaped": np.ones((2, 6), np.float16)}
  new = {"keep": np.full((4, 4), 2, BF16), "added": np.arange(10, dtype=np.float32),
         "reshaped": np.ones((3, 4), np.float16), "empty": np.zeros((0, 5), BF16),
         "scalar": np.array(1.5, np.float32)}
  out = delta.decode(base, delta.encode(base, new))
  assert _same_bits(out, new)


def test_digests_and_streaming_paths_agree():
  base, new = _pair()
  sink = io.BytesIO()
  stats = delta.encode_to(sink, base, new, chunk_elems=10_000, workers=3)
  blob = sink.getvalue()
  assert stats.blob_bytes == len(blob) and stats.ratio > 20
  assert stats.parent_digest == weights.digest(base, 10_000)
  assert stats.digest == weights.digest(new, 10_000)
  assert delta.read_trailer(blob) == (stats.parent_digest, stats.digest)
  out, dstats = delta.decode_stream(base, io.BytesIO(blob), workers=2,
                                    expect_parent=stats.parent_digest)
  assert _same_bits(out, new) and dstats.digest == stats.digest
  # Deterministic whatever the thread count.
  assert delta.encode(base, new, chunk_elems=10_000, workers=1) == blob


def test_decode_into_recycled_buffers():
  base, new = _pair()
  bufs = {k: np.empty_like(v) for k, v in new.items()}
  bufs["a/b"] = np.empty(3, BF16)  # does not fit: allocated instead
  out = delta.decode(base, delta.encode(base, new), out=bufs)
  assert _same_bits(out, new)
  assert out["a/w"] is bufs["a/w"] and out["a/b"] is not bufs["a/b"]
  with pytest.raises(ValueError):
    delta.decode(base, delta.encode(base, new), out=base)


def test_decode_reuses_the_memory_of_dropped_results_only():
  """A decode loop (`w = decode(w, blob)`) ping-pongs between two sets of buffers, and no
  result ever shares memory with a live one (the base, or a result still held)."""
  delta.release_buffers()
  m = synthetic.init_master({"a/w": (300, 700), "a/b": (700,)}, 5)
  versions = [synthetic.cast(m)]
  for step in range(5):
    synthetic.rl_step(m, 0.04, 10 + step)
    versions.append(synthetic.cast(m))
  blobs = [delta.encode(a, b) for a, b in zip(versions, versions[1:])]
  w, seen = versions[0], set()
  held = delta.decode(versions[0], blobs[0])  # a result the caller keeps
  for i, blob in enumerate(blobs):
    nxt = delta.decode(w, blob)
    assert _same_bits(nxt, versions[i + 1])
    for k in nxt:
      assert not np.shares_memory(nxt[k], w[k]) and not np.shares_memory(nxt[k], held[k])
    seen.add(nxt["a/w"].__array_interface__["data"][0])
    w = nxt
  assert len(seen) == 2
  assert _same_bits(held, versions[1])  # never overwritten
  fresh = delta.decode(versions[0], blobs[0], recycle=False)
  assert fresh["a/w"].__array_interface__["data"][0] not in seen
  delta.release_buffers()


def test_decode_does_not_touch_base():
  base, new = _pair()
  before = {k: v.copy() for k, v in base.items()}
  delta.decode(base, delta.encode(base, new))
  assert _same_bits(base, before)


def test_every_corrupted_byte_is_rejected():
  base, new = _pair(frac=0.05)
  blob = delta.encode(base, new, chunk_elems=50_000)
  rng = np.random.default_rng(0)
  positions = set(rng.integers(0, len(blob), 300).tolist())
  positions |= set(range(0, 80)) | set(range(len(blob) - 90, len(blob)))
  for p in sorted(positions):
    bad = bytearray(blob)
    bad[p] ^= 1 << int(rng.integers(0, 8))
    with pytest.raises(delta.DeltaError):
      delta.decode(base, bytes(bad))


def test_truncated_blob_is_rejected():
  base, new = _pair()
  blob = delta.encode(base, new, chunk_elems=50_000)
  for n in [0, 5, 20, len(blob) // 3, len(blob) // 2, len(blob) - 1]:
    with pytest.raises(delta.DeltaError):
      delta.decode(base, blob[:n])
  with pytest.raises(delta.DeltaError):
    delta.decode(base, blob + b"x")


def _records(blob):
  """Splits a blob into (header, [record bytes], trailer)."""
  (n,) = struct.unpack_from("<I", blob, len(delta.MAGIC))
  pos = len(delta.MAGIC) + 4 + n
  head, recs = blob[:pos], []
  while blob[pos:pos + len(delta.END_MAGIC)] != delta.END_MAGIC:
    plen = struct.unpack_from("<Q", blob, pos + 12)[0]
    end = pos + api._REC.size + api._CHECK.size + plen  # pylint: disable=protected-access
    recs.append(blob[pos:end])
    pos = end
  return head, recs, blob[pos:]


def test_reordered_or_spliced_records_are_rejected():
  base, new = _pair()
  blob = delta.encode(base, new, chunk_elems=50_000)
  head, recs, tail = _records(blob)
  assert len(recs) > 3
  swapped = recs[:]
  swapped[1], swapped[2] = swapped[2], swapped[1]
  with pytest.raises(delta.DeltaError, match="order"):
    delta.decode(base, head + b"".join(swapped) + tail)
  # A record from another version's blob at the same position (spliced).
  _, new2 = _pair(seed=7)
  _, recs2, _ = _records(delta.encode(base, new2, chunk_elems=50_000))
  spliced = recs[:1] + recs2[1:2] + recs[2:]
  with pytest.raises(delta.DeltaError):
    delta.decode(base, head + b"".join(spliced) + tail)


def test_foreign_delta_wrong_parent_or_shapes_is_rejected():
  base, new = _pair()
  blob = delta.encode(base, new)
  other_base, _ = _pair(seed=11)  # same names and shapes, other values
  with pytest.raises(delta.DeltaError, match="parent"):
    delta.decode(other_base, blob)
  wrong_shape = dict(base, **{"a/b": np.zeros(701, BF16)})
  with pytest.raises(delta.DeltaError, match="does not fit"):
    delta.decode(wrong_shape, blob)
  wrong_dtype = dict(base, **{"a/b": base["a/b"].astype(np.float32)})
  with pytest.raises(delta.DeltaError, match="does not fit"):
    delta.decode(wrong_dtype, blob)
  missing = {k: v for k, v in base.items() if k != "c"}
  with pytest.raises(delta.DeltaError):
    delta.decode(missing, blob)
  with pytest.raises(delta.DeltaError, match="expected"):
    delta.decode(base, blob, expect_parent="0" * 32)
  with pytest.raises(delta.DeltaError):
    delta.decode(base, b"not a blob at all")


def _copy(flat):
  return {k: v.copy() for k, v in flat.items()}


@pytest.mark.parametrize("frac", [0.0, 0.04, 0.25, 0.9])
def test_apply_inplace_is_bit_exact_and_writes_into_base(frac):
  base, new = _pair(frac=frac)
  new["added"] = np.arange(5, dtype=np.float32)  # stored RAW: a new array
  held = _copy(base)
  arrays = dict(held)
  out, stats = delta.apply_inplace(held, delta.encode(base, new, chunk_elems=20_000),
                                   workers=2, verify_base=frac > 0.5)
  assert _same_bits(out, new) and stats.digest == weights.digest(new, 20_000)
  assert all(out[k] is arrays[k] for k in base)
  assert held.keys() == base.keys()  # the mapping itself is not modified


def test_apply_inplace_rejects_damage_without_touching_base():
  base, new = _pair(frac=0.05)
  blob = delta.encode(base, new, chunk_elems=50_000)
  rng = np.random.default_rng(1)
  for p in sorted(set(rng.integers(0, len(blob), 60).tolist()) | {len(blob) - 5}):
    bad = bytearray(blob)
    bad[p] ^= 1 << int(rng.integers(0, 8))
    held = _copy(base)
    with pytest.raises(delta.DeltaError):
      delta.apply_inplace(held, bytes(bad))
    assert _same_bits(held, base)
  held = _copy(base)
  with pytest.raises(delta.DeltaError):
    delta.apply_inplace(held, blob[:len(blob) // 2])
  with pytest.raises(delta.DeltaError, match="expected"):
    delta.apply_inplace(held, blob, expect_parent="0" * 32)
  assert _same_bits(held, base)


def test_apply_inplace_on_a_foreign_base_rolls_back_every_chunk():
  base, new = _pair()
  blob = delta.encode(base, new, chunk_elems=20_000)
  other, _ = _pair(seed=11)  # same names and shapes, other values
  other["a/w"][0, :100] = base["a/w"][0, :100]  # partly equal: some chunks apply cleanly
  held = _copy(other)
  with pytest.raises(delta.DeltaError, match="parent.*rolled back"):
    delta.apply_inplace(held, blob, workers=2)
  assert _same_bits(held, other)
  with pytest.raises(delta.DeltaError, match="parent"):
    delta.apply_inplace(held, blob, verify_base=True)
  assert _same_bits(held, other)


@pytest.mark.parametrize("frac", [0.0, 0.04, 0.25, 0.9])
def test_apply_inplace_checked_by_changes_is_bit_exact(frac):
  base, new = _pair(frac=frac)
  blob = delta.encode(base, new, chunk_elems=20_000)
  held = _copy(base)
  out, stats = delta.apply_inplace(held, blob, workers=2,
                                   expect_parent=weights.digest(base, 20_000))
  assert _same_bits(out, new) and stats.digest == weights.digest(new, 20_000)
  with pytest.raises(ValueError, match="expect_parent"):
    delta.apply_inplace(held, blob, check="changes")
  with pytest.raises(ValueError, match="check must be"):
    delta.apply_inplace(held, blob, check="none")


def test_apply_inplace_checked_by_changes_rejects_damage_and_wrong_bits():
  base, new = _pair(frac=0.05)
  blob = delta.encode(base, new, chunk_elems=20_000)
  parent = weights.digest(base, 20_000)
  rng = np.random.default_rng(2)
  for p in sorted(set(rng.integers(0, len(blob), 40).tolist())):
    bad = bytearray(blob)
    bad[p] ^= 1 << int(rng.integers(0, 8))
    held = _copy(base)
    with pytest.raises(delta.DeltaError):
      delta.apply_inplace(held, bytes(bad), expect_parent=parent)
    assert _same_bits(held, base)
  # Held bits that differ from the parent at a changed element: caught, everything rolled back.
  changed = np.flatnonzero(weights.words(base["a/w"]) != weights.words(new["a/w"]))
  held = _copy(base)
  weights.words(held["a/w"])[changed[len(changed) // 2]] ^= 1
  before = _copy(held)
  with pytest.raises(delta.DeltaError, match="parent.*rolled back.*changes hash"):
    delta.apply_inplace(held, blob, workers=2, expect_parent=parent)
  assert _same_bits(held, before)
  # At an unchanged element only the full result check sees it (the caller vouched wrongly).
  same = np.flatnonzero(weights.words(base["a/w"]) == weights.words(new["a/w"]))
  held = _copy(base)
  weights.words(held["a/w"])[same[0]] ^= 1
  before = _copy(held)
  with pytest.raises(delta.DeltaError, match="rolled back"):
    delta.apply_inplace(held, blob, expect_parent=parent, check="result")
  assert _same_bits(held, before)


def test_changes_check_hashes_busy_chunks_whole_and_still_rolls_back():
  """Sparse chunks with more than _CHANGES_HASH_LIMIT of their elements changed are checked
  by xxh3 of the result under check="changes" too: bit-exact, and a wrong base is caught."""
  base, new = _pair(frac=0.15)
  blob = delta.encode(base, new, chunk_elems=20_000)
  kinds = delta.decode_stream(base, blob)[1].chunks
  assert kinds == {"sparse_unit": 13} and api._CHANGES_HASH_LIMIT < 0.13
  parent = weights.digest(base, 20_000)
  held = _copy(base)
  assert _same_bits(delta.apply_inplace(held, blob, expect_parent=parent)[0], new)
  same = np.flatnonzero(weights.words(base["a/w"]) == weights.words(new["a/w"]))
  held = _copy(base)
  weights.words(held["a/w"])[same[0]] ^= 1  # even at an unchanged element: hashed whole
  before = _copy(held)
  with pytest.raises(delta.DeltaError, match="rolled back"):
    delta.apply_inplace(held, blob, workers=2, expect_parent=parent)
  assert _same_bits(held, before)


def test_format_2_blobs_still_decode_and_kinds_are_checked_per_format(monkeypatch):
  base, new = _pair()
  from sync.delta import codec  # pylint: disable=g-import-not-at-top
  with monkeypatch.context() as m:  # what the format-2 encoder wrote: SPARSE records
    m.setattr(api, "FORMAT", 2)
    m.setattr(codec, "_MAX_EXCEPTIONS", -1)
    old = delta.encode(base, new, chunk_elems=50_000)
  assert delta.read_header(old)["format"] == 2
  out, stats = delta.decode_stream(base, old)
  assert _same_bits(out, new) and set(stats.chunks) == {"sparse"}
  held = _copy(base)
  delta.apply_inplace(held, old, expect_parent=weights.digest(base, 50_000))
  assert _same_bits(held, new)
  with monkeypatch.context() as m:  # a format-2 header over SPARSE_UNIT records
    m.setattr(api, "FORMAT", 2)
    mixed = delta.encode(base, new, chunk_elems=50_000)
  with pytest.raises(delta.DeltaError, match="not valid in format 2"):
    delta.decode(base, mixed)
  held = _copy(base)
  with pytest.raises(delta.DeltaError, match="not valid in format 2"):
    delta.apply_inplace(held, mixed)
  assert _same_bits(held, base)
  with monkeypatch.context() as m:
    m.setattr(api, "FORMAT", 9)
    future = delta.encode(base, new, chunk_elems=50_000)
  with pytest.raises(delta.DeltaError, match="unsupported format 9"):
    delta.decode(base, future)


@pytest.mark.parametrize("frac", [0.04, 0.3])
def test_reverse_undoes_an_applied_delta_and_checks_what_it_holds(frac):
  base, new = _pair(frac=frac)
  new["added"] = np.arange(5, dtype=np.float32)  # stored whole: left out when reversing
  blob = delta.encode(base, new, chunk_elems=20_000)
  held = _copy(base)
  out, _ = delta.apply_inplace(held, blob, expect_parent=weights.digest(base, 20_000))
  assert _same_bits(out, new)
  back, _ = delta.apply_inplace(held, blob, reverse=True, workers=2)
  assert _same_bits(held, base) and back.keys() == base.keys()
  assert all(back[k] is held[k] for k in base)
  # Held arrays that are not the blob's new version (here: the parent): rejected, untouched.
  with pytest.raises(delta.DeltaError, match="new version.*rolled back"):
    delta.apply_inplace(held, blob, reverse=True)
  assert _same_bits(held, base)
  with pytest.raises(ValueError, match="reverse"):
    delta.apply_inplace(held, blob, reverse=True, check="changes", expect_parent="0" * 32)


def test_apply_inplace_rejects_unusable_buffers():
  base, new = _pair()
  blob = delta.encode(base, new)
  ro = _copy(base)
  ro["a/b"].flags.writeable = False
  with pytest.raises(ValueError, match="writable"):
    delta.apply_inplace(ro, blob)
  flat = np.zeros(300 * 700 + 700, BF16)  # one buffer sliced into tensors is fine ...
  held = dict(base, **{"a/w": flat[:300 * 700].reshape(300, 700), "a/b": flat[300 * 700:]})
  held["a/w"][...] = base["a/w"]
  held["a/b"][...] = base["a/b"]
  assert _same_bits(delta.apply_inplace(held, blob)[0], new)
  aliased = dict(held, **{"a/b": held["a/w"].reshape(-1)[:700]})  # ... overlapping is not
  with pytest.raises(ValueError, match="share memory"):
    delta.apply_inplace(aliased, delta.encode(aliased, new))


def test_beats_plain_xor_zstd_on_rl_like_update():
  import zstandard  # pylint: disable=g-import-not-at-top
  master = synthetic.init_master({"w": (1024, 1024)}, 5)
  base = synthetic.cast(master)
  synthetic.rl_step(master, 0.04, 6)
  new = synthetic.cast(master)
  xor = weights.words(base["w"]) ^ weights.words(new["w"])
  plain = len(zstandard.ZstdCompressor(level=1).compress(xor.tobytes()))
  ours = len(delta.encode(base, new))
  assert plain / ours > 1.8, (plain, ours)
  assert new["w"].nbytes / ours > 40


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
