"""Sharded weight publishing from a learner sharded over CPU devices: host memory and bytes.

  .venv/bin/python -m tools.bench_sync_sharded [--mesh 1,2,4,1] [--steps 3] [--gin_file F]
  bazel run //tools:bench_sync_sharded -- --mesh 1,2,4,1

(`--devices`, default 8, host-platform CPU devices; the program sets
--xla_force_host_platform_device_count itself, before JAX starts.)

What: builds the learner (`rl.learner.build_learner`, next-token loss, AdamW, sampler dtype
bf16) on a (data, fsdp, expert, tensor) mesh of CPU devices and, for version 0 and after each
of `--steps` training steps on random tokens, publishes its weights twice, into two stores:
  * gathered: `Learner.sampler_weights()` (every tensor gathered whole on the host) into a
    `sync.publisher.Publisher`, the single-stream path;
  * sharded: `Learner.sampler_shards()` (the blocks this process holds, one at a time) into a
    `sync.sharded.ShardedPublisher`.
Around each publish it measures the host memory it took, as tracemalloc counts it (Python
objects and numpy arrays, which numpy reports to it; not XLA's own buffers): the peak above what
was allocated before, and what was still allocated after (the publisher's kept copy of the
weights, the parents of the next deltas: paid at version 0).
Every version is then rebuilt by a `sync.sharded.ShardedSubscriber` from the sharded store and
checked bit for bit against the gathered weights.

Why both in one process: the same learner state feeds both paths, so the rows compare the
publishing paths, not two runs. On one host the process holds every block, so the kept copies
are the whole model on both paths; the sharded path's gain is the transient: it never holds a
gathered tensor, only one block and the encoder's buffers. With n learner processes each keeps
its 1/n share (each publishes the blocks it owns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc

DEFAULT_MODEL = "moe/configs/tiny.gin"


def _force_devices(n: int) -> None:
  """Asks XLA for `n` host-platform devices; must run before JAX is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class HostMemory:
  """Host memory taken by the block of a `with`, as tracemalloc counts it (every allocation of
  Python objects and numpy arrays; not XLA's own host buffers). Attributes after it: `peak`,
  the most allocated at once above the start, and `held`, what was still allocated at the end
  above the start (bytes)."""

  def __enter__(self):
    if not tracemalloc.is_tracing():
      tracemalloc.start()
    tracemalloc.reset_peak()
    self._base = tracemalloc.get_traced_memory()[0]
    return self

  def __exit__(self, *exc):
    cur, peak = tracemalloc.get_traced_memory()
    self.peak, self.held = peak - self._base, cur - self._base
    return False


def build_learner(cfg, mesh_shape, *, learning_rate: float = 1e-4, seed: int = 0,
                  sampler_dtype: str = "bfloat16"):
  """The learner on a mesh of `mesh_shape` (data, fsdp, expert, tensor) over this process's
  devices: next-token loss, constant AdamW."""
  from moe import sharding  # pylint: disable=g-import-not-at-top
  from rl import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from rl.train_state import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from rl.train_step import LossConfig  # pylint: disable=g-import-not-at-top
  return learner_lib.build_learner(
      learner_lib.LearnerConfig(
          optimizer=OptimizerConfig(learning_rate=learning_rate, warmup_steps=0,
                                    schedule="constant"),
          loss=LossConfig(objective="next_token"), sampler_dtype=sampler_dtype),
      cfg, mesh=sharding.make_mesh(mesh_shape), seed=seed)


