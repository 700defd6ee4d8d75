"""Fleet jobs that run episodes: `fn(host, payload)` functions for `envs.sandbox.fleet`.

They live here, beside the harness they run, rather than in the fleet: the fleet is part of the
sandbox layer and knows nothing of policies or tasks. Each is a module-level function, so Ray
can pickle it by reference.
"""

from __future__ import annotations

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
