"""The RL grain pipeline: trajectory shards -> validated, grouped, scored episodes -> packed batches.

Stages (each a grain IterDataset whose iterator state is JSON, so the whole pipeline is
checkpointed with the train state and a restart neither repeats nor skips data):
  1. `TrajectorySource`: reads finished shards of a trajectory directory (rl/trajectory_io.py) in
     name order, record by record; its state is the set of finished shards plus the position in
     the current one. With `follow=True` it waits for new shards (the asynchronous set-up).
  2. `GroupAndScore`: validates each record (bad data is counted and logged, never fatal), drops
     episodes whose every trained token is staler than the bound, collects the `group_size`
     attempts of each prompt, computes GRPO advantages over the group (infrastructure failures
     excluded from the statistics and from training) and emits one training example per episode
     context segment (one for an episode without `segment_lengths`; every segment of a
     self-summarised episode is its own sequence with the episode's advantage).
     Pending groups are kept in its state as (shard, index) references, not copies.
  3. grain's first-fit packing puts several sequences into each row (segment ids, positions
     restarting per sequence), then batching and renaming to the learner's batch fields.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Optional

import grain
import grain.experimental as grain_exp
import numpy as np

from rl import objectives
from rl import trajectory_io
from rl.episodes import Episode, RejectionLog, ValidationSpec, validate

_log = logging.getLogger("rl.rl_data")


class _ShardCache:
  """Decoded records of recently used shards (most pipelines touch one or two at a time)."""

  def __init__(self, directory: str, capacity: int = 4):
    self.directory = directory
    self.capacity = capacity
    self._cache: collections.OrderedDict[str, list] = collections.OrderedDict()

  def records(self, shard: str) -> list:
    if shard in self._cache:
      self._cache.move_to_end(shard)
      return self._cache[shard]
    recs = trajectory_io.read_shard(os.path.join(self.directory, shard))
    self._cache[shard] = recs
    while len(self._cache) > self.capacity:
      self._cache.popitem(last=False)
    return recs

  def get(self, shard: str, index: int):
    return self.records(shard)[index]


class MissingShardError(RuntimeError):
  """Shards of a writer's sequence never appeared (rl.trajectory_io: sequences have no holes)."""


class TrajectorySource(grain.IterDataset):
  """Yields {"loc": [shard, index], "record": decoded msgpack or None} from a directory.

  Shards are read in name order, and a writer's shards in sequence order with no hole: when the
  next shard is `w-n` but `w-m` (m < n) was never read, the reader waits up to
  `missing_timeout_s` for it (a shared file system may list files late; never while not
  following: nothing more is coming). After that, `on_missing="raise"` raises
  `MissingShardError`; `on_missing="report"` yields one marker item
  {"loc": [first missing shard, -1], "record": None, "lost": {"shards": [...], "records": n}}
  (n from the records' `writer_index`, None if the shards carry none) and goes on, so a reader
  that counts records can keep its boundaries. A shard counted as lost that turns up later is
  not read (that would reorder the stream); it is logged.

  Args:
    directory: the trajectory directory.
    follow: wait for new shards instead of stopping when all are read.
    poll_interval_s: how often to look for new shards while following.
    idle_timeout_s: while following, stop after this long without a new shard (None: never).
    missing_timeout_s: how long a hole in a writer's sequence may stay open.
    on_missing: "raise" or "report" (see above).
  """

  def __init__(self, directory: str, *, follow: bool = False, poll_interval_s: float = 0.5,
               idle_timeout_s: Optional[float] = None, missing_timeout_s: float = 30.0,
               on_missing: str = "raise"):
    super().__init__()
    if on_missing not in ("raise", "report"):
      raise ValueError(f"on_missing must be 'raise' or 'report', got {on_missing!r}")
    self.directory = directory
    self.follow = follow
    self.poll_interval_s = poll_interval_s
    self.idle_timeout_s = idle_timeout_s
    self.missing_timeout_s = missing_timeout_s
    self.on_missing = on_missing

  def __iter__(self):
    return _SourceIterator(self)


