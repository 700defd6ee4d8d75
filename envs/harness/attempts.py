"""The one episode path: `n` attempts at a task, as RL trains them and evaluation scores them.

`run_attempts(task, policy, pool=..., n=..., settings=...)` is what the RL controller
(pipeline.controller) and evaluation (evaluation.evaluate) both call, so a training reward and an
evaluation number come from the same code. A task with a single-turn prompt (suite_pyfunc) is the
one-turn case: one request for all n samples (the engine shares their prefill), each graded
(`single_turn`). Any other task runs the multi-turn agent loop (`agent_loop`: tool calls, test
output, self-summarisation), its n episodes side by side in threads, each holding its own
sandbox until it submits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Optional

from envs import reward as reward_lib
from envs.harness import agent_loop
from envs.harness import policy as policy_lib
from envs.harness import single_turn
from envs.harness import trajectory as traj_lib
from envs.sandbox import pool as pool_lib
from envs.tasks import task_format

MODES = ("auto", "single_turn", "agent")


@dataclasses.dataclass(frozen=True)
class AttemptSettings:
  """How attempts are sampled and graded.

  mode: "auto" (single-turn when the task has a prompt, else the agent loop), "single_turn" or
    "agent".
  max_tokens: tokens per single-turn completion (the agent loop's budget is `loop`'s).
  temperature / top_p: sampling (both modes).
  reward: grading settings (both modes).
  loop: the agent loop's settings (its temperature, top_p, seed and reward are set from these).
  grade_threads: single-turn samples graded at once.
  single_turn_style: how a single-turn task is put to the model and its answer graded
    (`single_turn.COMPLETION`, or a `chat_style.ChatStyle` for a chat model).
  """
  mode: str = "auto"
  max_tokens: int = 96
  temperature: float = 1.0
  top_p: float = 1.0
  reward: reward_lib.RewardConfig = reward_lib.RewardConfig()
  loop: agent_loop.LoopConfig = agent_loop.LoopConfig()
  grade_threads: int = 4
  single_turn_style: Any = single_turn.COMPLETION

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def mode_of(task: task_format.Task, mode: str = "auto") -> str:
  """The mode `task` runs in under `mode` ("single_turn" or "agent")."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if mode == "auto":
    return "single_turn" if task.prompt else "agent"
  if mode == "single_turn" and not task.prompt:
    raise ValueError(f"task {task.task_id} has no single-turn prompt; use mode='agent' or 'auto'")
  return mode


def episode_slots(pool, reserved: int) -> threading.BoundedSemaphore:
  """How many multi-turn episodes may hold a sandbox at once, for callers that run many.

  An agent episode holds its sandbox for all its turns (mostly waiting on the sampler), and the
  pool caps live sandboxes (`WarmPool.max_live`): episodes started beyond the cap would wait in
  `acquire` and fail after its timeout as infrastructure errors. Callers pass the semaphore to
  every `run_attempts`, so the extra episodes wait for a slot instead, leaving `reserved`
  sandboxes for grading (which runs after the episode has given its own back).
  """
  cap = int(getattr(pool, "max_live", 0) or 4)
  return threading.BoundedSemaphore(max(1, cap - max(0, reserved)))


def run_attempts(task: task_format.Task, policy: policy_lib.Policy, *, pool: pool_lib.WarmPool,
                 n: int, seed: Optional[int], settings: AttemptSettings = AttemptSettings(),
                 grade_fn: Callable[..., reward_lib.Grade] = reward_lib.grade,
                 slots: Optional[threading.Semaphore] = None) -> list[traj_lib.Trajectory]:
  """`n` graded attempts at `task`; always n Trajectories, infrastructure failures included.

  Args:
    task: the task.
    policy: the model (envs.harness.policy.Policy).
    pool: sandboxes for the agent's tools and for grading.
    n: attempts (a GRPO group in RL, the samples of pass@k in evaluation).
    seed: the group's seed (attempt j of a multi-turn task uses seed + j); None samples
      unseeded.
    settings: AttemptSettings.
    grade_fn: envs.reward.grade or a wrapper with its signature (memoising, bounding).
    slots: a semaphore each multi-turn episode holds while it runs (see `episode_slots`); None
      runs the n episodes at once.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  if mode_of(task, settings.mode) == "single_turn":
    return single_turn.run_single_turn(
        task, policy, pool=pool, n=n, max_tokens=settings.max_tokens,
        temperature=settings.temperature, top_p=settings.top_p, seed=seed,
        reward_config=settings.reward, grade_threads=min(settings.grade_threads, n),
        grade_fn=grade_fn, style=settings.single_turn_style)
  loop = dataclasses.replace(settings.loop, temperature=settings.temperature,
                             top_p=settings.top_p, reward=settings.reward)

  def one(j: int) -> traj_lib.Trajectory:
    cfg = dataclasses.replace(loop, seed=None if seed is None else seed + j)
    with slots if slots is not None else contextlib.nullcontext():
      return agent_loop.run_episode(task, policy, pool=pool, config=cfg, grade_fn=grade_fn)

  if n == 1:
    return [one(0)]
  with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="attempt") as ex:
    return list(ex.map(one, range(n)))