def run(cfg, mesh_shape, *, steps: int, workdir: str, learning_rate: float = 1e-4,
        rows: int = 4, seq_len: int = 32, on_version=None) -> dict:
  """Publishes version 0 and the version after each of `steps` steps both ways (see the module
  docstring); returns {"rows": one dict per version, "model": sizes, "shards": counts}.

  `on_version(version, learner, gathered_weights, shard_report, subscriber)` is called after
  each version is published and rebuilt (tests look inside there).
  """
  from sync import publisher as publisher_lib  # pylint: disable=g-import-not-at-top
  from sync import sharded  # pylint: disable=g-import-not-at-top
  from sync import store as store_lib  # pylint: disable=g-import-not-at-top
  from sync import weights  # pylint: disable=g-import-not-at-top
  from tools import train_deltas  # pylint: disable=g-import-not-at-top
  learner = build_learner(cfg, mesh_shape, learning_rate=learning_rate)
  gathered = publisher_lib.Publisher(store_lib.Store(os.path.join(workdir, "gathered")))
  sharded_st = store_lib.Store(os.path.join(workdir, "sharded"))
  spub = sharded.ShardedPublisher(sharded_st)
  rebuilt = {}
  sub = sharded.ShardedSubscriber(sharded_st, lambda flat, v: rebuilt.update(flat=flat, v=v))
  out = []
  model = None
  for step in range(steps + 1):
    if step:
      learner.train_step(train_deltas.random_batch(cfg.vocab_size, rows, seq_len, step))
    t0 = time.perf_counter()
    with HostMemory() as g_mem:
      flat, version = learner.sampler_weights()
      g_rep = gathered.publish(flat)
      del flat
    g_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with HostMemory() as s_mem:
      blocks, s_version = learner.sampler_shards()
      s_rep = spub.publish(blocks)
      del blocks
    s_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    update = sub.poll()
    poll_s = time.perf_counter() - t0
    reference, _ = learner.sampler_weights()
    exact = rebuilt["v"] == version == s_version and rebuilt["flat"].keys() == reference.keys() \
        and all(weights.words(rebuilt["flat"][k]).tobytes() == weights.words(v).tobytes()
                for k, v in reference.items())
    if model is None:
      model = {"bytes": weights.nbytes(reference),
               "largest_tensor": max(a.nbytes for a in reference.values()),
               "tensors": len(reference)}
    m = s_rep.manifest
    out.append({
        "version": version, "bit_exact": bool(exact),
        "gathered": {"peak": g_mem.peak, "held": g_mem.held,
                     "largest_encoded": model["largest_tensor"], "seconds": g_s,
                     "delta_bytes": g_rep.delta_bytes},
        "sharded": {"peak": s_mem.peak, "held": s_mem.held,
                    "largest_encoded": s_rep.largest_block, "seconds": s_s,
                    "delta_bytes": m.delta_bytes, "shards": len(m.shards)},
        "sampler": {"seconds": poll_s, "bytes_moved": update.bytes_moved,
                    "largest_block": update.largest_block}})
    if on_version is not None:
      on_version(version, learner, reference, s_rep, sub)
    del reference
  return {"rows": out, "model": model}


def markdown(result: dict) -> str:
  """The rows as a Markdown table (MB = 1e6 bytes; memory as tracemalloc counts it)."""
  def mb(b):
    return "-" if b is None else f"{b / 1e6:.2f}"

  head = ("| version | path | peak MB during publish | held after MB | "
          "largest array encoded MB | delta MB | publish s | sampler update s (shard by shard) "
          "| rebuilt bit-exact |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
  lines = []
  for r in result["rows"]:
    for path in ("gathered", "sharded"):
      x = r[path]
      label = path if path == "gathered" else f"sharded ({x['shards']} blocks)"
      update = "-" if path == "gathered" else f"{r['sampler']['seconds']:.2f}"
      lines.append(f"| {r['version']} | {label} | {mb(x['peak'])} | {mb(x['held'])} | "
                   f"{mb(x['largest_encoded'])} | {mb(x['delta_bytes'])} | "
                   f"{x['seconds']:.2f} | {update} | {'yes' if r['bit_exact'] else 'NO'} |\n")
  return head + "".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--mesh", default="1,2,4,1", help="data,fsdp,expert,tensor")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--learning_rate", type=float, default=1e-4)
  p.add_argument("--json", help="also write the rows here")
  argv = sys.argv[1:] if argv is None else argv
  _force_devices(p.parse_known_args(argv)[0].devices)
  from tools import configs  # pylint: disable=g-import-not-at-top  (imports JAX)
  args, files, bindings = configs.parse_flags(p, argv)
  configs.parse(files or [DEFAULT_MODEL], bindings)
  cfg = configs.model_config()
  mesh_shape = tuple(int(x) for x in args.mesh.split(","))
  with tempfile.TemporaryDirectory(prefix="bench-sync-sharded-") as work:
    result = run(cfg, mesh_shape, steps=args.steps, workdir=work,
                 learning_rate=args.learning_rate)
  m = result["model"]
  print(markdown(result))
  print(f"(model: {m['tensors']} tensors, {m['bytes'] / 1e6:.2f} MB in the sampler's dtype, "
        f"largest tensor {m['largest_tensor'] / 1e6:.2f} MB; mesh {args.mesh} over "
        f"{args.devices} CPU devices, one process)")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return 0 if all(r["bit_exact"] for r in result["rows"]) else 1


if __name__ == "__main__":
  sys.exit(main())
