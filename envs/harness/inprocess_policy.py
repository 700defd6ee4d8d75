"""A `Policy` over an in-process generate function (the project's own sampler, no HTTP).

The sampler is any callable

    generate(prompt_token_ids: list[int], *, n, max_tokens, temperature, stop_token_ids, seed
             [, stop]) -> list[completion]

where each completion has `token_ids`, `logprobs`, `routing` (int array [moe_layers, T, k] or
None), optionally `prompt_routing` ([moe_layers, P-1, k]), and `policy_versions` (per-token
list, an int, or None). A sampler that stops on token ids only is fine: multi-token stop strings
(`</tool_call>`) are applied here too, cutting the completion just after the first stop string
with every per-token field. A sampler that can end completions at stop strings itself
(`stop_strings=True`, e.g. `rollout.engine.Engine.generate` on an engine with a tokenizer) is
also handed the request's stop strings as `stop`, so it stops decoding there instead of running
to `max_tokens` for tokens thrown away here. It keeps every token up to and including the one
that completes the stop string (`rollout.outputs.find_stop`), which is exactly what the cut here
keeps, so the completion is the same either way; only the wasted decode goes. (With several stop
strings the sampler ends at the first one completed, the cut here at the first one begun: they
differ only when one stop string is completed inside another's span, which the harness's stop
sets never allow.)

`add_bos`: the model's contexts start with BOS (`start_ids`); the harness puts it at the head of
each segment, and prompts are sent exactly as given, so the trajectory holds what the sampler saw.
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
    stop_strings: `generate` takes `stop=` (a list of stop strings) and ends completions at them
      (see the module docstring). The keyword goes only with a request that has stop strings;
      False (a sampler that matches token ids only): it is never sent.
  """

  def __init__(self, generate: Callable[..., list[Any]], tokenizer: Any, *, add_bos: bool = False,
               stop_strings: bool = False):
    self.generate = generate
    self.tokenizer = tokenizer
    self.add_bos = add_bos
    self.stop_strings = stop_strings

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids)

  def start_ids(self) -> list[int]:
    return [self.tokenizer.bos_id] if self.add_bos else []

  def complete(self, prompt_ids, *, max_tokens, stop=(), temperature=1.0, seed=None, n=1,
               top_p=1.0, stop_token_ids=()):
    kwargs = {"top_p": top_p} if top_p != 1.0 else {}
    stop_list = [x for x in stop if x]  # an empty stop string matches nothing here (convert)
    if self.stop_strings and stop_list:
      kwargs["stop"] = stop_list
    stop_ids = [self.tokenizer.eos_id] + [int(t) for t in stop_token_ids
                                          if int(t) != self.tokenizer.eos_id]
    try:
      raw = self.generate(list(prompt_ids), n=n, max_tokens=max_tokens, temperature=temperature,
                          stop_token_ids=stop_ids, seed=seed, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise policy_lib.PolicyError(f"generate failed: {type(e).__name__}: {e}") from e
    return [convert(c, self.tokenizer, max_tokens, stop, stop_token_ids=stop_ids) for c in raw]


def convert(c: Any, tokenizer: Any, max_tokens: int, stop: Sequence[str] = (), *,
            stop_token_ids: Sequence[int] = ()) -> policy_lib.Completion:
  """A sampler's completion (e.g. a rollout.engine.Completion) as the harness's Completion.

  Cut after the first stop string, EOS (`tokenizer.eos_id`) or id of `stop_token_ids` with every
  per-token field; the text is the decoding of the kept ids (stop string included), and
  `prompt_routing` is passed through. Used by InProcessPolicy and by the RL pipeline's
  in-process samplers.
  """
  decode = tokenizer.decode
  tokens = [int(t) for t in c.token_ids]
  n = len(tokens)
  cut, hit = policy_lib.truncate_at_stop(tokens, decode, stop)
  ends = {tokenizer.eos_id, *(int(t) for t in stop_token_ids)}
  at = next((j for j, t in enumerate(tokens[:cut]) if t in ends), None)
  if at is not None:
    cut, hit = at + 1, "<eos>"
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
  if getattr(c, "finish_reason", None) in ("cancelled", "error", "timeout"):
    finish = c.finish_reason  # the sampler gave up on it: the caller must not grade it
  prompt_routing = getattr(c, "prompt_routing", None)
  return policy_lib.Completion(token_ids=tokens, text=decode(tokens), logprobs=logprobs,
                               routing=routing, policy_versions=versions, finish_reason=finish,
                               prompt_routing=None if prompt_routing is None
                               else np.asarray(prompt_routing))
