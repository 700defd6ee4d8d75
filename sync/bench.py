"""Weight-sync benchmark library: our delta codec vs plain XOR+zstd vs memcpy, same run.

What: `measure(base, new, workers=N)` times, interleaved and repeated (medians), through the
public interface (so the chunked parallel paths are what is measured):
  * `delta.encode`, and a plain baseline: XOR of bit patterns, zstd level 1 per tensor;
  * `delta.apply_inplace` into a held copy of `base`, proven by hashing every rebuilt chunk
    (check="result") and by the changes hashes with the held version named (check="changes",
    what `Subscriber(inplace=True)` does on a sampler), against memcpy of the new weights into
    those same held buffers;
  * `delta.decode` (the issue's interface: its output memory comes from results dropped
    earlier, see `buffers`) and `delta.decode(..., out=buffers)` against the same memcpy;
    `delta.decode(..., recycle=False)` into freshly allocated arrays against `np.copy` into
    new arrays (first-touch page faults dominate both); and the XOR+zstd decode.
Every baseline runs on the same N threads as the codec (the caller's among them, through
`parallel.map_all`, as the codec runs): memcpy into held buffers is split into
`weights.CHUNK_ELEMS` slices taken from a shared counter, the copy into new arrays and
XOR+zstd spread whole tensors (one zstd frame each, so the ratio
does not depend on N) over the threads, each with its own zstd contexts. Why not zstd's own
`threads=`: it parallelizes only the compression of one frame, not the XOR and not the
decompression. So a row's ratio "ours / baseline" compares like with like; `workers=1` gives
the single-thread rows of both sides.
GB/s are bytes of model weights per second. `synthetic_pairs` builds RL-like updates (see
`synthetic`); `load_flat` reads checkpoints (orbax directories or .npz) so two consecutive learner
checkpoints can be measured the same way; `tools/train_deltas.py` (apart from `sync/`: it drives
the learner) yields real consecutive versions. `terabyte_report` feeds the measured per-core rates
into `fanout_sim`. `first_apply` / `first_apply_in_process` time a fresh process's first delta
against its later ones (numba kernels compiled, loaded from the on-disk cache, or readied by
the warm-up a sampler runs at start-up). `tools/bench_sync.py` is the command-line entry point.
"""

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import zstandard

from sync import delta
from sync import fanout_sim
from sync import synthetic
from sync import weights
from sync.delta import codec
from sync.delta import jit
from sync.delta import parallel


@dataclasses.dataclass
class Row:
  """Medians over the repeats of one (base, new) pair; GB/s of model bytes."""
  label: str
  params: int
  changed: float  # fraction of elements whose bits changed
  ratio: float  # model bytes / delta blob bytes
  encode_GBps: float
  apply_GBps: float  # delta.apply_inplace into held weights, check="result"
  memcpy_GBps: float  # np.copyto of the new weights into the same held buffers, `workers` threads
  decode_GBps: float  # delta.decode(..., out=buffers of an earlier version)
  decode_fresh_GBps: float  # delta.decode(..., recycle=False): newly allocated arrays
  memcpy_fresh_GBps: float  # copy into newly allocated arrays, `workers` threads
  xor_ratio: float
  xor_encode_GBps: float
  xor_decode_GBps: float
  workers: int  # threads of every measurement in the row, ours and the baselines alike
  repeats: int
  kinds: dict = dataclasses.field(default_factory=dict)  # chunk kind -> count
  apply_changes_GBps: float = 0.0  # the same with expect_parent, check="changes"
  decode_pool_GBps: float = 0.0  # delta.decode(base, blob), the result dropped each repeat

  @property
  def decode_vs_memcpy(self) -> float:
    return self.decode_pool_GBps / self.memcpy_GBps

  @property
  def decode_out_vs_memcpy(self) -> float:
    return self.decode_GBps / self.memcpy_GBps

  @property
  def apply_vs_memcpy(self) -> float:
    return self.apply_GBps / self.memcpy_GBps

  @property
  def apply_changes_vs_memcpy(self) -> float:
    return self.apply_changes_GBps / self.memcpy_GBps


def _timed(fn):
  t = time.perf_counter()
  out = fn()
  return time.perf_counter() - t, out


@contextlib.contextmanager
def _threads(w: int):
  """A pool for `parallel.map_all` with `w` threads in all (none for one), per call as the
  codec makes its own, so thread start-up is counted on both sides."""
  if w <= 1:
    yield None
  else:
    with concurrent.futures.ThreadPoolExecutor(w - 1) as pool:
      yield pool


