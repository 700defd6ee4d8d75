"""A discrete-event simulator of the RL pipeline: samplers, environment fleet, learner, weight sync.

What: `simulate(...)` runs S learner steps of GRPO-style RL (P prompts x n attempts per step)
through an inference pool, an environment fleet and a learner, either synchronously
(`max_staleness=0`: the whole batch for step s is generated with version s, then trained, then
synced, so the pools idle in turn) or asynchronously with a maximum policy lag k (the controller
keeps the samplers' slots full, releasing prompt groups while fewer than (F + k + 1) * P are live,
F being the version every sampler serves; weights swap in mid-flight and each sampler pauses for
its swap). It returns the wall time to the S-th served version, the idle fractions of both pools,
the staleness of consumed trajectories, dropped work, and which part the learner waited on.

How time is modelled:
- A sampler has `slots` concurrent sequences; a decode step takes `step_s + step_per_seq_s * b`
  at occupancy b (memory-bound: nearly constant), so a sequence of L tokens holds its slot for L
  steps. The simulator does not step token by token: between events every active sequence on a
  sampler advances at 1 / step_time tokens per second, so only arrivals, completions and stalls
  are events (a per-sampler virtual token clock with a heap of finish marks).
- Prefill of a turn's new tokens, a weight swap and (with `shared_compute`, as on this machine
  where both pools share the CPU) a learner step stall the sampler: no decoding meanwhile.
- Episodes: long-tailed lengths (lognormal from median and p99, clipped at `max_tokens`), split
  evenly over `turns`; after each turn the sequence leaves its slot and the environment runs
  (lognormal time, optionally a limited number of workers); the next turn prefills
  `obs_tokens`. Draws depend only on (seed, group index), so sync and async runs see the same
  prompts (common random numbers).
- Learner: step s takes P complete groups (in release order, or by completion, see `consume`)
  and costs `step_fixed_s + tokens * s_per_token`; a group is dropped (its work wasted, in-flight
  attempts aborted and replaced) once it could only be consumed with a lag above k, so no
  consumed trajectory is older than k versions (by the oldest version among its tokens).
- Weight sync (see `WeightSync`, usually built from `sync.fanout_sim`): after each learner step the
  update reaches sampler i after `ready_s[i]` and it pauses `pause_s[i]` to swap; syncs run one at
  a time and a newer version published meanwhile is sent next (intermediate ones are skipped).

Why: the real pipeline on thousands of accelerators cannot run here; this model makes the
throughput argument for asynchronous RL checkable with stated assumptions, and small cases have
answers computable by hand (see simulator_test). The inputs and `Result` are defined in
`sim_model`; scenario builders live in `sim_scenarios`.
"""

import collections
import heapq

import numpy as np

# The inputs and the result live in sim_model; they are re-exported here (sm.Workload, ...).
from pipeline.sim_model import (InferencePool, Result, TrainingPool, WeightSync, Workload,
                                _window, lognormal_sigma)

__all__ = ["InferencePool", "Result", "TrainingPool", "WeightSync", "Workload", "draw_group",
           "lognormal_sigma", "simulate"]


def simulate(workload: Workload, inference: InferencePool, training: TrainingPool,
             sync: WeightSync, *, steps: int, max_staleness: int, seed: int = 0,
             shared_compute: bool = False, env_workers: int = 0,
             consume: str = "release") -> Result:
  """Runs `steps` learner steps; max_staleness=0 is the synchronous loop. See module docstring.

  Args:
    shared_compute: the learner's steps stall every sampler (both pools on the same cores).
    env_workers: environment executions that can run at once (0: unlimited).
    consume: "release" (default): the learner takes groups in the order they were released
      (batch s is exactly the s-th P groups; no work is lost; it waits for each batch's tail,
      which k >= 1 overlaps with later batches); "completion": it takes the P complete groups
      with the oldest policy, and groups that fall more than k versions behind are dropped
      (the long episodes are the ones dropped: wasted work and a length bias).
  """
  if consume not in ("completion", "release"):
    raise ValueError(f"consume must be 'completion' or 'release', got {consume!r}")
  workload.validate()
  inference.validate()
  training.validate()
  sync.validate(inference.samplers)
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if not isinstance(max_staleness, int) or max_staleness < 0:
    raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
  if env_workers < 0:
    raise ValueError(f"env_workers must be >= 0, got {env_workers}")
  return _Sim(workload, inference, training, sync, steps, max_staleness, seed, shared_compute,
              env_workers, consume).run()


