"""Weight swaps by delta: apply a `sync.delta` blob to host weights in place, then swap them in.

What: `DeltaSwapper(engine).swap(blob, version)` is what `Engine.swap_delta` runs. It keeps host
arrays of the served weights that it owns (a copy taken once when the served weights came from
elsewhere: start-up or a full `swap_weights`), writes only the changed elements into them
(`delta.apply_inplace`), packs the result and hands it to `engine.swap_weights`. The next delta
swap updates the arrays of the previous one, so a stream of deltas costs no full copies.

Why a module of its own: the engine's serving loop does not need to know about the codec; this is
the one place that holds the digest naming the held version and the all-or-nothing rules:
  * the delta is checked by its changes against the held version's digest (check="changes"),
    so a blob for another parent version is refused;
  * a damaged blob, one for another parent, or one whose result would not fit the model raises
    (delta.DeltaError / ValueError) before anything changes;
  * a result that fails `rollout.weight_checks` (non-finite values, a tensor's scale 100x off
    the held version's) is refused by `Engine.prepare_weights` and the delta reversed;
  * if the swap fails after the apply, the delta is reversed so the held arrays are the served
    version again.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from rollout import packed_weights


class DeltaSwapper:
  """Applies delta blobs to an engine's weights (one at a time) and swaps the result in."""

  def __init__(self, engine):
    self._engine = engine
    self._lock = threading.Lock()  # delta swaps share the held arrays: one at a time
    self._held = None  # name -> host array this swapper owns (the served version)
    self._digest = None  # sync.weights digest of `_held`, per `_chunk_elems`
    self._chunk_elems = None

  def swap(self, blob: bytes, version: int) -> dict:
    """Applies `blob` and swaps the result in as `version`; see `Engine.swap_delta`."""
    from sync import delta  # imported here: only delta swaps need the codec
    from sync import weights as sync_weights
    engine = self._engine
    with self._lock:
      t0 = time.perf_counter()
      head = delta.read_header(blob)
      # Refuse a result that would not fit the model before writing anything.
      packed_weights.validate({name: np.broadcast_to(np.zeros((), np.uint8), shape)
                            for name, _, shape, _ in head["tensors"]}, engine.model_config)
      served = engine.current_flat()
      if self._held is not served:  # served weights from elsewhere: take our own copy, once
        self._held = {k: np.array(v, order="C", copy=True) for k, v in served.items()}
        self._digest = None
      if self._digest is None or self._chunk_elems != head["chunk_elems"]:
        self._chunk_elems = head["chunk_elems"]
        self._digest = sync_weights.digest(self._held, self._chunk_elems)
      held, digest = self._held, self._digest
      # The scale reference for the weight checks, measured before the apply writes into the
      # held arrays (which may be the served ones: comparing them after would compare the new
      # values with themselves).
      reference = engine.served_rms()  # `held` holds the served values (copied or the same)
      new_flat, stats = delta.apply_inplace(held, blob, expect_parent=digest)
      decoded = time.perf_counter() - t0
      try:
        prepared = engine.prepare_weights(new_flat, reference_rms=reference)
        _unalias(prepared, held)
        out = engine.swap_weights(prepared, version)
      except BaseException:
        self._held = None  # until the reversal below is proven
        delta.apply_inplace(held, blob, reverse=True)  # back to the served version
        self._held, self._digest = held, digest
        raise
      self._held, self._digest = prepared.flat, stats.digest
    out["decode_s"] = decoded
    return out


def _unalias(prepared, held: dict) -> None:
  """Copies any of `prepared.flat` whose memory the packed weights may share with `held`.

  The packed weights must not share memory with the arrays the next delta writes (jax copies
  host arrays once they are ready, but may alias them on some backends).
  """
  spans = [(a.__array_interface__["data"][0], a.nbytes, k) for k, a in held.items()]
  for leaf in jax.tree.leaves(prepared.params):
    try:
      p0, p1 = leaf.unsafe_buffer_pointer(), leaf.unsafe_buffer_pointer() + leaf.nbytes
    except (AttributeError, RuntimeError, ValueError):
      continue  # not a single host-visible buffer
    for a0, n, k in spans:
      if a0 < p1 and p0 < a0 + n:
        prepared.flat[k] = np.array(prepared.flat[k], copy=True)
