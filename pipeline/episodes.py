"""Turning a graded attempt into the learner's `rl.episodes.Episode`.

`from_trajectory` is the RL path: the harness's Trajectory (one or more context segments, see
envs.harness.trajectory) becomes one Episode whose tokens are exactly the segments' tokens --
what the sampler was sent and what it wrote, never re-tokenized -- with the model's tokens in
the loss mask (tool output, environment text and the summary request are context only), the
sampler's logprobs and policy versions on them, routing on every position, and
`segment_lengths` when the model summarised itself (each segment trains as its own sequence,
all with the attempt's advantage; rl.episodes). `from_completion` builds the same from a bare
prompt and completion.

Alignment (what router replay needs): the learner runs its forward on prompt + completion and
position t's routing must be the experts the sampler used when it processed token t. The engine
returns `prompt_routing` for prompt positions 0..P-2 and, per generated token j, the routing of
the step whose input was the previous token (position P-1+j). Concatenated they cover positions
0..P+T-2; the final token was never fed to the sampler and predicts nothing, so its routing is
a copy of the previous position's (never used for a trained prediction).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

from rl.episodes import Episode

log = logging.getLogger(__name__)


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


def _segment_routing(seg) -> Optional[np.ndarray]:
  """The segment's routing with every position filled, or None if the sampler left a gap.

  Positions after the last one the sampler processed (the final token, template text after the
  last completion) predict nothing trained; they copy the last processed position's experts. A
  gap before it (a sampler that returned no prompt routing) cannot be replayed: None, which the
  learner rejects as missing routing when it replays.
  """
  r = seg.routing
  if r is None:
    return None
  seen = np.nonzero(r[0, :, 0] >= 0)[0]
  if seen.size == 0:
    return None
  last = int(seen[-1])
  if np.any(r[:, :last + 1] < 0):
    return None
  r = r.copy()
  r[:, last + 1:] = r[:, last:last + 1]
  return r.astype(np.uint8)


def from_trajectory(traj, *, group_id: str, episode_id: str, group_size: int) -> Episode:
  """The Episode of one attempt run by the harness (envs.harness.attempts).

  Args:
    traj: an envs.harness.trajectory.Trajectory.
    group_id / episode_id / group_size: as in `from_completion`.

  An attempt the infrastructure lost (status "infra_error": the sandbox or every sampler
  failed) is kept, flagged and masked, so its group completes; so is one without a single model
  token (nothing to train, nothing to score). Routing is None when any segment lacks it (see
  `_segment_routing`).
  """
  hack_flags = tuple(sorted(str(f) for f in (traj.hack_flags or {})))
  segs = [s for s in traj.segments if len(s)]
  tokens = [t for s in segs for t in s.token_ids]
  model = sum(sum(s.model_mask) for s in segs)
  if traj.status == "infra_error" or traj.reward is None or not model:
    if traj.status != "infra_error":
      log.warning("%s: an attempt without model tokens (finish %s) is masked as lost",
                  episode_id, traj.finish_reason)
    ids = np.asarray(tokens or [0], np.int32)
    n = ids.size
    return Episode(group_id=group_id, episode_id=episode_id, group_size=group_size, tokens=ids,
                   loss_mask=np.zeros(n, np.int8), behaviour_logprobs=np.zeros(n, np.float32),
                   policy_versions=np.zeros(n, np.int32), reward=0.0, infra_failure=True,
                   hack_flags=hack_flags)
  mask = np.concatenate([np.asarray(s.model_mask, np.int8) for s in segs])
  logp = np.concatenate([np.asarray(s.logprobs, np.float32) for s in segs])
  versions = np.concatenate([np.asarray(s.policy_versions, np.int64) for s in segs])
  versions = np.where(mask.astype(bool), np.maximum(versions, 0), 0).astype(np.int32)
  routes = [_segment_routing(s) for s in segs]
  routing = None if any(r is None for r in routes) else np.concatenate(routes, axis=1)
  lengths = np.asarray([len(s) for s in segs], np.int32) if len(segs) > 1 else None
  return Episode(
      group_id=group_id, episode_id=episode_id, group_size=group_size,
      tokens=np.asarray(tokens, np.int32), loss_mask=mask, behaviour_logprobs=logp,
      policy_versions=versions, reward=float(traj.reward), routing=routing,
      infra_failure=False, hack_flags=hack_flags, segment_lengths=lengths)
