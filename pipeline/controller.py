"""The rollout controller: draws tasks, asks the samplers for n attempts per prompt, grades each
attempt in the sandbox fleet, and hands finished groups to the learner in release order.

Bounded staleness: group g feeds learner step s(g) = g // prompts_per_step. It may start only
when every live sampler serves policy version >= s(g) - k, so no token the learner trains at step
s(g) comes from a policy more than k versions old (k = 0 is synchronous RL: the rollouts of step s
start after the weights of step s reach every sampler). Weight swaps may still land while a group
is generating; the engine records the version per token.

Release order: groups finish out of order (long-tailed lengths), but are written in the order
they were started, so learner step s consumes exactly the groups released for it. Every attempt
is written, including those lost to infrastructure (flagged `infra_failure`, masked out of the
group's advantages, never scored as a wrong answer), so each step's record count is exact.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from typing import Callable, Optional, Sequence

from envs import reward as reward_lib
from envs.harness import single_turn
from envs.tasks import task_format
from moe.tokenizer import ByteTokenizer
from pipeline import episodes as episodes_lib
from pipeline import grade_cache as grade_cache_lib
from pipeline import samplers as samplers_lib
from pipeline.config import PipelineConfig
from rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GroupResult:
  """One prompt's finished attempts, ready to write."""
  index: int
  step: int
  task_id: str
  episodes: list
  rewards: list          # graded rewards (None for infra failures)
  passed: list           # test reward == 1 (all hidden tests passed)
  start_version: int
  gen_tokens: int
  gen_s: float
  grade_s: float
  infra_failures: int
  hack_flagged: int
  retries: int


