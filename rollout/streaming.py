"""Server-sent-event streaming of `/v1/completions` (`stream: true`).

What: `stream(request, ...)` writes one `data:` event per engine chunk (new token ids, their
logprobs and the text they complete), then one final event per choice (finish reason, policy
versions, routing), then `data: [DONE]`. The engine thread feeds `events` through
`loop.call_soon_threadsafe`; this coroutine only reads it.

Why its own module: the text of a stream must equal the non-streamed text however tokens split
characters and stop strings, and that logic is easier to read and test apart from the handlers.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from rollout import protocol


async def stream(request, tokenizer, req: dict, handles: list, events: asyncio.Queue, rid: str,
                 created: int, model: str) -> web.StreamResponse:
  """Streams the completions of `handles` (one per prompt of `req`) as server-sent events."""
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})
  await resp.prepare(request)
  n = req["params"].n
  order = {h.id: pi for pi, h in enumerate(handles)}
  tokens = {}  # choice index -> tokens so far
  sent_text = {}
  hold = bool(req["params"].stop)  # stop strings: text is final only once a choice ends
  ended = 0
  total = len(handles) * n

  async def send(choice: dict) -> None:
    payload = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [choice]}
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

  while ended < total:
    hid, i, toks, lps, reason = await events.get()
    idx = order[hid] * n + i
    all_toks = tokens.setdefault(idx, [])
    all_toks.extend(toks)
    text = ""
    if tokenizer is not None and not hold:
      full = tokenizer.decode(all_toks)
      prev = sent_text.get(idx, "")
      text = full[len(prev):] if full.startswith(prev) else ""
      sent_text[idx] = prev + text
    if toks:
      await send({"index": idx, "text": text, "token_ids": toks,
                  "logprobs": protocol.logprobs_json(tokenizer, toks, lps),
                  "finish_reason": None})
    if reason is not None:
      ended += 1
  results = await asyncio.gather(*(asyncio.wrap_future(h.future) for h in handles))
  for pi, r in enumerate(results):
    for c in r:
      idx = pi * n + c.index
      prev = sent_text.get(idx, "")
      rest = c.text[len(prev):] if c.text.startswith(prev) else ""
      final = {"index": idx, "text": rest, "token_ids": [], "logprobs": None,
               "finish_reason": c.finish_reason,
               "policy_version": c.policy_versions[-1] if c.policy_versions else None,
               "policy_versions": c.policy_versions}
      if req["return_routing"]:
        final["routing"] = c.routing.tolist() if c.routing is not None else None
      await send(final)
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp
