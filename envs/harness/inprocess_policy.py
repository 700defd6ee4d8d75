"""A `Policy` over an in-process generate function (the project's own sampler, no HTTP).

The sampler is any callable

    generate(prompt_token_ids: list[int], *, n, max_tokens, temperature, stop_token_ids, seed)
        -> list[completion]

where each completion has `token_ids`, `logprobs`, `routing` (int array [moe_layers, T, k] or
None) and `policy_versions` (per-token list, an int, or None). Samplers stop on token ids only,
so multi-token stop strings (`</tool_call>`) are applied here: the completion is cut just after
the first stop string, and every per-token field is cut with it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from envs.harness import policy as policy_lib


class InProcessPolicy:
  """Adapts `generate` to the Policy protocol.

  Args:
    generate: the sampler callable (see module docstring).
    tokenizer: encode/decode plus `eos_id` (e.g. moe.tokenizer.ByteTokenizer()).
    add_bos: prepend the tokenizer's BOS to every prompt (how the tiny model was trained).
  """

  def __init__(self, generate: Callable[..., list[Any]], tokenizer: Any, *, add_bos: bool = False):
    self.generate = generate
    self.tokenizer = tokenizer
    self.add_bos = add_bos

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1):
    ids = list(prompt_ids)
    if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_id):
      ids = [self.tokenizer.bos_id] + ids
    try:
      raw = self.generate(ids, n=n, max_tokens=max_tokens, temperature=temperature,
                          stop_token_ids=[self.tokenizer.eos_id], seed=seed)
    except Exception as e:  # pylint: disable=broad-except
      raise policy_lib.PolicyError(f"generate failed: {type(e).__name__}: {e}") from e
    return [self._convert(c, max_tokens, stop) for c in raw]

  def _convert(self, c: Any, max_tokens: int, stop: Sequence[str]) -> policy_lib.Completion:
    tokens = [int(t) for t in c.token_ids]
    n = len(tokens)
    cut, hit = policy_lib.truncate_at_stop(tokens, self.decode, stop)
    eos = self.tokenizer.eos_id
    if eos in tokens[:cut]:
      cut, hit = tokens.index(eos) + 1, "<eos>"
    logprobs = getattr(c, "logprobs", None)
    logprobs = [float(x) for x in logprobs][:cut] if logprobs is not None else None
    versions = getattr(c, "policy_versions", None)
    if isinstance(versions, (int, np.integer)):
      versions = [int(versions)] * n
    versions = [int(v) for v in versions][:cut] if versions is not None else None
    routing = getattr(c, "routing", None)
    if routing is not None:
      routing = np.asarray(routing)[:, :cut]
    tokens = tokens[:cut]
    finish = "stop" if hit else ("length" if len(tokens) >= max_tokens else "stop")
    return policy_lib.Completion(token_ids=tokens, text=self.decode(tokens), logprobs=logprobs,
                                 routing=routing, policy_versions=versions, finish_reason=finish)
