"""The record of one episode as the harness saw it (turns, tool calls, segments, reward).

The learner does not read this: it trains on rl.episodes.Episode records (tokens, loss mask,
logprobs, routing, versions), which pipeline.episodes builds from the sampler's completions.
Evaluation and the harness's own tests read trajectories.

An episode is one or more segments. A segment is one context window: the token ids, which of
them the model wrote (the mask the policy-gradient loss uses), their log-probabilities, routing
and policy versions. Self-summarisation closes a segment with the model's summary and opens the
next from a fresh prompt holding that summary; the summary tokens are model tokens of the first
segment, so the learner trains them too.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from envs.harness import policy as policy_lib

INFRA = "infra_error"


class ShapeMismatch(ValueError):
  """A completion's per-token data (logprobs, versions, routing) does not match its tokens."""


@dataclasses.dataclass
class Segment:
  """One context window. Per-token lists all have len(token_ids) entries.

  Routing follows the learner's alignment (what router replay needs): `routing[:, t]` holds the
  experts the sampler used when it processed token t as input (the step that predicted token
  t+1). A completion for prompt P = this segment's tokens brings the prefill's routing of
  positions 0..P-2 (`Completion.prompt_routing`) and one row per generated token for positions
  P-1..P+T-2 (`Completion.routing`). A position the sampler decoded keeps its decode routing (it
  produced the logprob the learner corrects against); one it saw only in a prefill -- tool
  output, the harness's template text, and the last token of each completion, which the next
  request's prefill processes first -- takes the first prefill that covered it.
  """
  token_ids: list[int] = dataclasses.field(default_factory=list)
  model_mask: list[bool] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)  # 0.0 where not model
  policy_versions: list[int] = dataclasses.field(default_factory=list)  # -1 where not model
  routing_chunks: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
  prompt_routing_chunks: list[np.ndarray] = dataclasses.field(default_factory=list)
  ended_by_summary: bool = False

  def add_text_tokens(self, ids: Sequence[int]) -> None:
    """Tokens the harness wrote (prompt, template, observations)."""
    self.token_ids += list(ids)
    self.model_mask += [False] * len(ids)
    self.logprobs += [0.0] * len(ids)
    self.policy_versions += [-1] * len(ids)

  def _routing_shape(self) -> tuple[int, int] | None:
    for arr in [r for _, r in self.routing_chunks] + self.prompt_routing_chunks:
      return arr.shape[0], arr.shape[2]
    return None

  def _check_routing(self, routing, n: int, what: str) -> np.ndarray:
    routing = np.asarray(routing)
    if routing.ndim != 3 or routing.shape[1] != n:
      raise ShapeMismatch(f"completion {what} has shape {routing.shape}, expected "
                          f"(moe_layers, {n}, k)")
    seen = self._routing_shape()
    if seen is not None and (routing.shape[0], routing.shape[2]) != seen:
      raise ShapeMismatch(f"completion {what} has shape {routing.shape}, but earlier "
                          f"completions of this segment had (moe_layers={seen[0]}, k={seen[1]})")
    return routing.astype(np.int32)

  def add_completion(self, c: policy_lib.Completion) -> None:
    """Tokens the model wrote, with what the sampler returned about them.

    The completion must continue this segment: it was sampled from a prompt of exactly
    `self.token_ids` (the harness always sends the whole segment). Logprobs, policy versions and
    routing may be absent (a server that does not report them), but when present they must
    cover every completion token (and `prompt_routing` every prompt position but the last): a
    per-token list of another length, or routing that is not [moe_layers, n, k] with this
    segment's layers and k, raises ShapeMismatch instead of being dropped, since training on
    misaligned per-token data (or silently without router replay) is worse than stopping.
    """
    start, n = len(self.token_ids), len(c.token_ids)
    for name, values in (("logprobs", c.logprobs), ("policy_versions", c.policy_versions)):
      if values is not None and len(values) != n:
        raise ShapeMismatch(f"completion has {n} tokens but {len(values)} {name}")
    routing = prompt_routing = None
    if c.routing is not None and n:
      routing = self._check_routing(c.routing, n, "routing")
    if getattr(c, "prompt_routing", None) is not None and start > 1:
      prompt_routing = self._check_routing(c.prompt_routing, start - 1, "prompt_routing")
    if routing is not None and prompt_routing is not None and \
        (routing.shape[0], routing.shape[2]) != (prompt_routing.shape[0], prompt_routing.shape[2]):
      raise ShapeMismatch(f"completion routing {routing.shape} and prompt_routing "
                          f"{prompt_routing.shape} disagree on (moe_layers, k)")
    self.token_ids += list(c.token_ids)
    self.model_mask += [True] * n
    lp = list(c.logprobs) if c.logprobs is not None else [0.0] * n
    self.logprobs += [float(x) if x is not None else 0.0 for x in lp]
    pv = c.policy_versions if c.policy_versions is not None else [-1] * n
    self.policy_versions += [int(v) for v in pv]
    if routing is not None:
      # Row j belongs to position start-1+j; from an empty prompt, row 0 has no position.
      self.routing_chunks.append((start - 1, routing) if start else (0, routing[:, 1:]))
    if prompt_routing is not None:
      self.prompt_routing_chunks.append(prompt_routing)

  def __len__(self) -> int:
    return len(self.token_ids)

  @property
  def routing(self) -> np.ndarray | None:
    """[moe_layers, len(token_ids), k] chosen experts (see the class docstring); -1 where the
    sampler processed no token (the segment's last token, which predicts nothing, or tokens
    never sent to it)."""
    shape = self._routing_shape()
    if shape is None:
      return None
    layers, k = shape
    out = np.full((layers, len(self.token_ids), k), -1, np.int32)
    for r in self.prompt_routing_chunks:  # first prefill to cover a position wins
      span = out[:, :r.shape[1]]
      missing = span[..., :1] < 0
      out[:, :r.shape[1]] = np.where(missing, r, span)
    for start, r in self.routing_chunks:  # decode routing of the model's own positions
      out[:, start:start + r.shape[1]] = r
    return out


@dataclasses.dataclass
class ToolCallRecord:
  turn: int
  name: str
  arguments: dict
  ok: bool
  observation: str
  wall_s: float


@dataclasses.dataclass
class Trajectory:
  """Everything about one episode.

  status: "ok", or "infra_error" when the fleet (sandbox, sampler) failed: then reward is None
    and the learner must mask the episode out, not score it 0.
  finish_reason: submitted, max_turns, max_tokens, wall_time, context (summaries exhausted),
    single_turn, or error.
  hack_flags: {flag: evidence} from envs.hacks; reward already includes the penalty.
  timings: seconds spent in generate, tools, grade, sandbox start, and total.
  """
  task_id: str
  segments: list[Segment]
  tool_calls: list[ToolCallRecord]
  status: str
  reward: float | None
  test_reward: float | None
  hack_flags: dict[str, list[str]]
  finish_reason: str
  num_turns: int
  timings: dict[str, float]
  infra_error: str | None = None
  malformed_calls: int = 0
  test_outcomes: dict[str, str] = dataclasses.field(default_factory=dict)
  final_files: dict[str, str] = dataclasses.field(default_factory=dict)
  completion_text: str = ""

  @property
  def flags(self) -> dict[str, bool]:
    return {"hacked": bool(self.hack_flags), "infra_failure": self.status == INFRA,
            "summarised": len(self.segments) > 1,
            "truncated": self.finish_reason in ("max_turns", "max_tokens", "wall_time",
                                                "context")}

  @property
  def num_model_tokens(self) -> int:
    return sum(sum(s.model_mask) for s in self.segments)
