"""Fleet jobs that run episodes: `fn(host, payload)` functions for `envs.sandbox.fleet`.

`grade_job` grades one attempt's final files, so that grading alone can run in a (Ray) fleet
while the episode runs where its sampler is (pipeline/grading.py). They live here, beside the
harness they run, rather than in the fleet: the fleet is part of the sandbox layer and knows
nothing of policies, tasks or rewards. Each is a module-level function, so Ray
can pickle it by reference.
"""

from __future__ import annotations

from envs import reward
from envs.harness import agent_loop
from envs.harness import single_turn
from envs.sandbox import fleet


def single_turn_job(host: fleet.Host, payload: dict):
  """payload: {"task", "policy", "n", ...run_single_turn kwargs} -> list[Trajectory]."""
  kw = dict(payload)
  return single_turn.run_single_turn(kw.pop("task"), kw.pop("policy"), pool=host.pool, **kw)


def episode_job(host: fleet.Host, payload: dict):
  """payload: {"task", "policy", "config"?} -> Trajectory (multi-turn agent loop)."""
  kw = dict(payload)
  return agent_loop.run_episode(kw.pop("task"), kw.pop("policy"), pool=host.pool, **kw)


def grade_job(host: fleet.Host, payload: dict):
  """payload: {"task", "files", "config"?, "hack_flags"?} -> envs Grade (the hidden tests run
  in a sandbox of the host's pool: envs.reward.grade)."""
  kw = dict(payload)
  return reward.grade(kw.pop("task"), kw.pop("files"), pool=host.pool, **kw)