class RolloutController:
  """Produces `num_steps * prompts_per_step` groups into `sink`.

  Args:
    tasks: single-turn tasks to draw prompts from (cycled in a seeded order).
    samplers: a `pipeline.samplers.SamplerSet`.
    pool: the sandbox pool (or fleet pool) grading runs in.
    sink: called with each episode list of a group, in release order (e.g. a TrajectoryWriter's
      `write_all` followed by `flush`).
    config: PipelineConfig.
    reward_config: envs RewardConfig.
    on_group: optional callback with each GroupResult (metrics).
    grade_fn: grading function (task, files, pool, config) -> envs Grade; defaults to
      envs.reward.grade (tests inject failures through it).
  """

  def __init__(self, tasks: Sequence[task_format.Task], samplers, pool, sink: Callable, *,
               config: PipelineConfig, reward_config=reward_lib.RewardConfig(),
               on_group: Optional[Callable[[GroupResult], None]] = None,
               grade_fn: Optional[Callable] = None, tokenizer=None):
    if not tasks:
      raise ValueError("the controller needs at least one task")
    missing = [t.task_id for t in tasks if not t.prompt]
    if missing:
      raise ValueError(f"tasks without a single-turn prompt: {missing[:5]}")
    self.tasks = list(tasks)
    self.samplers = samplers
    self.pool = pool
    self.sink = sink
    self.cfg = config
    self.reward_config = reward_config
    self.on_group = on_group
    grade = grade_fn or (lambda task, files, pool, config: reward_lib.grade(
        task, files, pool=pool, config=config))
    # With config.grade_cache, repeated attempts reuse their grade (pipeline/grade_cache.py).
    self.grade_cache = grade_cache_lib.GradeCache(grade) if config.grade_cache else None
    self.grade_fn = self.grade_cache or grade
    self.tok = tokenizer or ByteTokenizer()
    self._order = random.Random(config.seed)
    self._grader = concurrent.futures.ThreadPoolExecutor(config.grade_workers)
    self._lock = threading.Condition()
    self._finished: dict[int, GroupResult] = {}
    self._error: Optional[BaseException] = None
    self.wait_s = 0.0
    self.groups_written = 0

  # -- task order ----------------------------------------------------------------------------
  def _task_stream(self):
    while True:
      order = list(self.tasks)
      self._order.shuffle(order)
      yield from order

  # -- one group -----------------------------------------------------------------------------
  def _launch(self, index: int, task: task_format.Task, start_version: int) -> None:
    cfg = self.cfg
    prompt_ids = [self.tok.bos_id] + self.tok.encode(task.prompt)
    params = SamplingParams(n=cfg.attempts, max_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, top_p=cfg.top_p,
                            stop_token_ids=(self.tok.eos_id,), stop=single_turn.STOP,
                            seed=(cfg.seed * 1_000_003 + index) % (2**31))
    t0 = time.monotonic()
    retries_before = self.samplers.retries
    fut = self.samplers.submit(prompt_ids, params, timeout=cfg.request_timeout_s)

    def on_done(f):
      try:
        comps = f.result()
      except samplers_lib.RequestRejected as e:
        # Not an infrastructure failure: every attempt of every group would be refused the same
        # way, and masking them would train on nothing. Stop the run with the sampler's reason.
        with self._lock:
          self._error = RuntimeError(
              f"group {index} ({task.task_id}): the sampler rejected the request: {e}")
          self._lock.notify_all()
        return
      except Exception as e:  # pylint: disable=broad-except
        log.warning("group %d (%s): every sampler attempt failed: %s", index, task.task_id, e)
        comps = None
      gen_s = time.monotonic() - t0
      try:
        self._grader.submit(self._grade_group, index, task, prompt_ids, comps, start_version,
                            gen_s, self.samplers.retries - retries_before)
      except RuntimeError:  # the run has ended (stopped or failed): nothing will write this group
        log.info("group %d finished after the run ended; dropped", index)

    fut.add_done_callback(on_done)

  def _grade_group(self, index, task, prompt_ids, comps, start_version, gen_s, retries):
    try:
      t0 = time.monotonic()
      gid = f"g{index:06d}-{task.task_id}"
      n = self.cfg.attempts
      eps, rewards, passed = [], [], []
      infra = hacked = 0
      for j in range(n):
        comp = None if comps is None else comps[j]
        eid = f"{gid}-a{j}"
        if comp is None:
          eps.append(episodes_lib.from_completion(
              group_id=gid, episode_id=eid, group_size=n, prompt_ids=prompt_ids,
              completion=None, reward=None, infra_failure=True))
          rewards.append(None)
          passed.append(False)
          infra += 1
          continue
        files = dict(task.files)
        files["solution.py"] = single_turn.solution_file(task, self.tok.decode(comp.token_ids))
        g = self.grade_fn(task, files, self.pool, self.reward_config)
        ok = g.status == reward_lib.OK
        infra += not ok
        hacked += bool(g.hack_flags)
        eps.append(episodes_lib.from_completion(
            group_id=gid, episode_id=eid, group_size=n, prompt_ids=prompt_ids, completion=comp,
            reward=g.reward if ok else None, infra_failure=not ok))
        rewards.append(g.reward if ok else None)
        passed.append(bool(ok and g.test_reward == 1.0))
      result = GroupResult(
          index=index, step=index // self.cfg.prompts_per_step, task_id=task.task_id,
          episodes=eps, rewards=rewards, passed=passed, start_version=start_version,
          gen_tokens=sum(len(c.token_ids) for c in comps or ()), gen_s=gen_s,
          grade_s=time.monotonic() - t0, infra_failures=infra, hack_flagged=hacked,
          retries=retries)
    except BaseException as e:  # pylint: disable=broad-except
      with self._lock:
        self._error = e
        self._lock.notify_all()
      raise
    with self._lock:
      self._finished[index] = result
      self._lock.notify_all()

  # -- main loop -----------------------------------------------------------------------------
  def run(self, num_steps: int, stop: Optional[threading.Event] = None) -> int:
    """Produces the groups of `num_steps` learner steps; returns how many groups were written.

    Writes happen on this thread in release order while later groups are being generated.
    """
    stop = stop or threading.Event()
    total = num_steps * self.cfg.prompts_per_step
    tasks = self._task_stream()
    launched = next_write = self.groups_written
    try:
      while next_write < total and not stop.is_set():
        # Launch every group the staleness bound allows, then write what is finished in order.
        while launched < total and not stop.is_set():
          step = launched // self.cfg.prompts_per_step
          v = self.samplers.min_version()
          if v is None:
            raise RuntimeError("no live sampler is left")
          if v < step - self.cfg.max_staleness:
            break
          self._launch(launched, next(tasks), v)
          launched += 1
        with self._lock:
          if self._error is not None:
            raise RuntimeError(f"rollout failed: {self._error}") from self._error
          if next_write not in self._finished:
            t0 = time.monotonic()
            self._lock.wait(timeout=0.02)
            self.wait_s += time.monotonic() - t0
            continue
          result = self._finished.pop(next_write)
        self.sink(result.episodes)
        next_write += 1
        self.groups_written = next_write
        if self.on_group is not None:
          self.on_group(result)
    finally:
      self._grader.shutdown(wait=not stop.is_set())
    return self.groups_written