class _SourceIterator(grain.DatasetIterator):

  def __init__(self, ds: TrajectorySource):
    super().__init__()
    self._ds = ds
    self._cache = _ShardCache(ds.directory)
    self._done: set[str] = set()
    self._current: Optional[str] = None
    self._offset = 0
    # Per writer: the sequence number and writer_index expected next (None: unknown).
    self._next_seq: dict[str, int] = {}
    self._next_index: dict[str, Optional[int]] = {}
    self._lost: dict[str, Optional[int]] = {}  # first lost shard of a hole -> records lost
    self._lost_names: set[str] = set()
    self._gap_seen: dict[str, float] = {}  # first missing shard -> when the hole was seen
    self._late_logged: set[str] = set()
    self._marker: Optional[dict] = None

  def _gap(self, writer: str, missing: list, seq: int, start: Optional[int],
           after: str) -> bool:
    """Handles a hole in `writer`'s stream (shards `missing`, after which its stream goes on
    at sequence `seq`, writer_index `start`): False while waiting for it, True once closed
    (counted as lost, with a marker for the reader to yield). `after` says what revealed it."""
    first = missing[0]
    now = time.monotonic()
    since = self._gap_seen.setdefault(first, now)
    if since == now:
      _log.warning("trajectory shards %s are missing %s; waiting up to %.0fs", missing, after,
                   self._ds.missing_timeout_s if self._ds.follow else 0.0)
    if self._ds.follow and now - since < self._ds.missing_timeout_s:
      return False
    expect = self._next_index.get(writer, 0)
    lost = None if start is None or expect is None else start - expect
    if self._ds.on_missing == "raise":
      raise MissingShardError(
          f"trajectory shards {missing} never appeared in {self._ds.directory} (waited "
          f"{now - since:.0f}s; missing {after}); {lost} records are missing")
    _log.error("trajectory shards %s never appeared (waited %.0fs): counting their %s records "
               "as lost", missing, now - since, lost)
    self._lost[first] = lost
    self._lost_names.update(missing)
    self._next_seq[writer] = seq
    self._next_index[writer] = start
    del self._gap_seen[first]
    self._marker = {"loc": [first, -1], "record": None,
                    "lost": {"shards": list(missing), "records": lost}}
    return True

  def _tail_hole(self) -> Optional[tuple]:
    """(writer, missing shards, next seq, next writer_index) for a writer whose progress file
    records shards past the last one this reader found (its tail went missing), else None.

    The shards are listed again after the progress files are read: a writer puts a shard in
    place before it records it, so a shard published between the caller's listing and this
    read is found here and is not mistaken for a missing one."""
    progress = trajectory_io.read_progress(self._ds.directory)
    present = set(trajectory_io.list_shards(self._ds.directory))
    for writer, prog in sorted(progress.items()):
      have = self._next_seq.get(writer, 0)
      if prog["next_seq"] > have:
        missing = [trajectory_io.shard_name(writer, j) for j in range(have, prog["next_seq"])
                   if trajectory_io.shard_name(writer, j) not in self._lost_names
                   and trajectory_io.shard_name(writer, j) not in present]
        if missing:
          return writer, missing, prog["next_seq"], prog["next_index"]
    return None

  def _next_shard(self) -> Optional[str]:
    waited = 0.0
    while True:
      names = trajectory_io.list_shards(self._ds.directory)
      for n in names:
        if n in self._lost_names and n not in self._late_logged:
          self._late_logged.add(n)
          _log.warning("trajectory shard %s appeared after it was counted as lost; not read", n)
      todo = [n for n in names if n not in self._done and n not in self._lost_names]
      if todo:
        missing = trajectory_io.missing_before(todo[0], self._next_seq)
        if not missing:
          self._gap_seen.pop(todo[0], None)  # it was only late
          return todo[0]
        writer, seq = trajectory_io.parse_name(todo[0])
        start = trajectory_io.first_index(self._cache.records(todo[0]))
        if self._gap(writer, missing, seq, start, f"before {todo[0]}"):
          return todo[0]
      else:
        hole = self._tail_hole()
        if hole is not None:
          writer, missing, seq, start = hole
          if self._gap(writer, missing, seq, start,
                       f"at the end of writer {writer}'s stream (it recorded {seq} shards)"):
            return None  # nothing to read now; __next__ yields the marker
      if not self._ds.follow:
        return None
      if self._ds.idle_timeout_s is not None and waited >= self._ds.idle_timeout_s:
        return None
      time.sleep(self._ds.poll_interval_s)
      waited += self._ds.poll_interval_s

  def __next__(self):
    while True:
      if self._current is None:
        self._current = self._next_shard()
        self._offset = 0
        if self._current is None:
          if self._marker is not None:  # a lost tail: counted, then the reader goes on
            marker, self._marker = self._marker, None
            return marker
          raise StopIteration
      if self._marker is not None:
        marker, self._marker = self._marker, None
        return marker
      recs = self._cache.records(self._current)
      if self._offset < len(recs):
        loc = [self._current, self._offset]
        self._offset += 1
        return {"loc": loc, "record": recs[loc[1]]}
      writer, seq = trajectory_io.parse_name(self._current)
      start = trajectory_io.first_index(recs)
      self._next_seq[writer] = seq + 1
      self._next_index[writer] = None if start is None else start + len(recs)
      self._done.add(self._current)
      self._current = None

  def get_state(self) -> dict:
    return {"done": sorted(self._done), "current": self._current, "offset": self._offset,
            "next_seq": dict(self._next_seq), "next_index": dict(self._next_index),
            "lost": dict(self._lost), "lost_names": sorted(self._lost_names)}

  def set_state(self, state: dict) -> None:
    self._done = set(state["done"])
    self._current = state["current"]
    self._offset = int(state["offset"])
    self._lost = dict(state.get("lost", {}))
    self._lost_names = set(state.get("lost_names", ()))
    self._marker = None
    if "next_seq" in state:
      self._next_seq = {k: int(v) for k, v in state["next_seq"].items()}
      self._next_index = dict(state["next_index"])
    else:  # a state from before sequence checking: what was read, in order, defines it
      self._next_seq, self._next_index = {}, {}
      for n in sorted(self._done):
        writer, seq = trajectory_io.parse_name(n)
        self._next_seq[writer] = max(self._next_seq.get(writer, 0), seq + 1)
        self._next_index[writer] = None