def _slices(flat, chunk_elems):
  """(name, slice) items covering every tensor in chunks, largest tensors first."""
  return [(k, slice(i, i + chunk_elems))
          for k in sorted(flat, key=lambda k: -flat[k].size)
          for i in range(0, max(1, flat[k].size), chunk_elems)]


def _copy_chunks(dst: dict, src: dict, workers: int, chunk_elems: int) -> dict:
  dw = {k: weights.words(dst[k]) for k in src}
  sw = {k: weights.words(v) for k, v in src.items()}

  def copy(item):
    k, s = item
    np.copyto(dw[k][s], sw[k][s])

  with _threads(workers) as pool:
    parallel.map_all(pool, copy, _slices(src, chunk_elems), workers)
  return dst


def memcpy_into(dst: dict, src: dict, workers: int = 1,
                chunk_elems: int = weights.CHUNK_ELEMS) -> dict:
  """np.copyto of every tensor of `src` into `dst`, split into chunks over `workers` threads."""
  return _copy_chunks(dst, src, workers, chunk_elems)


def memcpy_fresh(src: dict, workers: int = 1) -> dict:
  """np.copy of every tensor of `src` into a newly allocated array, whole tensors (largest
  first) spread over `workers` threads, so each array is first touched by the thread that
  copies it."""
  names = sorted(src, key=lambda k: -src[k].size)
  with _threads(workers) as pool:
    return dict(zip(names, parallel.map_all(pool, lambda k: np.copy(src[k]), names, workers)))


class _Zstd(threading.local):
  """Per-thread zstd contexts with the library defaults (no frame checksum), as a plain
  XOR+zstd user would write it."""

  def __init__(self, level=1):
    super().__init__()
    self.cctx = zstandard.ZstdCompressor(level=level)
    self.dctx = zstandard.ZstdDecompressor()


def xor_zstd_encode(base, new, level=1, workers: int = 1):
  """XOR of the bit patterns, one zstd frame per tensor; tensors spread over the threads."""
  local = _Zstd(level)
  names = sorted(new, key=lambda k: -new[k].size)

  def one(k):
    return local.cctx.compress(np.bitwise_xor(weights.words(base[k]), weights.words(new[k])))

  with _threads(workers) as pool:
    return dict(zip(names, parallel.map_all(pool, one, names, workers)))


def xor_zstd_decode(base, blobs, workers: int = 1):
  local = _Zstd()
  names = sorted(blobs, key=lambda k: -base[k].size)

  def one(k):
    w = weights.words(base[k])
    x = np.frombuffer(local.dctx.decompress(blobs[k]), w.dtype)
    return np.bitwise_xor(w, x).view(base[k].dtype).reshape(base[k].shape)

  with _threads(workers) as pool:
    return dict(zip(names, parallel.map_all(pool, one, names, workers)))


def _check_same(out, new, what):
  for k in new:
    if not np.array_equal(weights.words(out[k]), weights.words(new[k])):
      raise AssertionError(f"{what} is not bit-exact at {k}")


