"""A request's results on the host: tokens appended, stop strings, stream flushes, Completions.

What: the engine thread hands each completion's new tokens to `append` and, when a completion
ends, sets its text (`final_text`); `cut_at_stop_string` ends one at its first stop string
(keeping every token up to the one that completes it; `find_stop` states the rule);
`flush_stream` passes what a streaming consumer has not seen to its `on_tokens` callback; and
`completions` builds a finished request's `Completion`s. None of it touches device state or
slots, which stay `rollout.engine`'s; split out so the serving loop reads on its own.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from moe.config import ModelConfig
from rollout.engine_types import Completion, RequestHandle, Sample

log = logging.getLogger(__name__)


def append(h: RequestHandle, s: Sample, tokens, logprobs, routing, version: int, top) -> None:
  """Appends new tokens with their logprobs, routing, weight version and (if asked) alternatives."""
  k = h.params.logprobs
  if k:
    s.top.extend({int(i): float(v) for i, v in zip(ids[:k], vals[:k])} for ids, vals in top)
  s.tokens.extend(int(t) for t in tokens)
  s.logprobs.extend(float(x) for x in logprobs)
  s.routing.extend(routing)
  s.versions.extend([version] * len(tokens))


def find_stop(tokens, decode, stop) -> Optional[tuple]:
  """Where the first stop string ends `tokens`: (tokens kept, text), or None if none occurs.

  The rule (exact token-in/token-out): the tokens kept are the shortest prefix whose text holds
  a stop string, i.e. every sampled token up to and including the one that completes the first
  stop string to be completed, and nothing after it. The model did sample those tokens, with
  their logprobs, routing and versions, so the learner trains on exactly what it produced. The
  text is OpenAI's: that prefix's text up to where its earliest stop string begins. So
  `decode(tokens kept)` is `text + stop string`, plus whatever follows the stop string inside
  the completing token (a token that holds the stop string's end and more text).

  The scan runs back from the end, one shorter prefix at a time, while the text still holds a
  stop string: an engine calls this after each chunk, so only the chunk's tokens can complete a
  match, and the scan stops at the previous chunk's length at the latest (its text held none).
  It therefore never drops a token an earlier chunk already streamed, and the result does not
  depend on how tokens were chunked for a prefix-stable decode (`rollout.detokenize`).

  Args:
    tokens: the completion's token ids so far.
    decode: ids -> text.
    stop: the stop strings (non-empty).
  """
  text = decode(tokens)
  if not any(x in text for x in stop):
    return None
  j = len(tokens)
  while j > 1:
    shorter = decode(tokens[:j - 1])
    if not any(x in shorter for x in stop):
      break
    j, text = j - 1, shorter
  return j, text[:min(text.find(x) for x in stop if x in text)]


def cut_at_stop_string(h: RequestHandle, s: Sample, tokenizer) -> bool:
  """If the text holds one of the request's stop strings, ends it there; returns whether it did.

  Keeps the tokens (and their logprobs, routing, versions, alternatives) up to and including the
  one that completes the first stop string, and sets `s.text` to the text before that stop
  string (`find_stop` states the rule).
  """
  found = find_stop(s.tokens, tokenizer.decode, h.params.stop)
  if found is None:
    return False
  j, s.text = found
  for lst in (s.tokens, s.logprobs, s.routing, s.versions, s.top):
    del lst[j:]
  return True


def final_text(h: RequestHandle, s: Sample, reason: str, tokenizer) -> str:
  """The text of a completion ended by `reason` (a stop token that ended it is not included)."""
  toks = s.tokens[:-1] if (reason == "stop" and s.tokens and s.tokens[-1] in h.stop_ids) \
      else s.tokens
  return tokenizer.decode(toks)


def flush_stream(h: RequestHandle) -> None:
  """Passes each completion's unsent tokens (and its end, once) to the request's `on_tokens`."""
  if h.on_tokens is None:
    return
  for s in h.samples:
    sent = getattr(s, "_streamed", 0)
    if len(s.tokens) > sent or (s.finish_reason is not None and not getattr(s, "_ended", False)):
      try:
        h.on_tokens(h, s.index, s.tokens[sent:], s.logprobs[sent:], s.finish_reason)
      except Exception:  # a broken consumer must not stop the engine
        log.exception("on_tokens callback failed")
      s._streamed = len(s.tokens)
      s._ended = s.finish_reason is not None


def streamed_top_logprobs(h: RequestHandle, index: int, start: int, stop: int) -> Optional[list]:
  """The alternatives ({token id: logprob} per token) of tokens start..stop-1 of completion
  `index`, for a consumer that has been passed those tokens by `on_tokens`; None when the
  request did not ask for alternatives (`SamplingParams.logprobs`).

  Safe to call from any thread (the server's event loop does, per streamed chunk): the engine
  thread only appends to a completion after the tokens it has streamed, and a stop string never
  takes back a streamed token (`find_stop`), so those entries no longer change.
  """
  if not h.params.logprobs:
    return None
  return list(h.samples[index].top[start:stop])


def completions(h: RequestHandle, cfg: ModelConfig, tokenizer: Optional[object]) -> list:
  """The request's `Completion`s (a completion that has not ended is marked "cancelled")."""
  out = []
  for s in h.samples:
    if s.finish_reason is None:
      s.finish_reason = "cancelled"
    if not s.text and tokenizer is not None and s.tokens and s.finish_reason != "stop":
      s.text = tokenizer.decode(s.tokens)
    routing = None
    if cfg.num_moe_layers:
      k = cfg.num_experts_per_tok
      routing = (np.stack(s.routing, axis=1) if s.routing
                 else np.zeros((cfg.num_moe_layers, 0, k), np.dtype(cfg.routing_dtype)))
    out.append(Completion(token_ids=list(s.tokens), logprobs=list(s.logprobs), routing=routing,
                          policy_versions=list(s.versions), finish_reason=s.finish_reason,
                          text=s.text, prompt_routing=h.prompt_routing, index=s.index,
                          top_logprobs=list(s.top) if h.params.logprobs else None,
                          cached_tokens=h.cached_tokens))
  return out