@dataclasses.dataclass
class PipelineStats:
  """Counters of the RL pipeline (restored with its state)."""

  rejections: dict = dataclasses.field(default_factory=dict)
  episodes: int = 0
  stale_episodes: int = 0
  infra_failures: int = 0
  groups: int = 0
  small_groups: int = 0
  zero_advantage_groups: int = 0
  evicted_groups: int = 0

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def load_json(self, data: dict) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, dict(data[f.name]) if f.name == "rejections" else int(data[f.name]))


@dataclasses.dataclass(frozen=True)
class GroupingConfig:
  """Grouping, scoring and filtering of episodes.

  Attributes:
    max_staleness: episodes whose every trained token comes from a policy more than this many
      versions older than the learner are dropped (the learner masks individual stale tokens).
    normalize_std: divide GRPO advantages by the group's reward std.
    min_group_size: groups with fewer trainable attempts are dropped.
    drop_zero_advantage: drop groups whose attempts all got the same reward (no signal).
    max_pending_groups: when more groups are incomplete, the oldest is evicted (and counted).
    include_routing: emit recorded routing for router replay.
  """

  max_staleness: int = 4
  normalize_std: bool = True
  min_group_size: int = 2
  drop_zero_advantage: bool = False
  max_pending_groups: int = 4096
  include_routing: bool = True


class GroupAndScore(grain.IterDataset):
  """Validates, filters, groups and scores episodes; emits one example dict per episode."""

  def __init__(self, parent: TrajectorySource, *, spec: ValidationSpec, config: GroupingConfig,
               version_fn: Callable[[], int], stats: Optional[PipelineStats] = None):
    super().__init__(parent)
    self.spec = spec
    self.config = config
    self.version_fn = version_fn
    self.stats = stats if stats is not None else PipelineStats()
    self.directory = parent.directory

  def __iter__(self):
    return _GroupIterator(self, self._parent.__iter__())


