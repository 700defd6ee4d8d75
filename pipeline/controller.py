"""The rollout controller: draws tasks, runs n attempts at each through the harness, and hands
finished groups to the learner in release order.

Episodes: every attempt runs through `envs.harness.attempts.run_attempts`, the path evaluation
scores with, over a `pipeline.sampler_policy.SamplerPolicy` (the sampler set behind the harness's
Policy protocol). A single-turn task is the one-turn case (one request for the group's n samples);
any other task is a multi-turn agent episode (tool calls, test output, self-summarisation), its n
attempts side by side. `pipeline.episodes.from_trajectory` turns each attempt into the learner's
record: exactly the tokens the sampler saw and wrote, the model's own tokens trained, one
segment per context window.

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
from envs.harness import agent_loop
from envs.harness import attempts as attempts_lib
from envs.tasks import task_format
from moe.tokenizer import ByteTokenizer
from pipeline import episodes as episodes_lib
from pipeline import faults
from pipeline import grade_cache as grade_cache_lib
from pipeline import sampler_policy
from pipeline.config import PipelineConfig

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
  turns: list = dataclasses.field(default_factory=list)       # per graded attempt
  tool_calls: list = dataclasses.field(default_factory=list)  # per graded attempt
  summarised: int = 0       # graded attempts that summarised themselves (> 1 segment)
  saw_failing_test: int = 0  # graded attempts whose visible tests failed at some point
  fixed_after_failure: int = 0  # ... and that then passed every hidden test


class WriteFailed(RuntimeError):
  """A group could not be written after every retry: the run stops (nothing is skipped)."""


class RolloutController:
  """Produces `num_steps * prompts_per_step` groups into `sink`.

  Args:
    tasks: the tasks to draw from (cycled in a seeded order): single-turn ones (with a prompt)
      and multi-turn repository tasks alike.
    samplers: a `pipeline.samplers.SamplerSet`.
    pool: the sandbox pool (or fleet pool) the agent's tools and grading run in.
    sink: called with each episode list of a group, in release order (e.g. a TrajectoryWriter's
      `write_all` followed by `flush`).
    config: PipelineConfig.
    reward_config: envs RewardConfig.
    on_group: optional callback with each GroupResult (metrics).
    grade_fn: grading function (task, files, pool, config[, hack_flags=]) -> envs Grade;
      defaults to envs.reward.grade (tests inject failures through it). At most
      `config.grade_workers` grades run at once.
    tokenizer: the model's tokenizer (default: the byte tokenizer of the tiny models).
    loop_config: the agent loop's settings for multi-turn tasks (context window, turns,
      summaries; its per-turn budget is `config.max_new_tokens`).
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
               loop_config: agent_loop.LoopConfig = agent_loop.LoopConfig(),
               sink_path: Optional[str] = None, write_attempts: int = 5,
               write_backoff_s: float = 0.5, sampler_wait_s: float = 300.0):
    if not tasks:
      raise ValueError("the controller needs at least one task")
    self.tasks = list(tasks)
    self.samplers = samplers
    self.pool = pool
    self.sink = sink
    self.cfg = config
    self.reward_config = reward_config
    self.on_group = on_group
    grade = grade_fn or (lambda task, files, pool, config, hack_flags=None: reward_lib.grade(
        task, files, pool=pool, config=config, hack_flags=hack_flags))
    # With config.grade_cache, repeated attempts reuse their grade (pipeline/grade_cache.py).
    self.grade_cache = grade_cache_lib.GradeCache(grade) if config.grade_cache else None
    self.grade_fn = self.grade_cache or grade
    self._grade_slots = threading.BoundedSemaphore(config.grade_workers)
    self._episode_slots = attempts_lib.episode_slots(pool, config.grade_workers)
    self.tok = tokenizer or ByteTokenizer()
    # Contexts start with BOS when the tokenizer has one (the project's models are trained so);
    # a checkpoint's tokenizer without one (Qwen) starts them with the prompt itself.
    self.policy = sampler_policy.SamplerPolicy(samplers, self.tok,
                                               add_bos=self.tok.bos_id is not None,
                                               timeout_s=config.request_timeout_s)
    self.settings = attempts_lib.AttemptSettings(
        max_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
        reward=reward_config, grade_threads=config.grade_workers,
        loop=dataclasses.replace(loop_config, max_tokens_per_turn=config.max_new_tokens))
    self._order = random.Random(config.seed)
    self._epochs: list[list] = []
    # Groups in flight at once: those the staleness bound lets start, with room for one more
    # step; each runs its attempts (threads of its own for multi-turn tasks) to the end.
    self._runner = concurrent.futures.ThreadPoolExecutor(
        (config.max_staleness + 2) * config.prompts_per_step, thread_name_prefix="group")
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
    self.episode_stats = {"graded": 0, "turns": 0, "tool_calls": 0, "summarised": 0,
                          "saw_failing_test": 0, "fixed_after_failure": 0}

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
  def _grade(self, task, files, *, pool, config, hack_flags=None):
    """The harness's grade function: `grade_fn`, at most `grade_workers` at once."""
    with self._grade_slots:
      if hack_flags:
        return self.grade_fn(task, files, pool, config, hack_flags=hack_flags)
      return self.grade_fn(task, files, pool, config)

  def _launch(self, index: int, task: task_format.Task, start_version: int) -> None:
    try:
      self._runner.submit(self._run_group, index, task, start_version)
    except RuntimeError:  # the run has ended (stopped or failed): nothing will write this group
      log.info("group %d launched after the run ended; dropped", index)

  def _run_group(self, index: int, task: task_format.Task, start_version: int) -> None:
    try:
      result = self._attempts(index, task, start_version)
    except BaseException as e:  # pylint: disable=broad-except
      with self._lock:
        self._error = e
        self._lock.notify_all()
      raise
    if result is None:
      return
    with self._lock:
      self._finished[index] = result
      self.episodes_generated += len(result.episodes)
      self._lock.notify_all()

  def _attempts(self, index: int, task: task_format.Task,
                start_version: int) -> Optional[GroupResult]:
    t0 = time.monotonic()
    n = self.cfg.attempts
    retries_before = getattr(self.samplers, "retries", 0)
    trajs = attempts_lib.run_attempts(
        task, self.policy, pool=self.pool, n=n, seed=(self.cfg.seed * 1_000_003 + index) % (2**31),
        settings=self.settings, grade_fn=self._grade, slots=self._episode_slots)
    if self.policy.rejected is not None:
      # Not an infrastructure failure: every attempt of every group would be refused the same
      # way, and masking them would train on nothing. Stop the run with the sampler's reason.
      with self._lock:
        self._error = RuntimeError(f"group {index} ({task.task_id}): the sampler rejected the "
                                   f"request: {self.policy.rejected}")
        self._lock.notify_all()
      return None
    gid = f"g{index:06d}-{task.task_id}"
    eps, rewards, passed = [], [], []
    turns, calls = [], []
    infra = hacked = summarised = saw_fail = fixed = 0
    for j, tr in enumerate(trajs):
      ep = episodes_lib.from_trajectory(tr, group_id=gid, episode_id=f"{gid}-a{j}", group_size=n)
      eps.append(ep)
      if ep.infra_failure:
        infra += 1
        rewards.append(None)
        passed.append(False)
        if tr.status == reward_lib.OK:
          log.warning("group %d attempt %d: no model tokens; masked", index, j)
        elif tr.infra_error:
          log.warning("group %d attempt %d lost to infrastructure: %s", index, j,
                      tr.infra_error)
        continue
      ok = tr.test_reward == 1.0
      rewards.append(float(tr.reward))
      passed.append(bool(ok))
      hacked += bool(tr.hack_flags)
      turns.append(tr.num_turns)
      calls.append(len(tr.tool_calls))
      summarised += len(tr.segments) > 1
      failed_tests = any(c.name == "run_tests" and not c.ok for c in tr.tool_calls)
      saw_fail += failed_tests
      fixed += failed_tests and ok
    return GroupResult(
        index=index, step=index // self.cfg.prompts_per_step, task_id=task.task_id,
        episodes=eps, rewards=rewards, passed=passed, start_version=start_version,
        gen_tokens=sum(t.num_model_tokens for t in trajs),
        gen_s=max(t.timings.get("generate_s", 0.0) for t in trajs),
        grade_s=sum(t.timings.get("grade_s", 0.0) for t in trajs), infra_failures=infra,
        hack_flagged=hacked, retries=getattr(self.samplers, "retries", 0) - retries_before,
        turns=turns, tool_calls=calls, summarised=summarised, saw_failing_test=saw_fail,
        fixed_after_failure=fixed)

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
        self._count(result)
        # A kill here (tests: RL_FAULTS=controller.after_write@K) leaves K groups on disk and
        # later ones launched but unwritten; `resume` must pick up at group K.
        faults.point("controller.after_write")
        if self.on_group is not None:
          self.on_group(result)
    finally:
      self._runner.shutdown(wait=not stop.is_set(), cancel_futures=stop.is_set())
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

  def _count(self, result: GroupResult) -> None:
    e = self.episode_stats
    e["graded"] += len(result.turns)
    e["turns"] += sum(result.turns)
    e["tool_calls"] += sum(result.tool_calls)
    e["summarised"] += result.summarised
    e["saw_failing_test"] += result.saw_failing_test
    e["fixed_after_failure"] += result.fixed_after_failure

  def summary(self) -> dict:
    """The run's counts: episodes generated (graded by this process), written, attempts lost
    to infrastructure (written, flagged and masked), sampler requests and writes retried, and
    episodes lost (generated but never written: dropped when the run stopped or failed).
    `resumed_at` is the group this process started at (the groups a previous one wrote).
    Over the written, graded attempts: mean turns and tool calls, how many summarised
    themselves, how many saw a visible test fail and how many of those then passed."""
    with self._lock:
      generated = self.episodes_generated
    e = self.episode_stats
    graded = max(e["graded"], 1)
    return {"groups_written": self.groups_written, "resumed_at": self.resumed_at,
            "episodes_generated": generated, "episodes_written": self.episodes_written,
            "infra_failures": self.infra_failures,
            "sampler_retries": int(getattr(self.samplers, "retries", 0)),
            "write_retries": self.write_retries,
            "episodes_lost": generated - self.episodes_written,
            "mean_turns": round(e["turns"] / graded, 3),
            "tool_calls_per_episode": round(e["tool_calls"] / graded, 3),
            "summarised_episodes": e["summarised"],
            "saw_failing_test": e["saw_failing_test"],
            "fixed_after_failure": e["fixed_after_failure"],
            "sampler_requests": self.policy.requests,
            "prompt_tokens_sent": self.policy.prompt_tokens}