def measure(base: dict, new: dict, label: str = "", repeats: int = 5, workers=None) -> Row:
  """Times ours, the XOR+zstd baseline and memcpy on one (base, new) pair; checks exactness.

  Every repeat runs each measurement once, in the same order, so machine load affects all of
  them alike; the row holds medians. Every measurement, ours and the baselines, runs on the
  same `workers` threads (default: cores, at most 8).
  """
  nb = weights.nbytes(new)
  elems = sum(a.size for a in new.values())
  changed = sum(int(np.count_nonzero(weights.words(base[k]) != weights.words(new[k])))
                for k in new if k in base)
  w = parallel.workers(workers)
  codec.warm_up()  # numba compiles once per process: not part of any timing
  held = {k: v.copy() for k, v in base.items()}  # the sampler's one weight set
  bufs = {k: np.ones_like(v) for k, v in new.items()}  # a recycled second set
  t = {k: [] for k in ("enc", "apply", "apply_ch", "memcpy", "dec", "dec_pool", "dec_fresh",
                       "memcpy_fresh", "xenc", "xdec")}
  kinds = {}
  blob = xb = None
  for r in range(repeats):
    sink = io.BytesIO()
    dt, st = _timed(lambda: delta.encode_to(sink, base, new, workers=w))
    t["enc"].append(dt)
    blob, kinds = sink.getvalue(), st.chunks
    for k, v in base.items():  # reset the held weights to the parent (not timed)
      np.copyto(held[k], v)
    dt, (out, _) = _timed(lambda: delta.apply_inplace(held, blob, workers=w, check="result"))
    t["apply"].append(dt)
    if r == 0:
      _check_same(out, new, "apply_inplace")
    for k, v in base.items():
      np.copyto(held[k], v)
    dt, (out, _) = _timed(lambda: delta.apply_inplace(held, blob, workers=w,
                                                      expect_parent=st.parent_digest))
    t["apply_ch"].append(dt)
    if r == 0:
      _check_same(out, new, "apply_inplace(check='changes')")
    dt, out = _timed(lambda: memcpy_into(held, new, w))
    t["memcpy"].append(dt)
    if r == 0:
      _check_same(out, new, "memcpy_into")
    dt, out = _timed(lambda: delta.decode(base, blob, workers=w, out=bufs))
    t["dec"].append(dt)
    if r == 0:
      _check_same(out, new, "decode(out=)")
    del out
    dt, out = _timed(lambda: delta.decode(base, blob, workers=w))
    t["dec_pool"].append(dt)
    if r == 0:
      _check_same(out, new, "decode()")
    del out  # its memory is what the next repeat's decode() reuses
    t["dec_fresh"].append(_timed(lambda: delta.decode(base, blob, workers=w, recycle=False))[0])
    dt, out = _timed(lambda: memcpy_fresh(new, w))
    t["memcpy_fresh"].append(dt)
    if r == 0:
      _check_same(out, new, "memcpy_fresh")
    del out
    dt, xb = _timed(lambda: xor_zstd_encode(base, new, workers=w))
    t["xenc"].append(dt)
    dt, out = _timed(lambda: xor_zstd_decode(base, xb, workers=w))
    t["xdec"].append(dt)
    if r == 0:
      _check_same(out, new, "xor_zstd_decode")
    del out
  g = {k: nb / float(np.median(v)) / 1e9 for k, v in t.items()}
  return Row(label, elems, changed / max(1, elems), nb / len(blob), g["enc"], g["apply"],
             g["memcpy"], g["dec"], g["dec_fresh"], g["memcpy_fresh"],
             nb / sum(len(b) for b in xb.values()), g["xenc"], g["xdec"], w, repeats,
             dict(kinds), g["apply_ch"], g["dec_pool"])


