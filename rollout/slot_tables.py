"""The engine's per-slot tables on the host, and staging one request's values into them.

What:
  * `new_tables(slots, max_stop_ids)` -> the per-slot arrays the decode program reads and
    carries (`rollout.device_programs.SLOT_FIELDS`), each of its fixed dtype (`DTYPES`).
  * `stage(handle, ...)` -> one request's values converted to those dtypes (its prompt, sampling
    settings, token budget and stop ids), or ValueError naming the value that does not fit.
  * `prefill_arrays(staged, rows, length, slots)` -> the arrays of one prefill call for a list
    of staged requests.

Why split from `rollout.engine`: staging is the one host-side step that turns a request's Python
values into fixed-width numbers, so it is where a value out of range would fail (numpy raises
on an out-of-bounds Python int, or a float32 rounds to 0 or inf). `stage` runs per request and
checks every conversion, so the engine fails only the request whose value does not fit; the
arrays of a prefill call are then assembled from values that are known to fit. Client input
cannot get here out of range (`rollout.sampling.SamplingParams` and `rollout.request_checks`
refuse it first); this is the second line, for a request built some other way.
"""

from __future__ import annotations

import numpy as np

from rollout.engine_types import RequestHandle

DTYPES = {"tok": np.int32, "pos": np.int32, "remaining": np.int32, "active": bool,
          "temp": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.uint32,
          "sample": np.int32, "tindex": np.int32, "stop": np.int32}
_DEFAULTS = {"temp": 1, "top_p": 1, "stop": -1}


def new_tables(slots: int, max_stop_ids: int) -> dict:
  """The per-slot tables of an engine with `slots` slots, at their idle values."""
  return {k: np.full((slots, max_stop_ids) if k == "stop" else slots, _DEFAULTS.get(k, 0), dt)
          for k, dt in DTYPES.items()}


def fit(value, dtype, what: str):
  """`value` as a scalar of `dtype`; ValueError naming `what` if it does not fit (never wraps)."""
  dt = np.dtype(dtype)
  if dt.kind in "iu":
    info = np.iinfo(dt)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or \
        not info.min <= value <= info.max:
      raise ValueError(f"{what} {value!r} does not fit the engine's {dt} slot table")
    return dt.type(value)
  with np.errstate(over="ignore", under="ignore"):  # refused below, not warned about
    x = dt.type(value)
  if not np.isfinite(x) or (value != 0 and x == 0):
    raise ValueError(f"{what} {value!r} does not fit the engine's {dt} slot table")
  return x


def stage(h: RequestHandle, *, vocab_size: int, max_stop_ids: int, length: int,
          start: int = 0) -> dict:
  """One request's table values, checked and converted (ValueError if one does not fit).

  Args:
    h: the request.
    vocab_size: the model's vocabulary (top_k >= it means no top-k filter, the same as 0).
    max_stop_ids: width of the stop-id table.
    length: the prefill call's padded prompt length.
    start: prompt tokens served from the prefix cache; "prompt" is the rest, what the call
      prefills (and "start" is returned too).
  """
  p = h.params
  if not 0 <= start < len(h.prompt) or not 1 <= len(h.prompt) - start <= length:
    raise ValueError(f"prompt of {len(h.prompt)} tokens ({start} cached) does not fit the "
                     f"prefill length {length}")
  prompt = np.asarray([fit(t, np.int32, "prompt token") for t in h.prompt[start:]], np.int32)
  if prompt.min() < 0 or prompt.max() >= vocab_size:
    raise ValueError(f"prompt token outside the vocabulary (size {vocab_size})")
  if len(h.stop_ids) > max_stop_ids:
    raise ValueError(f"{len(h.stop_ids)} stop ids do not fit the table of {max_stop_ids}")
  stop = np.full(max_stop_ids, -1, np.int32)
  stop[:len(h.stop_ids)] = [fit(t, np.int32, "stop token id") for t in h.stop_ids]
  top_k = fit(p.top_k, np.int32, "top_k")
  return {"prompt": prompt,
          "start": start,
          "temp": fit(p.temperature, np.float32, "temperature"),
          "top_k": top_k if top_k < vocab_size else np.int32(0),
          "top_p": fit(p.top_p, np.float32, "top_p"),
          "seed": fit(int(p.seed) % 2**32, np.uint32, "seed"),
          "remaining": fit(p.max_tokens - 1, np.int32, "max_tokens"),
          "samples": [fit(i, np.int32, "sample index") for i in range(p.n)],
          "stop": stop}


def prefill_arrays(staged: list, rows: int, length: int, slots: int) -> dict:
  """The arrays of one prefill call for `staged` = [(handle, its slots, `stage` result)].

  Prompts fill rows in order (padding rows hold one token 0); each completion seeds its slot
  from its prompt's row, and the rest of the slot list holds `slots`, which the device program
  drops (`rollout.kv_cache.write_prompts`).
  """
  tokens = np.zeros((rows, length), np.int32)
  lengths = np.ones(rows, np.int32)
  out = {"tokens": tokens, "lengths": lengths, "dst": np.full(slots, slots, np.int32),
         "src": np.zeros(slots, np.int32)}
  for k in ("temp", "top_k", "top_p", "seed", "sample"):
    out[k] = np.full(slots, _DEFAULTS.get(k, 0), DTYPES[k])
  m = 0
  for r, (_, owned, v) in enumerate(staged):
    tokens[r, :len(v["prompt"])] = v["prompt"]
    lengths[r] = len(v["prompt"])
    for i, slot in enumerate(owned):
      out["dst"][m], out["src"][m], out["sample"][m] = slot, r, v["samples"][i]
      for k in ("temp", "top_k", "top_p", "seed"):
        out[k][m] = v[k]
      m += 1
  return out
