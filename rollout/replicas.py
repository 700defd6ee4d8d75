"""Data-parallel sampling: several engines, one per device group, behind one engine's API.

What:
  * `build(flat, cfg, replicas=R, expert=E, tensor=T, devices=...)`: R engines, replica r on
    devices [r E T, (r + 1) E T) of `devices` (one device each, or a mesh (1, 1, E, T) sharding
    the model: `rollout.placement`), as a `ReplicaSet` (a lone Engine when R is 1).
  * `ReplicaSet(engines)` serves them as one engine (`rollout.server`, `pipeline.samplers`,
    the admin app take either):
      - a request goes to the replica whose prefix cache holds the longest prefix of its prompt
        (a conversation's next turn, another attempt of a prompt: `Engine.cached_prefix_tokens`)
        unless that one is more than a batch busier than the least loaded; otherwise to the
        replica with the fewest completions queued or running (`Engine.load`; ties
        round-robin); a `submit_batch` is one submission to one replica, so its all-or-nothing
        queueing and its shared prefill hold as on one engine;
      - `swap_weights` checks the new weights once, packs them onto every replica's devices,
        then hands every replica the swap to the same version at once and returns when all
        serve it; `swap_delta` applies a delta to the set's host weights once and swaps the
        result in the same way (`rollout.delta_swap`);
      - `version` is the oldest version any replica serves: the version the whole set is at
        least at, which the pipeline's staleness checks and `/metrics` read;
      - `metrics()` sums the replicas' counters and combines their gauges, and lists each
        replica's own under "replicas" (`rollout.metrics` renders them with a replica label).

Why replicas rather than one engine's batch split over devices: a sampler's work is many
independent requests, and independent engines need no communication at all (each has its own
slots, scheduler and KV cache), so throughput scales with replicas as long as requests keep
them busy; sharding (`rollout.placement`) is for a model that does not fit one device, and a
replica may itself be sharded.

Versions: each request runs on one replica, which records per token the version of the weights
that produced it (`Completion.policy_versions`), exactly as one engine does. During a swap the
replicas switch between their own decode calls, so for a moment two replicas may serve different
versions; a request's record says which produced each of its tokens, so none is attributed to
weights that did not produce it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import jax

from moe import sharding as moe_sharding
from moe.config import ModelConfig
from rollout import delta_swap
from rollout import prefix_cache
from rollout import weight_checks
from rollout.engine import Engine, EngineConfig, EngineStopped
from rollout.sampling import SamplingParams

# Gauges of Engine.metrics() that do not add up over replicas; everything else numeric is summed.
_MIN = ("policy_version",)
_MAX = ("last_swap_pause_seconds",)


def device_groups(devices: Sequence, replicas: int, per_replica: int) -> list:
  """`replicas` consecutive groups of `per_replica` devices from `devices`."""
  if replicas < 1 or per_replica < 1:
    raise ValueError(f"need replicas >= 1 and devices per replica >= 1, got {replicas} and "
                     f"{per_replica}")
  devices = list(devices)
  need = replicas * per_replica
  if need > len(devices):
    raise ValueError(f"{replicas} replicas of {per_replica} devices need {need} devices, have "
                     f"{len(devices)} (on the CPU, XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={need} makes that many)")
  return [devices[i * per_replica:(i + 1) * per_replica] for i in range(replicas)]


def build(flat, cfg: ModelConfig, *, replicas: int = 1, expert: int = 1, tensor: int = 1,
          devices: Optional[Sequence] = None, config: EngineConfig = EngineConfig(),
          tokenizer=None, version: int = 0, start: bool = True):
  """Engines for `replicas` device groups (see the module docstring).

  Args:
    flat: the weights (flat names).
    cfg: the model's config.
    replicas: engines, each on its own devices.
    expert, tensor: each replica's mesh (1, 1, expert, tensor); 1 x 1 is one device.
    devices: the devices to use, in order (default: jax.local_devices()).
    config, tokenizer, version, start: every engine's (`Engine.from_flat`).

  Returns:
    A `ReplicaSet`, or the Engine itself when `replicas` is 1.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  groups = device_groups(devices, replicas, expert * tensor)
  engines = []
  try:
    for group in groups:
      if len(group) == 1:
        where = {"device": group[0]}
      else:
        where = {"mesh": moe_sharding.make_mesh((1, 1, expert, tensor), group)}
      engines.append(Engine.from_flat(flat, cfg, config=config, tokenizer=tokenizer,
                                      version=version, start=start, **where))
  except BaseException:
    for e in engines:
      e.stop()
    raise
  return engines[0] if replicas == 1 else ReplicaSet(engines)


@dataclasses.dataclass
class ReplicaWeights:
  """Weights checked once and packed for every replica (`ReplicaSet.prepare_weights`)."""
  parts: list  # one PreparedWeights per replica
  flat: dict
  prepare_s: float
  rms: dict

  @property
  def params(self) -> list:
    """Every replica's packed weights (what `rollout.delta_swap` checks for aliasing)."""
    return [p.params for p in self.parts]


