"""Settings of the asynchronous RL pipeline (plain dataclass; gin binds it at the entry points)."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

GRADERS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How rollouts are produced and consumed.

  Attributes:
    max_staleness: k, the most policy versions a trained trajectory may lag the learner. 0 is
      synchronous RL: the rollouts of step s start only once every sampler serves version s.
    prompts_per_step: prompts (GRPO groups) each learner step consumes.
    attempts: samples per prompt (the group size n).
    max_new_tokens: generation budget per attempt.
    temperature: sampling temperature of the rollouts.
    top_p: nucleus sampling mass of the rollouts.
    seq_len: learner row length (an episode must fit in one row).
    batch_rows: learner rows per step; every step's episodes are packed into at most this many.
    row_buckets: the packed batch is cut to the smallest multiple of batch_rows / row_buckets
      rows that holds every packed episode, so a step of short episodes, or one whose
      zero-variance groups were filtered, trains fewer rows; the learner compiles at most
      row_buckets shapes. 1: always batch_rows rows. The bucket (batch_rows / row_buckets) must
      be a multiple of the learner's batch shards x micro-batches x minibatches.
    grade_workers: threads grading attempts in sandboxes at once.
    grade_cache: an attempt whose files were already graded for the same task reuses that grade
      instead of starting a sandbox (pipeline/grade_cache.py; only for deterministic tests,
      as the built-in suites' are).
    max_request_attempts: a sampler request that fails is retried on another sampler up to
      this many times in all before its attempts are recorded as infrastructure failures.
    request_timeout_s: a sampler request that takes longer is abandoned and retried.
    seed: seeds the task order and every request's sampling seed.
    filter_zero_variance_groups: dynamic sampling (DAPO): a group whose valid attempts all got
      the same reward has GRPO advantage 0 on every token, so it adds no policy gradient, yet
      under token-mean aggregation its tokens enlarge the denominator and shrink the update of
      the groups that do carry signal (and a KL term would still train on them). With this on,
      the learner leaves such groups out of the step's batch; their records are still consumed
      by their own step, so step boundaries, record counts and resumption are unchanged.
      Either way they are counted per step (`zero_variance_groups`). Off by default: DAPO
      refills the batch by sampling more prompts, which an exact record count per step cannot
      do, so filtering makes a step's trained episodes (and its effective batch) depend on the
      rewards; runs opt in. A step whose groups are all zero-variance is trained unfiltered (all
      advantages 0, as with this off) rather than left empty, which the learner refuses
      (pipeline.learner_loop.EmptyStepError). Reward hacking is penalised where rewards are
      made (envs.reward.RewardConfig.hack_penalty / zero_on_hack) and counted per step
      (`hack_flagged`).
    grader: where attempts are graded (pipeline/grading.py). "local": the controller's own warm
      sandbox pool. "ray": a Ray sandbox fleet (envs.sandbox.fleet_ray.RayFleet), one actor per
      host with its own warm pool; a host that dies has its grades re-run on another. The agent's
      tool calls run in the local pool either way.
    grader_hosts: the Ray fleet's host actors (grader "ray").
    grader_pool: warm sandboxes per Ray host.
    grader_resources: custom Ray resources each fleet host takes (e.g. {"grader_node": 1}: hosts
      only on nodes with that label, as many per node as it has units); None: any node. Hosts
      are spread over the nodes that qualify.
    ray_address: the Ray cluster the fleet joins ("auto", "HOST:PORT", "ray://HOST:PORT"); "":
      the Ray this process already initialised, else $RAY_ADDRESS's (set for every part the
      Ray executor starts, launch/ray_executor.py), else a new local one.
    negative_advantage_scale: multiplies the GRPO advantages of below-average attempts
      (rl.objectives.group_advantages): 1 is GRPO, 0 trains only on the attempts that did better
      than their group's mean.
  """

  max_staleness: int = 2
  prompts_per_step: int = 8
  attempts: int = 8
  max_new_tokens: int = 48
  temperature: float = 1.0
  top_p: float = 1.0
  seq_len: int = 128
  batch_rows: int = 64
  row_buckets: int = 1
  grade_workers: int = 4
  grade_cache: bool = False
  max_request_attempts: int = 3
  request_timeout_s: float = 300.0
  seed: int = 0
  filter_zero_variance_groups: bool = False
  negative_advantage_scale: float = 1.0
  grader: str = "local"
  grader_hosts: int = 2
  grader_pool: int = 2
  grader_resources: Optional[Mapping[str, float]] = None
  ray_address: str = ""

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"PipelineConfig: {msg}")
    need(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
    need(self.prompts_per_step >= 1, "prompts_per_step must be >= 1")
    need(self.attempts >= 2, "attempts must be >= 2 (group-relative advantages need a group)")
    need(self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
    need(self.temperature > 0, "rollouts need temperature > 0")
    need(0 < self.top_p <= 1, "top_p must lie in (0, 1]")
    need(self.seq_len >= 8 and self.batch_rows >= 1, "seq_len >= 8 and batch_rows >= 1")
    need(self.row_buckets >= 1 and self.batch_rows % self.row_buckets == 0,
         f"row_buckets ({self.row_buckets}) must be >= 1 and divide batch_rows "
         f"({self.batch_rows})")
    need(0.0 <= self.negative_advantage_scale <= 1.0,
         f"negative_advantage_scale must lie in [0, 1], got {self.negative_advantage_scale}")
    need(self.grader in GRADERS, f"grader must be one of {GRADERS}, got {self.grader!r}")
    need(self.grader_hosts >= 1 and self.grader_pool >= 1,
         "grader_hosts and grader_pool must be >= 1")
    need(all(v > 0 for v in (self.grader_resources or {}).values()),
         f"grader_resources must be positive amounts, got {self.grader_resources}")
    need(self.grade_workers >= 1 and self.max_request_attempts >= 1,
         "grade_workers and max_request_attempts must be >= 1")

  @property
  def episodes_per_step(self) -> int:
    return self.prompts_per_step * self.attempts
