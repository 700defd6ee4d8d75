"""Single-turn episodes: the model writes a function body, hidden tests give the reward.

This is the mode the tiny demo model is trained in (see suite_pyfunc): the prompt is the
task's instructions as a comment plus the function signature, the model continues with the body
and stops at EOS, a blank line or a new top-level statement (`STOP`; a task with its own
`stop` strings, such as HumanEval's, stops at those instead), and the file `solution.py` =
prompt + completion is graded in a fresh sandbox. `n` samples per prompt make a GRPO group.

How the task is put to the model and how its answer becomes solution.py is a style: the
default `COMPLETION` (above, for base models), or `envs.harness.chat_style.ChatStyle`, which asks
a chat model in a user message rendered with its chat template and grades the code in its answer.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

from envs import reward as reward_lib
from envs.harness import policy as policy_lib
from envs.harness import trajectory as traj_lib
from envs.sandbox import pool as pool_lib
from envs.tasks import task_format

STOP = ("\n\n", "\ndef ", "\nclass ", "\n#", "\nif __name__")


def stop_strings(task: task_format.Task) -> tuple[str, ...]:
  """Where a completion of `task.prompt` ends: the task's own `stop`, else `STOP`."""
  return tuple(task.stop) or STOP


def solution_file(task: task_format.Task, completion_text: str) -> str:
  """`solution.py`: the prompt and the completion up to (and with the newline of) its first stop
  string, so a sampler that ran past a stop cannot add code after it."""
  body = completion_text
  for s in stop_strings(task):
    i = body.find(s)
    if i >= 0:
      body = body[:i + 1]
  return task.prompt + body


class CompletionStyle:
  """Completion style: the model continues `task.prompt` (after `policy.start_ids()`), ends at
  `stop_strings(task)`, and solution.py is `solution_file(task, completion)`.

  A style is any object with these three methods (`chat_style.ChatStyle` is the other one).
  """

  def prompt_ids(self, task: task_format.Task, policy: policy_lib.Policy) -> list[int]:
    return policy.start_ids() + policy.encode(task.prompt)

  def stop(self, task: task_format.Task) -> tuple[str, ...]:
    return stop_strings(task)

  def solution(self, task: task_format.Task, completion_text: str) -> str:
    return solution_file(task, completion_text)


COMPLETION = CompletionStyle()


def run_single_turn(task: task_format.Task, policy: policy_lib.Policy, *,
                    pool: pool_lib.WarmPool, n: int = 1, max_tokens: int = 96,
                    temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                    reward_config: reward_lib.RewardConfig = reward_lib.RewardConfig(),
                    grade_threads: int = 4,
                    grade_fn: Callable[..., reward_lib.Grade] = reward_lib.grade,
                    style=COMPLETION) -> list[traj_lib.Trajectory]:
  """Samples `n` completions of `task.prompt` (one request) and grades each with `grade_fn`
  (envs.reward.grade's signature); one Trajectory per sample, its one segment holding exactly
  the prompt sent (`style.prompt_ids`: by default `policy.start_ids()` + the encoded prompt) and
  the tokens returned. `style` (see `CompletionStyle`) also gives the stop strings and
  solution.py."""
  if not task.prompt:
    raise ValueError(f"task {task.task_id} has no single-turn prompt")
  t0 = time.monotonic()
  prompt_ids = style.prompt_ids(task, policy)
  try:
    comps = policy.complete(prompt_ids, max_tokens=max_tokens, stop=style.stop(task),
                            temperature=temperature, seed=seed, n=n, top_p=top_p)
  except policy_lib.PolicyError as e:
    seg = traj_lib.Segment()
    seg.add_text_tokens(prompt_ids)
    return [traj_lib.Trajectory(
        task_id=task.task_id, segments=[seg], tool_calls=[], status=traj_lib.INFRA,
        reward=None, test_reward=None, hack_flags={}, finish_reason="error", num_turns=0,
        timings={"total_s": time.monotonic() - t0}, infra_error=f"policy failed: {e}")
            for _ in range(n)]
  gen_s = time.monotonic() - t0

  def grade_one(comp: policy_lib.Completion) -> traj_lib.Trajectory:
    t = time.monotonic()
    files = dict(task.files)
    files["solution.py"] = style.solution(task, comp.text)
    g = grade_fn(task, files, pool=pool, config=reward_config)
    seg = traj_lib.Segment()
    seg.add_text_tokens(prompt_ids)
    seg.add_completion(comp)
    return traj_lib.Trajectory(
        task_id=task.task_id, segments=[seg], tool_calls=[], status=g.status, reward=g.reward,
        test_reward=g.test_reward, hack_flags=g.hack_flags, finish_reason="single_turn",
        num_turns=1, timings={"generate_s": gen_s, "grade_s": time.monotonic() - t,
                              "total_s": time.monotonic() - t0},
        infra_error=g.detail if g.status != reward_lib.OK else None,
        test_outcomes=g.outcomes, final_files={"solution.py": files["solution.py"]},
        completion_text=comp.text)

  with concurrent.futures.ThreadPoolExecutor(max(1, min(grade_threads, n))) as ex:
    return list(ex.map(grade_one, comps))
