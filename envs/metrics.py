"""Aggregate metrics over trajectories: rewards without infra failures, hack counts, limits hit.

Infrastructure failures are counted separately and excluded from reward means: they say nothing
about the policy (and the learner masks them out).
"""

from __future__ import annotations

import collections
from typing import Iterable

from envs import hacks
from envs.harness import trajectory as traj_lib


def summarize(trajs: Iterable[traj_lib.Trajectory]) -> dict[str, float]:
  trajs = list(trajs)
  ok = [t for t in trajs if t.status != traj_lib.INFRA]
  out: dict[str, float] = {
      "episodes": len(trajs),
      "infra_failures": len(trajs) - len(ok),
      "reward_mean": sum(t.reward for t in ok) / len(ok) if ok else float("nan"),
      "solved_rate": (sum((t.test_reward or 0.0) >= 1.0 for t in ok) / len(ok)
                      if ok else float("nan")),
      "hacked_episodes": sum(bool(t.hack_flags) for t in ok),
      "malformed_calls": sum(t.malformed_calls for t in ok),
      "summarised_episodes": sum(len(t.segments) > 1 for t in ok),
      "model_tokens": sum(t.num_model_tokens for t in ok),
  }
  flags = collections.Counter(f for t in ok for f in t.hack_flags)
  for f in hacks.FLAGS:
    out[f"hack/{f}"] = flags.get(f, 0)
  finishes = collections.Counter(t.finish_reason for t in trajs)
  for reason, count in finishes.items():
    out[f"finish/{reason}"] = count
  return out
