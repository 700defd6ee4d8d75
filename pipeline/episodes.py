"""Turning a graded completion into the learner's `rl.episodes.Episode`.

Alignment (what router replay needs): the learner runs its forward on prompt + completion and
position t's routing must be the experts the sampler used when it processed token t. The engine
returns `prompt_routing` for prompt positions 0..P-2 and, per generated token j, the routing of
the step whose input was the previous token (position P-1+j). Concatenated they cover positions
0..P+T-2; the final token was never fed to the sampler and predicts nothing, so its routing is
a copy of the previous position's (never used for a trained prediction).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from rl.episodes import Episode


def _routing(prompt_routing: Optional[np.ndarray], routing: Optional[np.ndarray],
             total: int) -> Optional[np.ndarray]:
  if prompt_routing is None or routing is None:
    return None
  r = np.concatenate([np.asarray(prompt_routing), np.asarray(routing)], axis=1)
  if r.shape[1] != total - 1:
    raise ValueError(f"routing covers {r.shape[1]} positions, expected {total - 1}")
  return np.concatenate([r, r[:, -1:]], axis=1).astype(np.uint8)


def from_completion(*, group_id: str, episode_id: str, group_size: int,
                    prompt_ids: Sequence[int], completion, reward: Optional[float],
                    infra_failure: bool = False, hack_flags: Sequence[str] = ()) -> Episode:
  """An Episode for one attempt.

  Args:
    group_id: the prompt's group (GRPO advantages are relative within it).
    episode_id: unique id of this attempt.
    group_size: attempts in the group.
    prompt_ids: the prompt tokens fed to the sampler.
    completion: a `rollout.engine.Completion` (token_ids, logprobs, routing, prompt_routing,
      policy_versions), or None when the attempt never got one (infrastructure failure).
    reward: the graded reward; None only with infra_failure.
    infra_failure: the attempt was lost to infrastructure: kept so the group completes, masked out
      of advantages and training, never scored as 0.
    hack_flags: the `envs.hacks` flags grading raised (the reward already carries the penalty);
      recorded so the learner counts them per step.
  """
  hack_flags = tuple(sorted(str(f) for f in hack_flags))
  prompt_ids = [int(t) for t in prompt_ids]
  if completion is None or not completion.token_ids:
    if not infra_failure:
      raise ValueError(f"{episode_id}: an attempt without tokens must be an infra failure")
    n = len(prompt_ids)
    return Episode(group_id=group_id, episode_id=episode_id, group_size=group_size,
                   tokens=np.asarray(prompt_ids, np.int32), loss_mask=np.zeros(n, np.int8),
                   behaviour_logprobs=np.zeros(n, np.float32),
                   policy_versions=np.zeros(n, np.int32), reward=0.0, infra_failure=True,
                   hack_flags=hack_flags)
  gen = [int(t) for t in completion.token_ids]
  total = len(prompt_ids) + len(gen)
  mask = np.zeros(total, np.int8)
  mask[len(prompt_ids):] = 1
  logp = np.zeros(total, np.float32)
  logp[len(prompt_ids):] = np.asarray(completion.logprobs, np.float32)
  versions = np.zeros(total, np.int32)
  versions[len(prompt_ids):] = np.asarray(completion.policy_versions, np.int32)
  if reward is None and not infra_failure:
    raise ValueError(f"{episode_id}: a graded attempt needs a reward")
  return Episode(
      group_id=group_id, episode_id=episode_id, group_size=group_size,
      tokens=np.asarray(prompt_ids + gen, np.int32), loss_mask=mask, behaviour_logprobs=logp,
      policy_versions=versions, reward=float(reward or 0.0),
      routing=_routing(getattr(completion, "prompt_routing", None), completion.routing, total),
      infra_failure=bool(infra_failure), hack_flags=hack_flags)
