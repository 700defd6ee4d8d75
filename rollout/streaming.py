"""Server-sent-event streaming of `/v1/completions` and `/v1/chat/completions` (`stream: true`).

What: `stream(request, ...)` writes one `data:` event per engine chunk (new token ids, their
logprobs -- with their alternatives when the request asked for `top_logprobs` / `logprobs: k` --
and the text they settle), then one final event per choice (the rest of its text, finish
reason, policy versions, routing), then, when asked, one with the `usage`, then `data: [DONE]`.
The endpoint's format (`protocol.CompletionsFormat`, `chat_protocol.ChatFormat`) shapes each
choice's events; what is sent when is the same for both. The engine thread feeds `events` through
`loop.call_soon_threadsafe`; this coroutine only reads it.

Text: each choice's text goes through `rollout.detokenize.IncrementalText`, so the streamed
pieces concatenated equal the non-streamed text exactly, however tokens split characters and
stop strings. A chunk that ends its choice carries no text (the engine may drop the stop token's
text or cut at a stop string); the final event carries the rest. Token ids need no such care: a
stop string ends a completion at the token that completes it, which is in the chunk that ended
it, so the engine never takes back ids already streamed (`rollout.outputs.find_stop`).

Deadline: if the choices have not all ended by `deadline` (loop time; the request's timeout
plus a grace, for an engine loop that is stuck), the handles are cancelled and every unfinished
choice ends with finish_reason "timeout": the stream always ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

from aiohttp import web

from rollout import detokenize
from rollout import outputs
from rollout import protocol

log = logging.getLogger(__name__)


async def stream(request, tokenizer, req: dict, handles: list, events: asyncio.Queue, rid: str,
                 created: int, model: str, deadline: Optional[float] = None,
                 fmt=protocol.CompletionsFormat()) -> web.StreamResponse:
  """Streams the completions of `handles` (one per prompt of `req`) as server-sent events.

  `fmt` shapes each choice's chunks (`protocol.CompletionsFormat` or
  `chat_protocol.ChatFormat`); with `req["include_usage"]` a last event before `[DONE]` carries
  no choices and the request's `usage`, as OpenAI's `stream_options.include_usage` asks.
  """
  loop = asyncio.get_running_loop()
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})
  await resp.prepare(request)
  n = req["params"].n
  order = {h.id: pi for pi, h in enumerate(handles)}
  texts = {}  # choice index -> IncrementalText
  started = set()  # choices with a chunk sent
  ended = set()
  streamed = {}  # choice index -> token ids sent
  total = len(handles) * n

  async def send(payload: dict) -> None:
    payload = {"id": rid, "object": fmt.chunk_object, "created": created, "model": model,
               **payload}
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

  async def send_choice(idx: int, choice: dict) -> None:
    started.add(idx)
    await send({"choices": [choice]})

  def left() -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - loop.time())

  timed_out = False
  while len(ended) < total:
    try:
      hid, i, toks, lps, reason = await asyncio.wait_for(events.get(), left())
    except asyncio.TimeoutError:
      timed_out = True
      break
    idx = order[hid] * n + i
    text = ""
    if tokenizer is not None and reason is None:
      if idx not in texts:
        texts[idx] = detokenize.IncrementalText(tokenizer, req["params"].stop)
      text = texts[idx].push(toks)
    if toks:
      start = streamed.get(idx, 0)
      streamed[idx] = start + len(toks)
      top = outputs.streamed_top_logprobs(handles[order[hid]], i, start, start + len(toks))
      await send_choice(idx, fmt.token_chunk(idx, text, toks, lps, tokenizer, req,
                                             idx not in started, top=top))
    if reason is not None:
      ended.add(idx)
  futures = [asyncio.wrap_future(h.future) for h in handles]
  if not timed_out:
    # The engine sets each result right after its last chunk; bounded all the same.
    _, pending = await asyncio.wait(futures, timeout=left())
    timed_out = bool(pending)
  if timed_out:
    for h in handles:
      h.cancel()
  cached = 0
  for pi, f in enumerate(futures):
    results = failure = None
    if not f.done():
      failure = "timeout"
    elif f.cancelled() or f.exception() is not None:
      failure = "error"  # the engine failed this request (it logs why)
    else:
      results = f.result()
    for c in range(n):
      idx = pi * n + c
      if results is None:
        await send_choice(idx, fmt.final_chunk(idx, "", failure, None, req, idx not in started))
        continue
      comp = results[c]
      cached += comp.cached_tokens
      rest = comp.text
      if idx in texts:
        try:
          rest = texts[idx].finish(comp.text)
        except ValueError:
          log.error("choice %d of %s: streamed text is not a prefix of its text", idx, rid)
          rest = ""
      await send_choice(idx, fmt.final_chunk(idx, rest, comp.finish_reason, comp, req,
                                             idx not in started))
  if req.get("include_usage"):
    # Tokens as streamed (all of them, also for a choice that failed part way).
    await send({"choices": [], "usage": protocol.usage_json(
        sum(len(p) for p in req["prompts"]) * n, sum(streamed.values()), cached)})
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp
