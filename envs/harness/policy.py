"""The `Policy` protocol the harness talks to, its `Completion`, and a scripted policy.

The agent loop keeps its context as token ids and asks a policy to continue it, so the same loop
drives the project's own sampler in-process (`inprocess_policy`), the project's sampling
server or any OpenAI-compatible endpoint (`openai_policy`), and scripted test doubles.

A completion carries what the learner needs from the sampler: the token ids the model wrote,
their log-probabilities, the experts each token was routed to (for routing replay) and the
policy version that produced each token (for staleness). Completions include the stop string
that ended them when the model wrote it, so the learner trains the model to stop.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np


class PolicyError(RuntimeError):
  """The policy could not answer (server down, bad response): an infrastructure failure."""


@dataclasses.dataclass
class Completion:
  """One sampled continuation.

  token_ids: tokens the model wrote (the stop string's tokens included when it wrote them).
  text: their decoding.
  logprobs: per-token log-probabilities under the sampling policy, or None if unknown.
  routing: int array [moe_layers, len(token_ids), k] of chosen experts, or None. Row j is the
    routing of the step whose input was the token before token j (the prompt's last token for
    j = 0), i.e. positions P-1 .. P+T-2 of prompt + completion.
  prompt_routing: int array [moe_layers, P-1, k]: the experts of prompt positions 0..P-2 from
    the sampler's prefill (its prefix cache's record for cached positions), or None. With
    `routing` it covers every position the sampler processed, so router replay covers tool
    output and other harness text as well as the model's tokens.
  policy_versions: per-token policy version, or None.
  finish_reason: "stop" (a stop string or EOS) or "length".
  stop_appended: a stop string the server matched but left out of the text; the harness adds
    its tokens as template tokens (not the model's), so the parser still sees it.
  """
  token_ids: list[int]
  text: str
  logprobs: list[float] | None = None
  routing: np.ndarray | None = None
  policy_versions: list[int] | None = None
  finish_reason: str = "stop"
  stop_appended: str = ""
  prompt_routing: np.ndarray | None = None


class Tokenizer(Protocol):

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...


class Policy(Protocol):
  """What the harness needs from a model."""

  def encode(self, text: str) -> list[int]:
    """Tokenizes harness-written text (prompts, observations) with the model's tokenizer."""
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...

  def start_ids(self) -> list[int]:
    """Tokens every context starts with (the model's BOS, or none). The harness puts them at
    the head of each segment itself, so the prompt it sends is exactly the segment's tokens."""
    ...

  def complete(self, prompt_ids: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (),
               temperature: float = 1.0, seed: int | None = None, n: int = 1,
               top_p: float = 1.0, stop_token_ids: Sequence[int] = ()) -> list[Completion]:
    """Samples `n` continuations of `prompt_ids` (sent as they are), each ending at a stop
    string, EOS, one of `stop_token_ids` (kept in the completion, as EOS is: a chat model's
    end-of-turn token, which the learner trains it to write) or `max_tokens`. Raises
    PolicyError on infrastructure failure."""
    ...


def truncate_at_stop(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                     stop: Sequence[str]) -> tuple[int, str | None]:
  """Length of the shortest prefix of token_ids whose text contains a stop string, and which.

  Returns (len(token_ids), None) if no stop string occurs.
  """
  text = decode(token_ids)
  hits = [(text.find(s), s) for s in stop if s and s in text]
  if not hits:
    return len(token_ids), None
  pos, s = min(hits)
  end = pos + len(s)
  lo, hi = 1, len(token_ids)
  while lo < hi:  # Smallest prefix whose decoding reaches past the stop string.
    mid = (lo + hi) // 2
    if len(decode(token_ids[:mid])) >= end and s in decode(token_ids[:mid]):
      hi = mid
    else:
      lo = mid + 1
  return lo, s


class ScriptedPolicy:
  """Replays scripted responses: a deterministic stand-in for the model side in tests.

  Args:
    responses: texts returned in order, or a function (prompt text, call index) -> text; each
      is encoded and cut after its first stop string or stop token id, where a sampler stops.
    tokenizer: anything with encode/decode (e.g. moe.tokenizer.ByteTokenizer()).
  """

  def __init__(self, responses: Sequence[str] | Callable[[str, int], str], tokenizer: Tokenizer):
    self.responses = responses
    self.tokenizer = tokenizer
    self.calls: list[str] = []

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def start_ids(self) -> list[int]:
    return []

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1,
               top_p=1.0, stop_token_ids=()):
    del temperature, seed, top_p
    prompt = self.decode(prompt_ids)
    out = []
    for _ in range(n):
      i = len(self.calls)
      self.calls.append(prompt)
      if callable(self.responses):
        text = self.responses(prompt, i)
      else:
        text = self.responses[i] if i < len(self.responses) else "<|im_end|>"
      ids = self.encode(text)
      cut, hit = truncate_at_stop(ids, self.decode, stop)
      at_id = next((j + 1 for j, t in enumerate(ids[:cut]) if t in stop_token_ids), None)
      if at_id is not None:
        cut, hit = at_id, "<stop id>"
      finish = "stop" if hit else "length"
      if cut > max_tokens:
        cut, finish = max_tokens, "length"
      ids = ids[:cut]
      out.append(Completion(token_ids=ids, text=self.decode(ids), logprobs=[-0.5] * len(ids),
                            policy_versions=[0] * len(ids), finish_reason=finish))
    return out