class ReplicaSet:
  """Several engines served as one (see the module docstring).

  Args:
    engines: started or not, of the same model, settings and weights (`build` makes them).
  """

  def __init__(self, engines: Sequence[Engine]):
    engines = list(engines)
    if not engines:
      raise ValueError("a ReplicaSet needs at least one engine")
    first = engines[0]
    for e in engines[1:]:
      if e.model_config != first.model_config or e.config != first.config:
        raise ValueError("the replicas of a ReplicaSet must serve the same model with the same "
                         "settings")
    self.engines = engines
    self.model_config = first.model_config
    self.config = first.config
    self.max_len = first.max_len
    self.tokenizer = first.tokenizer
    self._flat = first.current_flat()  # the set's host weights: what a delta swap applies to
    self._lock = threading.Lock()  # a pick and its submit are one step
    self._next = 0  # where the round-robin among equally loaded replicas starts
    self._swap_lock = threading.Lock()  # swaps one at a time, to every replica in the same order
    self._delta_swapper = delta_swap.DeltaSwapper(self)
    self.last_swap: dict = {}

  # ------------------------------------------------------------------ lifecycle
  def start(self) -> None:
    for e in self.engines:
      e.start()

  def stop(self) -> None:
    """Stops every replica (their requests finish as "cancelled")."""
    for e in self.engines:
      e.stop()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  @property
  def running(self) -> bool:
    """Whether every replica's loop runs."""
    return all(e.running for e in self.engines)

  @property
  def version(self) -> int:
    """The oldest weight version any replica serves."""
    return min(e.version for e in self.engines)

  def load(self) -> int:
    """Completions queued or running over all replicas."""
    return sum(e.load() for e in self.engines)

  # ------------------------------------------------------------------ requests
  def _submit(self, fn: Callable[[Engine], object], prompt: Optional[Sequence[int]] = None):
    """`fn(replica)` on the replica `pick` chooses for `prompt`."""
    with self._lock:
      i = self.pick(prompt)
      self._next = (i + 1) % len(self.engines)
      return fn(self.engines[i])

  def pick(self, prompt: Optional[Sequence[int]] = None) -> int:
    """The running replica a request for `prompt` goes to.

    The replica whose prefix cache holds the longest prefix of `prompt` (a conversation's next
    turn, another attempt of a prompt), unless it is busier than the least loaded one by more
    than a batch (`max_slots` completions): then, as for a prompt no replica has cached, the
    least loaded. Ties go round-robin, so that requests sent one after another (each done
    before the next) still reach every replica.
    """
    n = len(self.engines)
    live = [(e.load(), (i - self._next) % n, i) for i, e in enumerate(self.engines)
            if e.running]
    if not live:
      raise EngineStopped("no replica is running")
    least = min(live)
    if prompt is None:
      return least[2]
    keys = prefix_cache.chain_keys(list(prompt), self.config.prefix_block_size)
    if not keys:
      return least[2]
    cached = {i: self.engines[i].cached_prefix_tokens(prompt, keys) for _, _, i in live}
    near = [(-cached[i], load, rr, i) for load, rr, i in live
            if load <= least[0] + self.config.max_slots]
    best = min(near)
    return best[3] if best[0] < 0 else least[2]

  def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
             *, timeout: Optional[float] = None, on_tokens: Optional[Callable] = None):
    """`Engine.submit` on the replica `pick` chooses."""
    return self._submit(lambda e: e.submit(prompt_token_ids, params, timeout=timeout,
                                           on_tokens=on_tokens), prompt_token_ids)

  def submit_batch(self, prompts: Sequence[Sequence[int]],
                   params: SamplingParams = SamplingParams(), *,
                   timeout: Optional[float] = None, on_tokens: Optional[Callable] = None) -> list:
    """`Engine.submit_batch` on the replica `pick` chooses for its first prompt (the batch stays
    together)."""
    return self._submit(lambda e: e.submit_batch(prompts, params, timeout=timeout,
                                                 on_tokens=on_tokens),
                        prompts[0] if prompts else None)

  def generate(self, prompt_token_ids: Sequence[int], **kw) -> list:
    """`Engine.generate` (blocking) on the replica `pick` chooses."""
    return self._submit(lambda e: e, prompt_token_ids).generate(prompt_token_ids, **kw)

  # ------------------------------------------------------------------ weights
  def current_flat(self) -> dict:
    """The flat weights being served (numpy; do not modify)."""
    return self._flat

  def served_rms(self) -> dict:
    """{name: RMS} of the served weights, the next swap's scale reference (the first
    replica's figures: every replica serves the same weights)."""
    return self.engines[0].served_rms()

  def prepare_weights(self, flat, *, reference_rms=None) -> ReplicaWeights:
    """Checks `flat` once (`Engine.prepare_weights`' checks) and packs it onto every replica's
    devices, the replicas in parallel.

    Raises:
      ValueError: as `Engine.prepare_weights` (nothing changes).
    """
    t0 = time.perf_counter()
    flat = dict(flat)
    if reference_rms is None:
      reference_rms = self.served_rms()
    rms = weight_checks.check(flat, self.model_config, reference_rms)
    parts = _each(self.engines, lambda e: e.prepare_weights(flat, checked_rms=rms))
    return ReplicaWeights(parts, flat, time.perf_counter() - t0, rms)

  def swap_weights(self, flat, version: int, timeout: Optional[float] = None, *,
                   wait_first_call: bool = False) -> dict:
    """Swaps every replica to `version` (see `Engine.swap_weights`).

    The weights are checked once and packed for every replica first (`prepare_weights`); then
    every replica is handed its swap at once and this returns when all have applied it.

    Returns:
      {"version", "prepare_s", "pause_s" (the longest replica pause), "in_flight" (summed),
       "total_s", "replicas": each replica's `Engine.swap_weights` result}, and with
      wait_first_call the longest "first_call_s" and "free_s".

    Raises:
      ValueError: bad weights (nothing changes).
      TimeoutError: a replica did not apply it in time (the others may have: `version` is
        the oldest any replica serves).
    """
    t0 = time.perf_counter()
    with self._swap_lock:
      prepared = flat if isinstance(flat, ReplicaWeights) else self.prepare_weights(flat)
      results = _each(list(zip(self.engines, prepared.parts)),
                      lambda ep: ep[0].swap_weights(ep[1], version, timeout,
                                                    wait_first_call=wait_first_call))
      self._flat = prepared.flat
    out = {"version": int(version), "prepare_s": prepared.prepare_s,
           "pause_s": max(r["pause_s"] for r in results),
           "in_flight": sum(r["in_flight"] for r in results),
           "total_s": time.perf_counter() - t0, "replicas": results}
    for k in ("first_call_s", "free_s"):
      got = [r[k] for r in results if r.get(k) is not None]
      if got:
        out[k] = max(got)
    self.last_swap = out
    return out

  def swap_delta(self, blob: bytes, version: int) -> dict:
    """Applies a `sync.delta` blob to the set's host weights once and swaps the result into
    every replica (`Engine.swap_delta`'s rules: all or nothing, reversed on failure)."""
    return self._delta_swapper.swap(blob, version)

  # ------------------------------------------------------------------ warm-up and metrics
  def programs(self) -> list:
    """The device programs of one replica (each replica compiles the same list for its own
    devices)."""
    return self.engines[0].programs()

  def warm_up(self, progress: Optional[Callable[[int, int, str], None]] = None, *,
              threads: int = 1, stop: Optional[threading.Event] = None) -> dict:
    """Compiles every replica's programs (`Engine.warm_up`), replica after replica; progress
    counts over all of them. Returns the summed counts."""
    per = len(self.programs())
    total = per * len(self.engines)
    out = {"programs": 0, "done": 0, "seconds": 0.0, "compiled": 0, "cache_hits": 0}
    for i, e in enumerate(self.engines):
      if stop is not None and stop.is_set():
        break

      def step(done, _total, what, base=i * per, i=i):
        if progress is not None and (done or not base):
          progress(base + done, total, what if not done else f"replica {i}: {what}")
      got = e.warm_up(step, threads=threads, stop=stop)
      for k in out:
        out[k] += got[k]
    out["programs"] = total
    return out

  def metrics(self) -> dict:
    """The replicas' counters summed, their gauges combined (versions: the oldest; pauses: the
    longest; occupancy and the prefix cache's hit rate recomputed from the sums; the rest
    summed), and each replica's own snapshot under "replicas"."""
    per = [e.metrics() for e in self.engines]
    out: dict = {}
    for m in per:
      for k, v in m.items():
        if not isinstance(v, (int, float)):
          continue
        if k in _MIN:
          out[k] = min(out.get(k, v), v)
        elif k in _MAX:
          out[k] = max(out.get(k, v), v)
        else:
          out[k] = out.get(k, 0) + v
    out["batch_occupancy"] = out["active_slots"] / out["max_slots"]
    looked = out.get("prefix_cache_lookup_tokens_total", 0)
    if "prefix_cache_hit_rate" in out:
      out["prefix_cache_hit_rate"] = (out["prefix_cache_hit_tokens_total"] / looked
                                      if looked else 0.0)
    out["replicas"] = per
    return out


def _each(items: list, fn: Callable) -> list:
  """[fn(x) for x in items], run concurrently (one thread each); the first error is raised once
  all have ended."""
  if len(items) == 1:
    return [fn(items[0])]
  with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
    futures = [pool.submit(fn, x) for x in items]
    concurrent.futures.wait(futures)
  return [f.result() for f in futures]