def draw_group(workload: Workload, seed: int, gid: int):
  """Response lengths [n] and environment seconds [n, turns] of prompt group `gid`.

  Lognormal with the workload's median and p99 (constant when they are equal), lengths rounded
  and clipped to [turns, max_tokens]; a function of (seed, gid) only, so every mode and k sees
  the same prompts.
  """
  w = workload
  rng = np.random.default_rng([seed, gid])
  sigma = lognormal_sigma(w.response_median, w.response_p99)
  lengths = np.clip(np.rint(w.response_median * np.exp(sigma * rng.standard_normal(w.attempts))),
                    w.turns, w.max_tokens)
  if w.env_median_s > 0:
    env_sigma = lognormal_sigma(w.env_median_s, w.env_p99_s)
    envs = w.env_median_s * np.exp(env_sigma * rng.standard_normal((w.attempts, w.turns)))
  else:
    envs = np.zeros((w.attempts, w.turns))
  return lengths, envs


# Event kinds.
_DECODE, _ENV, _TRAIN, _SWAP, _SYNCED = range(5)


class _Sampler:
  """Active sequences advance together; `v` counts decode steps done (the virtual token clock)."""
  __slots__ = ("i", "slots", "step_s", "per_seq_s", "v", "t", "stall_until", "active", "heap",
               "stamp", "version", "occ_area", "idle_time")

  def __init__(self, i, pool):
    self.i, self.slots = i, pool.slots
    self.step_s, self.per_seq_s = pool.step_s, pool.step_per_seq_s
    self.v = self.t = self.stall_until = 0.0
    self.active = {}  # episode -> finish mark on the virtual clock
    self.heap = []  # (finish mark, episode id, episode), lazily pruned
    self.stamp = 0  # invalidates scheduled completion events
    self.version = 0
    self.occ_area = self.idle_time = 0.0

  def step_time(self):
    return self.step_s + self.per_seq_s * len(self.active)

  def advance(self, now):
    dt = now - self.t
    if dt <= 0:
      return
    b = len(self.active)
    self.occ_area += b * dt
    if b == 0:
      self.idle_time += dt
    else:
      start = max(self.t, self.stall_until)  # stalls always begin at an advanced time
      if now > start:
        self.v += (now - start) / self.step_time()
    self.t = now

  def stall(self, now, seconds):
    self.stall_until = max(self.stall_until, now) + seconds

  def next_finish(self):
    while self.heap and self.heap[0][2] not in self.active:
      heapq.heappop(self.heap)
    return self.heap[0][0] if self.heap else None


class _Episode:
  __slots__ = ("gid", "eid", "turn", "turn_tokens", "env_s", "min_version", "swapped", "dead",
               "sampler", "start_mark", "tokens")

  def __init__(self, gid, eid, turn_tokens, env_s):
    self.gid, self.eid = gid, eid
    self.turn, self.turn_tokens, self.env_s = 0, turn_tokens, env_s
    self.min_version = None
    self.swapped = self.dead = False
    self.sampler = None
    self.start_mark = 0.0
    self.tokens = 0.0  # generated so far


class _Group:
  __slots__ = ("gid", "episodes", "done", "done_t", "dead", "train_tokens")

  def __init__(self, gid, episodes, train_tokens):
    self.gid, self.episodes, self.train_tokens = gid, episodes, train_tokens
    self.done, self.done_t, self.dead = 0, None, False

  def min_version(self):
    vs = [e.min_version for e in self.episodes if e.min_version is not None]
    return min(vs) if vs else None