def _first_apply_pair(params: int, seed: int = 0):
  """(base, new): every chunk form a sampler meets, for `first_apply`: half the parameters bf16
  with 2% changed by one ulp (SPARSE_UNIT), a quarter bf16 with 30% changed (DENSE_UNIT), a
  quarter fp32 with 2% changed by 1000 ulps (SPARSE)."""
  rng = np.random.default_rng(seed)
  cols = 1024
  base = {"a": rng.standard_normal((max(1, params // 2 // cols), cols)).astype(synthetic.BF16),
          "b": rng.standard_normal((max(1, params // 4 // cols), cols)).astype(synthetic.BF16),
          "c": rng.standard_normal((max(1, params // 4 // cols), cols)).astype(np.float32)}
  new = {k: v.copy() for k, v in base.items()}
  for name, frac, step in (("a", 0.02, 1), ("b", 0.3, 1), ("c", 0.02, 1000)):
    w = weights.words(new[name])
    w[rng.random(w.size) < frac] += w.dtype.type(step)
  return base, new


def first_apply(params: int = 1 << 21, warm: bool = True, repeats: int = 3,
                chunk_elems: int = 1 << 18) -> dict:
  """The first delta a process applies against its later ones (seconds), in this process.

  One pass = `delta.apply_inplace` checked by the changes (what a sampler's subscriber runs)
  and by the result hashes, and `delta.decode` into new arrays, each on a fresh copy of the
  base, so every pass does the same work. `warm`: call `delta.warm_up()` first, as a sampler's
  subscriber does at start-up. Meaningful only in a fresh process (`first_apply_in_process`).

  Returns:
    {"first_s", "later_s" (median of the next `repeats` passes), "warm_up_s" (None without
    `warm`), "compiled_in_first" (kernel signatures compiled or loaded during the first pass:
    0 when the warm-up readied them all), "cache_hits" / "cache_misses" (numba's, over every
    kernel), "cache_dir", "chunks" (chunk kind -> count), "params"}.
  """
  base, new = _first_apply_pair(params)
  blob = delta.encode(base, new, chunk_elems=chunk_elems)
  parent = weights.digest(base, chunk_elems)
  warm_up_s = delta.warm_up() if warm else None
  before = [len(d.signatures) for d in jit.kernels()]

  def one_pass():
    t = time.perf_counter()
    for check in ("changes", "result"):
      held = {k: v.copy() for k, v in base.items()}
      delta.apply_inplace(held, blob, expect_parent=parent if check == "changes" else None,
                          check=check)
    out = delta.decode(base, blob, recycle=False)
    dt = time.perf_counter() - t
    _check_same(out, new, "decode")
    return dt

  first = one_pass()
  compiled = sum(len(d.signatures) - n for d, n in zip(jit.kernels(), before))
  later = float(np.median([one_pass() for _ in range(repeats)]))
  return {"first_s": first, "later_s": later, "warm_up_s": warm_up_s,
          "compiled_in_first": compiled,
          "cache_hits": sum(sum(d.stats.cache_hits.values()) for d in jit.kernels()),
          "cache_misses": sum(sum(d.stats.cache_misses.values()) for d in jit.kernels()),
          "cache_dir": jit.CACHE_DIR, "chunks": delta.decode_stream(base, blob)[1].chunks,
          "params": sum(v.size for v in base.values())}


def first_apply_in_process(cache_dir: str, params: int = 1 << 21, warm: bool = True,
                           timeout_s: float = 600.0) -> dict:
  """`first_apply` in a fresh interpreter whose kernel cache is `cache_dir` ("off": none; see
  `sync.delta.jit`)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, SYNC_KERNEL_CACHE_DIR=cache_dir,
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  code = ("import json, sys\nfrom sync import bench\n"
          "print(json.dumps(bench.first_apply(int(sys.argv[1]), sys.argv[2] == 'warm')))")
  res = subprocess.run([sys.executable, "-c", code, str(params), "warm" if warm else "cold"],
                       env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
  if res.returncode:
    raise RuntimeError(f"first_apply failed in a fresh process: {res.stderr[-3000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


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
  # Decode rate: the in-place apply checked by the changes, what the subscriber runs.
  enc, dec = row.encode_GBps * 1e9 / cores, row.apply_changes_GBps * 1e9 / cores
  out = {}
  for mode in (False, True):
    cfg = fanout_sim.terabyte_four_clusters(enc, dec, row.ratio, apply_delta_only=mode, **kw)
    r = fanout_sim.simulate(cfg)
    out["delta scatter on device" if mode else "full shard swap"] = {
        "end_to_end_s": r.end_to_end_s, "max_pause_s": r.max_pause_s,
        "delta_GB": r.delta_bytes / 1e9, "per_cluster_s": r.per_cluster()}
  return out


def markdown(rows) -> str:
  """The rows as a Markdown table: ours vs XOR+zstd vs memcpy, all from the same run, every
  column on the row's `workers` threads (ours and the baselines alike)."""
  head = ("| update | changed | threads, ours = baselines | ratio ours / XOR+zstd | "
          "encode GB/s ours / XOR+zstd | "
          "apply in place GB/s, changes check / result hash | memcpy into the same buffers GB/s "
          "| **apply / memcpy**, changes check / result hash | "
          "decode() GB/s | **decode() / memcpy** | decode(out=) / memcpy | "
          "new pages: decode(recycle=False) / copy into new arrays GB/s | "
          "decode GB/s ours (decode()) / XOR+zstd |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
  return head + "".join(
      f"| {r.label} | {r.changed:.2%} | {r.workers} | {r.ratio:.1f}x / {r.xor_ratio:.1f}x | "
      f"{r.encode_GBps:.2f} / {r.xor_encode_GBps:.2f} | "
      f"{r.apply_changes_GBps:.2f} / {r.apply_GBps:.2f} | {r.memcpy_GBps:.2f} | "
      f"**{r.apply_changes_vs_memcpy:.2f}** / {r.apply_vs_memcpy:.2f} | "
      f"{r.decode_pool_GBps:.2f} | **{r.decode_vs_memcpy:.2f}** | {r.decode_out_vs_memcpy:.2f} | "
      f"{r.decode_fresh_GBps:.2f} / {r.memcpy_fresh_GBps:.2f} | "
      f"{r.decode_pool_GBps:.2f} / {r.xor_decode_GBps:.2f} |\n"
      for r in rows)
