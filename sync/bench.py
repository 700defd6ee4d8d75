"""Weight-sync benchmark library: our delta codec vs plain XOR+zstd vs memcpy, same run.

What: `measure(base, new)` times `delta.encode`/`delta.decode` (the public interface, so the
chunked parallel paths are what is measured), a plain baseline (XOR of bit patterns, zstd
level 1 per tensor, XOR back on decode) and `np.copy` of the weights, and returns ratios and
GB/s (model bytes per second). `synthetic_pairs` builds RL-like updates (see `synthetic`);
`load_flat` reads real checkpoints (orbax directories or .npz) so two consecutive learner
checkpoints can be measured the same way. `terabyte_report` feeds the measured per-core rates
into the simulator. `tools/bench_sync.py` is the command-line entry point.
"""

import dataclasses
import os
import time

import ml_dtypes
import numpy as np
import zstandard

from sync import delta
from sync import sim
from sync import synthetic
from sync import weights


@dataclasses.dataclass
class Row:
  label: str
  params: int
  changed: float
  ratio: float
  encode_GBps: float
  decode_GBps: float
  xor_ratio: float
  xor_encode_GBps: float
  xor_decode_GBps: float
  memcpy_GBps: float
  workers: int
  decode_fresh_GBps: float = 0.0  # decode into newly allocated arrays
  memcpy_fresh_GBps: float = 0.0  # np.copy into newly allocated arrays


def _best(fn, repeats):
  best, out = float("inf"), None
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t)
  return best, out


def xor_zstd_encode(base, new, level=1):
  c = zstandard.ZstdCompressor(level=level)
  return {k: c.compress((weights.words(base[k]) ^ weights.words(new[k])).tobytes())
          for k in sorted(new)}


def xor_zstd_decode(base, blobs):
  d = zstandard.ZstdDecompressor()
  out = {}
  for k, b in blobs.items():
    w = weights.words(base[k])
    x = np.frombuffer(d.decompress(b), w.dtype)
    out[k] = np.bitwise_xor(w, x).view(base[k].dtype).reshape(base[k].shape)
  return out


def measure(base: dict, new: dict, label: str = "", repeats: int = 2, workers=None) -> Row:
  """Times ours, the XOR+zstd baseline and memcpy on one (base, new) pair; checks exactness."""
  nb = weights.nbytes(new)
  elems = sum(a.size for a in new.values())
  changed = sum(int(np.count_nonzero(weights.words(base[k]) != weights.words(new[k])))
                for k in new if k in base)
  w = workers or min(8, os.cpu_count() or 1)
  te, blob = _best(lambda: delta.encode(base, new, workers=w), repeats)
  # Steady state on a sampler: decode into the buffers of the version before last (warm pages).
  bufs = {k: np.ones_like(v) for k, v in new.items()}
  td, out = _best(lambda: delta.decode(base, blob, workers=w, out=bufs), repeats)
  for k in new:
    if not np.array_equal(weights.words(out[k]), weights.words(new[k])):
      raise AssertionError(f"decode is not bit-exact at {k}")
  tm, _ = _best(lambda: [np.copyto(bufs[k], v) for k, v in new.items()], repeats)
  del out, bufs
  tdf, _ = _best(lambda: delta.decode(base, blob, workers=w), 1)
  tmf, _ = _best(lambda: {k: np.copy(v) for k, v in new.items()}, 1)
  txe, xb = _best(lambda: xor_zstd_encode(base, new), repeats)
  txd, _ = _best(lambda: xor_zstd_decode(base, xb), repeats)
  return Row(label, elems, changed / max(1, elems), nb / len(blob), nb / te / 1e9,
             nb / td / 1e9, nb / sum(len(b) for b in xb.values()), nb / txe / 1e9,
             nb / txd / 1e9, nb / tm / 1e9, w, nb / tdf / 1e9, nb / tmf / 1e9)


def synthetic_pairs(params: int, fractions, seed: int = 0):
  """Yields (label, base, new) bf16 pairs with RL-like updates at each changed fraction."""
  master = synthetic.init_master(synthetic.model_sizes(params), seed)
  base = synthetic.cast(master)
  for i, f in enumerate(fractions):
    m = {k: v.copy() for k, v in master.items()}
    synthetic.rl_step(m, f, seed + 1 + i)
    yield f"synthetic bf16, {f:.0%} target", base, synthetic.cast(m)
    del m


def _flatten(tree, prefix=""):
  out = {}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}/"))
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      out.update(_flatten(v, f"{prefix}{i}/"))
  elif tree is not None:
    out[prefix[:-1]] = np.asarray(tree)
  return out


def load_flat(path: str, dtype=None) -> dict:
  """A flat weight dict from an .npz file or an orbax PyTree checkpoint directory.

  Args:
    path: `*.npz` (keys are the names) or an orbax checkpoint directory (nested keys are
      '/'-joined).
    dtype: if given (e.g. ml_dtypes.bfloat16), floating tensors are cast to it, as the sampler
      would (the learner's checkpoints hold fp32 masters).
  """
  if path.endswith(".npz"):
    with np.load(path) as z:
      flat = {k: z[k] for k in z.files}
    # .npz has no bf16: ml_dtypes arrays come back as 2-byte voids; they were bf16.
    flat = {k: v.view(ml_dtypes.bfloat16) if v.dtype.kind == "V" and v.itemsize == 2 else v
            for k, v in flat.items()}
  else:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    flat = _flatten(ocp.PyTreeCheckpointer().restore(os.path.abspath(path)))
  if dtype is not None:
    flat = {k: v.astype(dtype) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v
            for k, v in flat.items()}
  return flat


def from_checkpoints(path1: str, path2: str, dtype=None, **kw) -> Row:
  """Measures the delta between two checkpoints (e.g. consecutive learner steps)."""
  base, new = load_flat(path1, dtype), load_flat(path2, dtype)
  return measure(base, new, label=f"{os.path.basename(path1)} -> {os.path.basename(path2)}",
                 **kw)


def terabyte_report(row: Row, cores_here: int | None = None, **kw) -> dict:
  """The simulator's 1 TB / four-cluster answer from a measured row's per-core rates."""
  cores = cores_here or row.workers
  enc, dec = row.encode_GBps * 1e9 / cores, row.decode_GBps * 1e9 / cores
  out = {}
  for mode in (False, True):
    r = sim.simulate(sim.terabyte_four_clusters(enc, dec, row.ratio, apply_delta_only=mode,
                                                **kw))
    out["delta scatter on device" if mode else "full shard swap"] = {
        "end_to_end_s": r.end_to_end_s, "max_pause_s": r.max_pause_s,
        "delta_GB": r.delta_bytes / 1e9, "per_cluster_s": r.per_cluster()}
  return out


def markdown(rows) -> str:
  head = ("| update | changed | ours ratio | ours enc GB/s | ours dec GB/s | XOR+zstd ratio | "
          "XOR+zstd enc GB/s | XOR+zstd dec GB/s | memcpy GB/s | ours dec / memcpy into new "
          "arrays GB/s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
  return head + "".join(
      f"| {r.label} | {r.changed:.2%} | {r.ratio:.1f}x | {r.encode_GBps:.2f} | "
      f"{r.decode_GBps:.2f} | {r.xor_ratio:.1f}x | {r.xor_encode_GBps:.2f} | "
      f"{r.xor_decode_GBps:.2f} | {r.memcpy_GBps:.2f} | "
      f"{r.decode_fresh_GBps:.2f} / {r.memcpy_fresh_GBps:.2f} |\n" for r in rows)