class _Sim:

  def __init__(self, workload, inference, training, sync, steps, k, seed, shared, env_workers,
               consume):
    self.w, self.inf, self.tr, self.sync = workload, inference, training, sync
    self.steps, self.k, self.seed, self.shared = steps, k, seed, shared
    self.env_workers, self.consume = env_workers, consume
    self.served_at, self.snapshots = [], []
    self.samplers = [_Sampler(i, inference) for i in range(inference.samplers)]
    self.free = [(0, i) for i in range(inference.samplers)]  # (occupancy, sampler), lazy
    self.q, self.seq, self.now = [], 0, 0.0
    self.requests_cont, self.requests_new = collections.deque(), collections.deque()
    self.env_queue, self.env_busy = collections.deque(), 0
    self.groups_released = 0
    self.live = {}  # gid -> group, released and neither consumed nor dropped
    self.complete = {}  # gid -> group, complete and live
    self.learner_version, self.learner_busy = 0, False
    self.served_version, self.syncing, self.sync_version = 0, False, 0
    self.decoding = self.in_env = 0
    self.shares = dict.fromkeys(
        ("training", "inference", "long tail", "environment", "weight sync", "startup/other"),
        0.0)
    self.busy_time = 0.0
    self.stale, self.swapped = [], 0
    self.dropped, self.tokens_generated, self.tokens_wasted = 0, 0.0, 0.0
    self.end = None

  # --- event plumbing ------------------------------------------------------------------------

  def at(self, t, kind, a=None, b=None):
    heapq.heappush(self.q, (t, self.seq, kind, a, b))
    self.seq += 1

  def run(self):
    self.pump()
    while self.end is None:
      if not self.q:
        raise RuntimeError("simulation stalled with no events (a bug)")
      t, _, kind, a, b = heapq.heappop(self.q)
      self.account(t - self.now)
      self.now = t
      if kind == _DECODE:
        if a.stamp == b:
          self.on_decode(a)
      elif kind == _ENV:
        self.on_env(a)
      elif kind == _TRAIN:
        self.on_trained(a)
      elif kind == _SWAP:
        self.on_swap(a, b)
      else:
        self.on_synced(a)
      self.pump()
    return self.result()

  def account(self, dt):
    if dt <= 0:
      return
    if self.learner_busy:
      key = "training"
      self.busy_time += dt
    elif self.requests_cont or self.requests_new:
      key = "inference"  # work waits for a slot: decode throughput binds
    elif self.decoding:
      key = "long tail"  # slots free, nothing to start: waiting on the longest episodes
    elif self.in_env:
      key = "environment"
    elif self.syncing:
      key = "weight sync"
    else:
      key = "startup/other"
    self.shares[key] += dt

  def schedule(self, s):
    s.stamp += 1
    mark = s.next_finish()
    if mark is not None:
      t = max(self.now, s.stall_until) + max(0.0, mark - s.v) * s.step_time()
      self.at(t, _DECODE, s, s.stamp)
    heapq.heappush(self.free, (len(s.active), s.i))
    if len(self.free) > 64 + 8 * len(self.samplers):  # shed stale entries
      self.free = [(len(x.active), x.i) for x in self.samplers]
      heapq.heapify(self.free)

  # --- work release and dispatch ---------------------------------------------------------------

  def draw_group(self, gid):
    w = self.w
    lengths, envs = draw_group(w, self.seed, gid)
    bounds = np.rint(lengths[:, None] * np.arange(w.turns + 1) / w.turns)
    per_turn = np.diff(bounds, axis=1).tolist()  # every turn >= 1 token since lengths >= turns
    envs = envs.tolist()
    episodes = [_Episode(gid, e, per_turn[e], envs[e]) for e in range(w.attempts)]
    train_tokens = float(lengths.sum()) + w.attempts * (w.prompt_tokens +
                                                        (w.turns - 1) * w.obs_tokens)
    return _Group(gid, episodes, train_tokens)

  def pump(self):
    cap = min((self.served_version + self.k + 1), self.steps) * self.w.prompts_per_step
    while len(self.live) + self.next_step() * self.w.prompts_per_step < cap:
      g = self.draw_group(self.groups_released)
      self.groups_released += 1
      self.live[g.gid] = g
      self.requests_new.extend(g.episodes)
    self.dispatch()
    self.maybe_train()

  def next_request(self):
    """Continuing turns first (their prefix is cached and their group is waiting), then new."""
    for reqs in (self.requests_cont, self.requests_new):
      while reqs:
        ep = reqs.popleft()
        if not ep.dead:
          return ep
    return None

  def dispatch(self):
    while self.free:
      occ, i = self.free[0]
      s = self.samplers[i]
      if occ != len(s.active) or occ >= s.slots:
        heapq.heappop(self.free)
        continue
      ep = self.next_request()
      if ep is None:
        return
      heapq.heappop(self.free)
      self.start_turn(s, ep)

  def start_turn(self, s, ep):
    s.advance(self.now)
    prefill = self.w.prompt_tokens if ep.turn == 0 else self.w.obs_tokens
    if prefill and self.inf.prefill_s_per_token:
      s.stall(self.now, prefill * self.inf.prefill_s_per_token)
    ep.sampler, ep.start_mark = s, s.v
    ep.min_version = s.version if ep.min_version is None else min(ep.min_version, s.version)
    s.active[ep] = s.v + ep.turn_tokens[ep.turn]
    heapq.heappush(s.heap, (s.active[ep], self.seq, ep))
    self.seq += 1
    self.decoding += 1
    self.schedule(s)
    if ep.min_version < self.next_step() - self.k:  # started on weights too old to be used
      self.drop(self.live[ep.gid])

  # --- episode progress ----------------------------------------------------------------------

  def on_decode(self, s):
    s.advance(self.now)
    mark = s.next_finish()
    if mark is None:
      return
    s.v = max(s.v, mark)  # absorb rounding so the finishing sequences are exactly done
    while s.heap and s.heap[0][0] <= s.v + 1e-6:
      _, _, ep = heapq.heappop(s.heap)
      if ep not in s.active:
        continue
      del s.active[ep]
      self.decoding -= 1
      n = ep.turn_tokens[ep.turn]
      ep.tokens += n
      self.tokens_generated += n
      ep.sampler = None
      self.in_env += 1
      self.start_env(ep)
    self.schedule(s)

  def start_env(self, ep):
    if self.env_workers and self.env_busy >= self.env_workers:
      self.env_queue.append(ep)
      return
    self.env_busy += 1
    self.at(self.now + ep.env_s[ep.turn], _ENV, ep)

  def on_env(self, ep):
    self.env_busy -= 1
    self.in_env -= 1
    while self.env_queue and (not self.env_workers or self.env_busy < self.env_workers):
      nxt = self.env_queue.popleft()
      self.env_busy += 1
      self.at(self.now + nxt.env_s[nxt.turn], _ENV, nxt)
    if ep.dead:
      return
    ep.turn += 1
    if ep.turn < self.w.turns:
      self.requests_cont.append(ep)
      return
    g = self.live[ep.gid]
    g.done += 1
    if g.done == len(g.episodes):
      g.done_t = self.now
      self.complete[g.gid] = g

  def drop(self, g):
    """Throws a group away: aborts its sequences and frees their slots; pump() replaces it."""
    g.dead = True
    self.dropped += 1
    del self.live[g.gid]
    self.complete.pop(g.gid, None)
    for ep in g.episodes:
      ep.dead = True
      s = ep.sampler
      if s is not None and ep in s.active:
        s.advance(self.now)
        partial = s.v - ep.start_mark
        ep.tokens += partial
        self.tokens_generated += partial
        del s.active[ep]
        self.decoding -= 1
        ep.sampler = None
        self.schedule(s)
      self.tokens_wasted += ep.tokens

  # --- learner and weight sync ---------------------------------------------------------------

  def next_step(self):
    """The first learner step that can still consume a group released now."""
    return self.learner_version + (1 if self.learner_busy else 0)

  def maybe_train(self):
    P = self.w.prompts_per_step
    if self.learner_busy or self.learner_version >= self.steps or len(self.complete) < P:
      return
    step = self.learner_version
    if self.consume == "release":
      batch = []
      for g in self.live.values():  # insertion order is release order
        if g.done_t is None:
          return
        batch.append(g)
        if len(batch) == P:
          break
    else:
      batch = sorted(self.complete.values(),
                     key=lambda g: (g.min_version(), g.done_t, g.gid))[:P]
    tokens = 0.0
    for g in batch:
      del self.complete[g.gid]
      del self.live[g.gid]
      tokens += g.train_tokens
      for ep in g.episodes:
        self.stale.append(step - ep.min_version)
        self.swapped += ep.swapped
    self.learner_busy = True
    seconds = self.tr.step_time(tokens)
    self.at(self.now + seconds, _TRAIN, step)
    if self.shared:
      for s in self.samplers:
        s.advance(self.now)
        s.stall(self.now, seconds)
        self.schedule(s)
    floor = self.next_step() - self.k  # groups started before this version can't be used now
    for g in list(self.live.values()):
      v = g.min_version()
      if v is not None and v < floor:
        self.drop(g)

  def on_trained(self, step):
    self.learner_busy = False
    self.learner_version = step + 1
    if not self.syncing:
      self.start_sync()

  def start_sync(self):
    self.syncing, self.sync_version = True, self.learner_version
    for s, r in zip(self.samplers, self.sync.ready_s):
      self.at(self.now + r, _SWAP, s, self.sync_version)
    self.at(self.now + self.sync.end_to_end_s, _SYNCED, self.sync_version)

  def on_swap(self, s, version):
    s.advance(self.now)
    s.version = version
    for ep in s.active:
      ep.swapped = True
    s.stall(self.now, self.sync.pause_s[s.i])
    self.schedule(s)

  def on_synced(self, version):
    self.syncing = False
    self.served_version = version
    for _ in range(version - len(self.served_at)):
      self.served_at.append(self.now)
      self.snapshots.append(self.snapshot())
    if version >= self.steps:
      self.end = self.now
    elif self.learner_version > version:
      self.start_sync()

  def snapshot(self):
    for s in self.samplers:
      s.advance(self.now)
    return dict(self.shares), sum(s.occ_area for s in self.samplers)

  def result(self):
    wall = self.end
    for s in self.samplers:
      s.advance(wall)
    n = len(self.samplers)
    lo, hi = _window(self.steps)
    (s1, o1), t1 = self.snapshots[hi - 1], self.served_at[hi - 1]
    (s0, o0), t0 = (self.snapshots[lo - 1], self.served_at[lo - 1]) if lo else (
        (dict.fromkeys(s1, 0.0), 0.0), 0.0)
    return Result(
        max_staleness=self.k, steps=self.steps, wall_s=wall,
        train_busy_frac=self.busy_time / wall, train_idle_frac=1 - self.busy_time / wall,
        inference_idle_frac=sum(s.idle_time for s in self.samplers) / (n * wall),
        slot_occupancy=sum(s.occ_area for s in self.samplers) / (n * self.inf.slots * wall),
        staleness_mean=float(np.mean(self.stale)), staleness_max=int(max(self.stale)),
        swapped_midflight_frac=self.swapped / len(self.stale), dropped_groups=self.dropped,
        wasted_token_frac=self.tokens_wasted / max(self.tokens_generated, 1.0),
        tokens_generated=self.tokens_generated,
        shares={key: v / wall for key, v in self.shares.items()},
        sync_end_to_end_s=self.sync.end_to_end_s, sync_max_pause_s=self.sync.max_pause_s,
        served_at=self.served_at,
        mid_shares={key: (s1[key] - s0[key]) / (t1 - t0) for key in s1},
        mid_slot_occupancy=(o1 - o0) / (n * self.inf.slots * (t1 - t0)))