class _GroupIterator(grain.DatasetIterator):

  def __init__(self, ds: GroupAndScore, parent: grain.DatasetIterator):
    super().__init__(parent)
    self._ds = ds
    self._cfg = ds.config
    self._cache = _ShardCache(ds.directory)
    self._log = RejectionLog(_log, ds.stats.rejections)
    ds.stats.rejections = self._log.counts
    # group id -> {"size": int or None, "entries": [[shard, index, status], ...]}
    self._pending: collections.OrderedDict[str, dict] = collections.OrderedDict()
    # [shard, index, advantage, segment]: the next example is that segment of that episode.
    self._ready: collections.deque = collections.deque()

  # -- record handling -----------------------------------------------------------------------
  def _episode(self, shard: str, index: int) -> Episode:
    return Episode.from_record(self._cache.get(shard, index))

  def _classify(self, item: dict):
    """(group id or None, group size or None, status) of one raw record."""
    rec, where = item["record"], "%s#%d" % tuple(item["loc"])
    if rec is None:
      self._log.reject("undecodable", where)
      return None, None, "rejected"
    try:
      ep = Episode.from_record(rec)
    except (KeyError, ValueError, TypeError) as e:
      self._log.reject("malformed", f"{where} ({e})")
      gid = rec.get("group_id") if isinstance(rec, dict) else None
      return (str(gid) if gid is not None else None), None, "rejected"
    reason = validate(ep, self._ds.spec)
    if reason is not None:
      self._log.reject(reason, where)
      return ep.group_id, (ep.group_size if ep.group_size >= 1 else None), "rejected"
    if ep.infra_failure:
      self._ds.stats.infra_failures += 1
      return ep.group_id, ep.group_size, "infra"
    trained = ep.loss_mask.astype(bool)
    lag = self._ds.version_fn() - int(ep.policy_versions[trained].max())
    if lag > self._cfg.max_staleness:
      self._ds.stats.stale_episodes += 1
      return ep.group_id, ep.group_size, "stale"
    return ep.group_id, ep.group_size, "ok"

  def _add(self, item: dict) -> None:
    gid, size, status = self._classify(item)
    if gid is None:
      return
    group = self._pending.setdefault(gid, {"size": None, "entries": []})
    if size is not None:
      group["size"] = size
    group["entries"].append([item["loc"][0], item["loc"][1], status])
    if group["size"] is not None and len(group["entries"]) >= group["size"]:
      del self._pending[gid]
      self._finish(gid, group)
    while len(self._pending) > self._cfg.max_pending_groups:
      old_gid, old = self._pending.popitem(last=False)
      self._ds.stats.evicted_groups += 1
      _log.warning("evicting incomplete group %s (%d attempts)", old_gid, len(old["entries"]))

  def _finish(self, gid: str, group: dict) -> None:
    # Stale attempts were still scored against the same prompt, so their rewards count in the
    # group baseline; they are not trained on. Rejected and infra-failed attempts count nowhere.
    scored = [e for e in group["entries"] if e[2] in ("ok", "stale")]
    ok = [e for e in group["entries"] if e[2] == "ok"]
    if len(ok) < self._cfg.min_group_size:
      self._ds.stats.small_groups += 1
      return
    rewards = np.array([self._episode(e[0], e[1]).reward for e in scored])
    adv = objectives.group_advantages(rewards, normalize_std=self._cfg.normalize_std)
    if np.all(adv == 0):
      self._ds.stats.zero_advantage_groups += 1
      if self._cfg.drop_zero_advantage:
        return
    self._ds.stats.groups += 1
    for e, a in zip(scored, adv):
      if e[2] == "ok":
        self._ready.append([e[0], e[1], float(a), 0])

  def _example(self, shard: str, index: int, adv: float, segment: int) -> dict:
    """The training sequence of one context segment of an episode (the whole of an unsegmented
    one); when more segments follow, the next one is queued first so an episode stays together."""
    ep = self._episode(shard, index)
    bounds = ep.segment_bounds()
    if segment + 1 < len(bounds):
      self._ready.appendleft([shard, index, adv, segment + 1])
    start, end = bounds[segment]
    trained = ep.loss_mask[start:end].astype(bool)
    lp = np.where(trained, ep.behaviour_logprobs[start:end], 0.0).astype(np.float32)
    out = {
        "tokens": ep.tokens[start:end].astype(np.int32),
        "loss_mask": trained.astype(np.int32),
        "behaviour_logprobs": lp,
        "policy_versions": np.where(trained, ep.policy_versions[start:end], 0).astype(np.int32),
        "advantages": np.full(end - start, adv, np.float32),
    }
    if self._cfg.include_routing:
      out["routing"] = np.transpose(ep.routing[:, start:end], (1, 0, 2)).astype(np.uint8)
    if segment == 0:
      self._ds.stats.episodes += 1
    return out

  # -- iterator protocol ---------------------------------------------------------------------
  def __next__(self) -> dict:
    while not self._ready:
      try:
        item = next(self._parents[0])
      except StopIteration:
        for gid in self._pending:
          _log.info("stream ended with incomplete group %s", gid)
        raise
      self._add(item)
    # Entries of states saved before segments existed have no segment: their episode's first.
    shard, index, adv, segment = (list(self._ready.popleft()) + [0])[:4]
    return self._example(shard, index, adv, segment)

  def get_state(self) -> dict:
    return {
        "parent": self._parents[0].get_state(),
        "pending": [[gid, g["size"], g["entries"]] for gid, g in self._pending.items()],
        "ready": [list(r) for r in self._ready],
        "stats": self._ds.stats.to_json(),
    }

  def set_state(self, state: dict) -> None:
    self._parents[0].set_state(state["parent"])
    self._pending = collections.OrderedDict(
        (gid, {"size": size, "entries": [list(e) for e in entries]})
        for gid, size, entries in state["pending"])
    self._ready = collections.deque(list(r) for r in state["ready"])
    self._ds.stats.load_json(state["stats"])
    self._log.counts = self._ds.stats.rejections


