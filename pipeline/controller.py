"""The rollout controller: draws tasks, asks the samplers for n attempts per prompt, grades each
attempt in the sandbox fleet, and hands finished groups to the learner in release order.

Bounded staleness: group g feeds learner step s(g) = g // prompts_per_step, which the learner
trains at policy version s(g) (its version equals its step, restarts included). It may start only
when every live sampler serves policy version >= s(g) - k (or >= v - k once a sampler serves a
newer version v), so no token the learner trains at step s(g) comes from a policy more than k
versions old (k = 0 is synchronous RL: the rollouts of step s
start after the weights of step s reach every sampler). Weight swaps may still land while a group
is generating; the engine records the version per token.

Release order: groups finish out of order (long-tailed lengths), but are written in the order
they were started, so learner step s consumes exactly the groups released for it. Every attempt
is written, including those lost to infrastructure (flagged `infra_failure`, masked out of the
group's advantages, never scored as a wrong answer), so each step's record count is exact.

Restarts and faults: group g's task is a pure function of (seed, tasks, g) (`task_for`), and a
restarted controller resumes after the groups on disk (`resume`), so a kill between writes
neither repeats nor skips a task. A failed write (OSError) is retried with back-off and a
persistent one stops the run with `WriteFailed`, naming the path and the error. `summary`
counts what the run generated, wrote, retried and lost.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import re
import threading
import time
from typing import Callable, Optional, Sequence

from envs import reward as reward_lib
from envs.harness import single_turn
from envs.tasks import task_format
from moe.tokenizer import ByteTokenizer
from pipeline import episodes as episodes_lib
from pipeline import faults
from pipeline import grade_cache as grade_cache_lib
from pipeline import samplers as samplers_lib
from pipeline.config import PipelineConfig
from rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

_GROUP_ID = re.compile(r"g(\d+)-(.+)")


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


class WriteFailed(RuntimeError):
  """A group could not be written after every retry: the run stops (nothing is skipped)."""


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
    sink_path: where `sink` writes (named in write errors).
    write_attempts: tries per group write; an OSError from `sink` (a full disk, a permission
      or network-filesystem hiccup) is retried with doubling back-off from `write_backoff_s`,
      and a write still failing after that many tries stops the run with `WriteFailed`. The
      sink must take the same episodes again after it raised (local.group_sink does).
    sampler_wait_s: how long the run waits for a dead sampler to rejoin when none is live
      before it stops.
  """

  def __init__(self, tasks: Sequence[task_format.Task], samplers, pool, sink: Callable, *,
               config: PipelineConfig, reward_config=reward_lib.RewardConfig(),
               on_group: Optional[Callable[[GroupResult], None]] = None,
               grade_fn: Optional[Callable] = None, tokenizer=None,
               sink_path: Optional[str] = None, write_attempts: int = 5,
               write_backoff_s: float = 0.5, sampler_wait_s: float = 300.0):
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
    self._epochs: list[list] = []
    self._grader = concurrent.futures.ThreadPoolExecutor(config.grade_workers)
    self._lock = threading.Condition()
    self._finished: dict[int, GroupResult] = {}
    self._error: Optional[BaseException] = None
    self.sink_path = sink_path
    self.write_attempts = write_attempts
    self.write_backoff_s = write_backoff_s
    self.sampler_wait_s = sampler_wait_s
    self.wait_s = 0.0
    self.groups_written = 0
    self.resumed_at = 0
    # The run's counts (see `summary`).
    self.episodes_generated = 0
    self.episodes_written = 0
    self.infra_failures = 0
    self.write_retries = 0

  # -- task order ----------------------------------------------------------------------------
  def task_for(self, index: int) -> task_format.Task:
    """The task of group `index`: the tasks in a seeded order, reshuffled every pass.

    A pure function of (seed, tasks, index), not a stream's state, so a restarted controller
    that resumes at group N (see `resume`) draws exactly the tasks a run without the restart
    would have: none twice, none skipped.
    """
    epoch, pos = divmod(index, len(self.tasks))
    while len(self._epochs) <= epoch:  # pass e is the e-th shuffle of one seeded generator
      order = list(self.tasks)
      self._order.shuffle(order)
      self._epochs.append(order)
    return self._epochs[epoch][pos]

  def resume(self, written_group_ids: Sequence[str]) -> int:
    """Continues after the groups already on disk; returns the next group index.

    `written_group_ids` holds every record's `group_id` (`g<index>-<task_id>`) in the
    trajectory directory. The written groups must be exactly 0..N-1, each with all its
    attempts and each the task this order assigns to its index; anything else (a gap, a group
    twice, another seed or task list) is refused, since resuming would skip or repeat tasks.
    A group launched but not written before a crash is not on disk, so it is launched again
    (once) with the same index and task.
    """
    counts: dict[int, int] = {}
    for gid in written_group_ids:
      m = _GROUP_ID.fullmatch(str(gid))
      if m is None:
        raise ValueError(f"record group_id {gid!r} is not g<index>-<task_id>")
      index, task_id = int(m.group(1)), m.group(2)
      if self.task_for(index).task_id != task_id:
        raise ValueError(
            f"written group {index} is task {task_id!r} but this controller's order (seed "
            f"{self.cfg.seed}, {len(self.tasks)} tasks) gives {self.task_for(index).task_id!r}: "
            "the trajectories were written by a run with other tasks or another seed")
      counts[index] = counts.get(index, 0) + 1
    n = len(counts)
    if sorted(counts) != list(range(n)):
      missing = sorted(set(range(max(counts) + 1)) - set(counts))
      raise ValueError(f"written groups are not 0..{n - 1}: missing {missing[:10]}")
    short = {i: c for i, c in counts.items() if c != self.cfg.attempts}
    if short:
      raise ValueError(f"groups with other than {self.cfg.attempts} records: "
                       f"{dict(list(short.items())[:10])}")
    self.groups_written = n
    self.resumed_at = n
    return n

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
            reward=g.reward if ok else None, infra_failure=not ok, hack_flags=g.hack_flags))
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
      self.episodes_generated += len(eps)
      self._lock.notify_all()

  # -- main loop -----------------------------------------------------------------------------
  def run(self, num_steps: int, stop: Optional[threading.Event] = None) -> int:
    """Produces the groups of `num_steps` learner steps; returns how many groups were written.

    Writes happen on this thread in release order while later groups are being generated.
    """
    stop = stop or threading.Event()
    total = num_steps * self.cfg.prompts_per_step
    launched = next_write = self.groups_written
    try:
      while next_write < total and not stop.is_set():
        # Launch every group the staleness bound allows, then write what is finished in order.
        while launched < total and not stop.is_set():
          step = launched // self.cfg.prompts_per_step
          v = self._min_version(stop)
          if v is None:
            break  # stopped while waiting for a sampler
          # The bound is on the learner's version when it trains this group: version == step
          # (pipeline.learner_loop keeps it so across restarts) and it never goes back, so a
          # sampler already serving a newer version means the learner is past `step`.
          learner_version = max(step, self.samplers.newest_version or 0)
          if v < learner_version - self.cfg.max_staleness:
            break
          self._launch(launched, self.task_for(launched), v)
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
        self._write(result, stop)
        next_write += 1
        self.groups_written = next_write
        self.episodes_written += len(result.episodes)
        self.infra_failures += result.infra_failures
        # A kill here (tests: RL_FAULTS=controller.after_write@K) leaves K groups on disk and
        # later ones launched but unwritten; `resume` must pick up at group K.
        faults.point("controller.after_write")
        if self.on_group is not None:
          self.on_group(result)
    finally:
      self._grader.shutdown(wait=not stop.is_set())
    return self.groups_written

  def _min_version(self, stop: threading.Event) -> Optional[int]:
    """The samplers' oldest version; with none live, waits (probing the dead ones, which
    rejoin once restarted) up to `sampler_wait_s`, then stops the run. None if `stop` is set."""
    v = self.samplers.min_version()
    if v is not None:
      return v
    log.warning("no live sampler; waiting up to %.0fs for one to come back", self.sampler_wait_s)
    deadline = time.monotonic() + self.sampler_wait_s
    while not stop.is_set():
      if time.monotonic() > deadline:
        raise RuntimeError(f"no live sampler is left (none came back in {self.sampler_wait_s}s)")
      stop.wait(0.2)
      v = self.samplers.min_version()
      if v is not None:
        return v
    return None

  def _write(self, result: GroupResult, stop: threading.Event) -> None:
    """Hands one group to the sink, retrying OSErrors with back-off (see `write_attempts`)."""
    where = self.sink_path or "the trajectory sink"
    delay = self.write_backoff_s
    for attempt in range(1, self.write_attempts + 1):
      try:
        self.sink(result.episodes)
        return
      except OSError as e:
        if attempt == self.write_attempts:
          raise WriteFailed(
              f"could not write group {result.index} ({result.task_id}) to {where}: "
              f"{type(e).__name__}: {e} "
              f"(failed {attempt} times); stopping the run. Groups 0..{result.index - 1} are "
              "written; a restarted controller resumes at this group.") from e
        self.write_retries += 1
        log.warning("writing group %d to %s failed (%s: %s); retry %d/%d in %.2fs",
                    result.index, where, type(e).__name__, e, attempt, self.write_attempts - 1,
                    delay)
        time.sleep(delay)  # not cut short by `stop`: a finished group is written or refused
        delay = min(2 * delay, 30.0)

  def summary(self) -> dict:
    """The run's counts: episodes generated (graded by this process), written, attempts lost
    to infrastructure (written, flagged and masked), sampler requests and writes retried, and
    episodes lost (generated but never written: dropped when the run stopped or failed).
    `resumed_at` is the group this process started at (the groups a previous one wrote)."""
    with self._lock:
      generated = self.episodes_generated
    return {"groups_written": self.groups_written, "resumed_at": self.resumed_at,
            "episodes_generated": generated, "episodes_written": self.episodes_written,
            "infra_failures": self.infra_failures,
            "sampler_retries": int(getattr(self.samplers, "retries", 0)),
            "write_retries": self.write_retries,
            "episodes_lost": generated - self.episodes_written}
