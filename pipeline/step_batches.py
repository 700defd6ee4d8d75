"""The learner's side of the transport: exactly one step's episodes -> one packed batch.

The controller writes groups in release order to sharded record files (rl.trajectory_io); this
reader takes the next `episodes_per_step` records from grain's checkpointable `TrajectorySource`,
validates them (rl.episodes.validate; rejects are counted and masked like infrastructure
failures), drops episodes staler than the bound (counted), computes GRPO advantages per group
over the valid attempts, and packs the episodes first-fit into a [batch_rows, seq_len] batch
(segment ids keep attention within an episode; positions restart per episode), cut to the
rows they fill rounded up to a bucket (`PipelineConfig.row_buckets`; first-fit fills rows in
order, so the cut drops only empty rows).

Self-summarised episodes (rl.episodes.Episode.segment_lengths): each context segment is packed
as its own sequence (its own segment id, positions from 0, no attention across segments; two
segments of one episode may share a row or not), and every segment carries the episode's
advantage. An episode is trained whole or not at all: if one of its segments finds no room,
none of them is placed and the episode counts as overflow, so no attempt is half-trained and
`trained_episodes` counts episodes, not segments.

Groups without signal: a group whose valid attempts all got the same reward (zero variance)
has advantage 0 on every token. It is counted per step (`zero_variance_groups`) and, with
`PipelineConfig.filter_zero_variance_groups`, left out of the batch (`zero_variance_filtered`):
its records are still consumed by this step, so the record count per step stays exact. Attempts
`envs.hacks` flagged (their rewards carry `envs.reward`'s penalty) are counted (`hack_flagged`).

Missing data: a hole in a writer's shard sequence (rl.trajectory_io) is waited for up to
`missing_timeout_s`, then its records are counted as lost (`StepStats.lost_episodes`, logged
with the shard names) and take their places in the step they belonged to, so later steps still
start where they should. A step whose records were all lost has nothing to train on, which
the learner loop refuses (pipeline.learner_loop.EmptyStepError).

Why not rl.rl_data's grain packer: it needs look-ahead (a bin is emitted when the next element no
longer fits), so a synchronous loop (k = 0), where the next step's data exists only after this
step trains, would wait forever. Consuming an exact record count per step keeps every k, 0
included, deadlock-free, and the reader's state is the source iterator's (a few strings and ints).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Optional

import numpy as np

from pipeline.config import PipelineConfig
from rl import objectives
from rl.episodes import Episode, RejectionLog, ValidationSpec, validate
from rl.rl_data import TrajectorySource

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepStats:
  """Counters of the reader (checkpointed with it)."""
  episodes: int = 0
  trained_episodes: int = 0
  infra_failures: int = 0
  stale_episodes: int = 0
  overflow_episodes: int = 0
  lost_episodes: int = 0
  zero_variance_groups: int = 0
  zero_variance_filtered: int = 0
  hack_flagged: int = 0
  lost_shards: list = dataclasses.field(default_factory=list)
  rejections: dict = dataclasses.field(default_factory=dict)


class StepBatcher:
  """Reads one learner step's episodes and packs them.

  Args:
    directory: the trajectory directory the controller writes.
    config: PipelineConfig (episodes_per_step, seq_len, batch_rows, max_staleness).
    spec: episode validation (vocabulary, max length, routing shape).
    include_routing: emit recorded routing for router replay.
    normalize_std: GRPO advantage normalisation by the group's reward std.
    missing_timeout_s: how long a missing shard is waited for before its records count as lost.
  """

  def __init__(self, directory: str, *, config: PipelineConfig, spec: ValidationSpec,
               include_routing: bool = True, normalize_std: bool = True,
               missing_timeout_s: float = 30.0):
    self.cfg = config
    self.spec = spec
    self.include_routing = include_routing
    self.normalize_std = normalize_std
    self.stats = StepStats()
    self._log = RejectionLog(log)
    self.stats.rejections = self._log.counts
    self._source = TrajectorySource(directory, follow=True, poll_interval_s=0.02,
                                    idle_timeout_s=0.2, missing_timeout_s=missing_timeout_s,
                                    on_missing="report")
    self._it = iter(self._source)
    self._lost_carry = 0  # lost records that belong to the steps after the current one

  # -- reading -------------------------------------------------------------------------------
  def _take(self, n: int, stop: threading.Event) -> Optional[tuple[list, int]]:
    """(the step's records, how many of its n records were lost), or None if stopped."""
    out = []
    lost = min(self._lost_carry, n)
    self._lost_carry -= lost
    while len(out) + lost < n:
      if stop.is_set():
        return None
      try:
        item = next(self._it)
      except StopIteration:
        continue  # idle: the source looks for new shards again on the next call
      if "lost" in item:
        count = item["lost"]["records"]
        if count is None:
          raise RuntimeError(f"trajectory shards {item['lost']['shards']} are missing and "
                             "their records carry no writer_index, so the steps after them "
                             "cannot be told apart; restore the shards")
        self.stats.lost_shards.extend(item["lost"]["shards"])
        take = min(count, n - len(out) - lost)
        lost += take
        self._lost_carry += count - take
        continue
      out.append(item)
    return out, lost

  def next_batch(self, learner_version: int, stop: Optional[threading.Event] = None):
    """(batch dict, info dict) of the next step, or None if `stop` was set while waiting.

    info: episodes read, trained_episodes (packed), group_ids, groups, signal_groups (groups
    with a non-zero advantage: the rest give the policy gradient nothing), zero_variance_groups
    (groups with valid attempts that all got the same reward), zero_variance_filtered (those of
    them left out of the batch), hack_flagged (attempts envs.hacks flagged), max_lag, mean_lag,
    this step's stale_episodes, rejected_episodes, infra_failures and lost_episodes, and rows
    (the batch's rows after the cut to a bucket: rows x seq_len positions are computed).
    """
    got = self._take(self.cfg.episodes_per_step, stop or threading.Event())
    if got is None:
      return None
    items, lost = got
    self.stats.lost_episodes += lost
    before = (self.stats.stale_episodes, sum(self._log.counts.values()),
              self.stats.infra_failures)
    groups: dict[str, list] = collections.OrderedDict()
    hacked = 0
    for item in items:
      where = "%s#%d" % tuple(item["loc"])
      try:
        ep = Episode.from_record(item["record"])
      except (KeyError, ValueError, TypeError, AttributeError) as e:
        self._log.reject("malformed", f"{where} ({e})")
        continue
      hacked += bool(ep.hack_flags)
      reason = validate(ep, self.spec)
      status = "ok"
      if reason is not None:
        self._log.reject(reason, where)
        status = "rejected"
      elif ep.infra_failure:
        self.stats.infra_failures += 1
        status = "infra"
      elif self.include_routing and ep.routing is None:
        self._log.reject("missing_routing", where)
        status = "rejected"
      else:
        lag = learner_version - int(ep.policy_versions[ep.loss_mask.astype(bool)].min())
        if lag > self.cfg.max_staleness:
          self.stats.stale_episodes += 1
          status = "stale"
      groups.setdefault(ep.group_id, []).append((ep, status))
    self.stats.episodes += len(items)

    signal = 0
    scored = []  # (members, advantages, zero variance) per group
    for members in groups.values():
      valid = np.array([s == "ok" for _, s in members])
      rewards = np.array([ep.reward for ep, _ in members])
      # Exact equality, not std == 0: the mean of equal floats need not equal them, and the
      # rounding left in r - mean would become a spurious advantage once divided by std + eps.
      flat = bool(valid.any()) and bool(np.all(rewards[valid] == rewards[valid][0]))
      adv = (np.zeros(len(members), np.float32) if flat else
             objectives.group_advantages(
                 rewards, valid, normalize_std=self.normalize_std,
                 negative_scale=self.cfg.negative_advantage_scale))
      signal += bool(np.any(adv != 0))
      scored.append((members, adv, flat))
    flat_groups = sum(flat for _, _, flat in scored)
    # A step of zero-variance groups only is trained as it is (every advantage 0) rather than
    # left without a trainable token, which the learner loop refuses.
    drop = self.cfg.filter_zero_variance_groups and signal > 0
    chosen, lags = [], []
    for members, adv, flat in scored:
      if flat and drop:
        continue
      for (ep, s), a in zip(members, adv):
        if s == "ok":
          chosen.append((ep, float(a)))
          lags.append(learner_version - int(ep.policy_versions[ep.loss_mask.astype(bool)].min()))
    filtered = flat_groups if drop else 0
    batch, packed = self._pack(chosen)
    self.stats.trained_episodes += packed
    self.stats.zero_variance_groups += flat_groups
    self.stats.zero_variance_filtered += filtered
    self.stats.hack_flagged += hacked
    info = {"episodes": len(items), "trained_episodes": packed, "group_ids": list(groups),
            "groups": len(groups), "signal_groups": signal, "zero_variance_groups": flat_groups,
            "zero_variance_filtered": filtered, "hack_flagged": hacked,
            "max_lag": max(lags) if lags else 0,
            "mean_lag": float(np.mean(lags)) if lags else 0.0,
            "stale_episodes": self.stats.stale_episodes - before[0],
            "rejected_episodes": sum(self._log.counts.values()) - before[1],
            "infra_failures": self.stats.infra_failures - before[2], "lost_episodes": lost,
            "rows": int(batch["tokens"].shape[0])}
    return batch, info

  # -- packing -------------------------------------------------------------------------------
  def _pack(self, chosen: list):
    rows, length = self.cfg.batch_rows, self.cfg.seq_len
    b = {
        "tokens": np.zeros((rows, length), np.int32),
        "positions": np.zeros((rows, length), np.int32),
        "segment_ids": np.zeros((rows, length), np.int32),
        "loss_mask": np.zeros((rows, length), np.int32),
        "behaviour_logprobs": np.zeros((rows, length), np.float32),
        "policy_versions": np.zeros((rows, length), np.int32),
        "advantages": np.zeros((rows, length), np.float32),
    }
    if self.include_routing:
      moe_layers, k = self.spec.routing_shape
      b["routing"] = np.zeros((rows, length, moe_layers, k), np.uint8)
    fill = np.zeros(rows, np.int64)
    segs = np.zeros(rows, np.int64)
    packed = 0
    # First-fit decreasing over episodes (the unit that is trained or dropped), each episode's
    # segments longest first.
    for ep, adv in sorted(chosen, key=lambda e: -e[0].tokens.size):
      spans = sorted(ep.segment_bounds(), key=lambda se: se[0] - se[1])
      # Place every segment on a trial fill first: nothing is written unless all of them fit.
      trial, where = fill.copy(), []
      for start, end in spans:
        fits = np.nonzero(trial + (end - start) <= length)[0]
        if fits.size == 0:
          break
        r = int(fits[0])
        where.append((r, int(trial[r]), start, end))
        trial[r] += end - start
      if len(where) < len(spans):
        self.stats.overflow_episodes += 1
        log.warning("episode %s (%d segments) does not fit the step's %d rows; dropped whole "
                    "(counted)", ep.episode_id, len(spans), rows)
        continue
      trained = ep.loss_mask.astype(bool)
      for r, s, start, end in where:
        e = s + end - start
        segs[r] += 1
        b["tokens"][r, s:e] = ep.tokens[start:end]
        b["positions"][r, s:e] = np.arange(end - start)
        b["segment_ids"][r, s:e] = segs[r]
        m = trained[start:end]
        b["loss_mask"][r, s:e] = m
        b["behaviour_logprobs"][r, s:e] = np.where(m, ep.behaviour_logprobs[start:end], 0.0)
        b["policy_versions"][r, s:e] = np.where(m, ep.policy_versions[start:end], 0)
        b["advantages"][r, s:e] = adv
        if self.include_routing:
          b["routing"][r, s:e] = np.transpose(ep.routing[:, start:end], (1, 0, 2))
      fill = trial
      packed += 1
    bucket = rows // self.cfg.row_buckets
    used = int(np.count_nonzero(fill))  # first-fit: the filled rows are the first ones
    keep = max(1, -(-used // bucket)) * bucket
    if keep < rows:
      b = {name: a[:keep] for name, a in b.items()}
    return b, packed

  # -- checkpointing -------------------------------------------------------------------------
  def get_state(self) -> dict:
    return {"source": self._it.get_state(), "stats": dataclasses.asdict(self.stats),
            "lost_carry": self._lost_carry}

  def set_state(self, state: dict) -> None:
    self._it.set_state(state["source"])
    st = dict(state["stats"])
    self.stats = StepStats(**st)
    self.stats.lost_shards = list(self.stats.lost_shards)
    self._log.counts = self.stats.rejections = dict(st.get("rejections", {}))
    self._lost_carry = int(state.get("lost_carry", 0))