FIELDS = ("tokens", "loss_mask", "behaviour_logprobs", "policy_versions", "advantages")


def _to_batch(packed: dict, include_routing: bool) -> dict:
  out = {
      "tokens": packed["tokens"],
      "positions": packed["tokens_positions"],
      "segment_ids": packed["tokens_segment_ids"],
  }
  for name in FIELDS[1:]:
    out[name] = packed[name]
  if include_routing:
    out["routing"] = packed["routing"]
  return out


def rl_dataset(directory: str, *, spec: ValidationSpec, seq_len: int, batch_rows: int,
               version_fn: Callable[[], int], config: GroupingConfig = GroupingConfig(),
               stats: Optional[PipelineStats] = None, follow: bool = False,
               idle_timeout_s: Optional[float] = None) -> grain.IterDataset:
  """The RL pipeline over a trajectory directory; batches are dicts of [batch_rows, seq_len]
  arrays (routing [batch_rows, seq_len, moe_layers, k]) as `rl.learner.Learner` expects.

  `version_fn` returns the learner's current policy version (for the staleness filter);
  `stats` (optional) receives the pipeline's counters.
  """
  if spec.max_len > seq_len:
    raise ValueError(f"spec.max_len ({spec.max_len}) exceeds seq_len ({seq_len})")
  if config.include_routing and not spec.require_routing:
    raise ValueError("include_routing needs spec.require_routing (and routing_shape)")
  src = TrajectorySource(directory, follow=follow, idle_timeout_s=idle_timeout_s)
  grouped = GroupAndScore(src, spec=spec, config=config, version_fn=version_fn, stats=stats)
  fields = FIELDS + (("routing",) if config.include_routing else ())
  packed = grain_exp.FirstFitPackIterDataset(
      grouped, length_struct={f: seq_len for f in fields}, num_packing_bins=batch_rows,
      shuffle_bins=False)
  return packed.batch(batch_rows, drop_remainder=True).map(
      lambda b: _to_batch(b, config.include_routing))

