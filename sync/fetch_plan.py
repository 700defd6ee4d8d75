"""Choosing how to reach a version: the delta chain, or a snapshot plus the deltas after it.

What: `plan(index, current, target)` returns the steps (`("snapshot", v)` then `("delta", v)`s)
that move the fewest bytes from the version a sampler holds (or None) to `target`, using the
byte sizes in the store index. `restore(source, version)` follows such a plan from nothing, i.e.
"restore version N" = newest snapshot <= N plus the deltas after it.

Why: a sampler that missed a few versions should pull a few small deltas; one that missed many
(or whose chain was garbage-collected) is better off jumping to a snapshot. Sizes decide.
"""

import dataclasses

from sync import manifest as manifest_lib


class PlanError(ValueError):
  """No retained chain of objects leads to the requested version."""


@dataclasses.dataclass
class Plan:
  steps: list  # [("snapshot", v) | ("delta", v)]
  bytes: int


def _chain_bytes(index, start: int, target: int):
  """Bytes of deltas start+1..target, or None if one is missing."""
  total = 0
  for v in range(start + 1, target + 1):
    entry = index.versions.get(v)
    if entry is None or entry[0] is None:
      return None
    total += entry[0]
  return total


def plan(index: manifest_lib.Index, current: int | None, target: int | None = None,
         avoid_deltas_from: int | None = None) -> Plan:
  """The cheapest way from `current` (None: nothing held) to `target` (default: latest).

  Args:
    index: the store index.
    current: the version held, or None.
    target: the version wanted; defaults to index.latest.
    avoid_deltas_from: if set, do not start a delta chain at this version (used after a delta
      from it was rejected: recover through a snapshot).
  """
  target = index.latest if target is None else target
  if target is None:
    raise PlanError("nothing published yet")
  if current == target:
    return Plan([], 0)
  options = []
  if current is not None and current < target and current != avoid_deltas_from:
    b = _chain_bytes(index, current, target)
    if b is not None:
      options.append(Plan([("delta", v) for v in range(current + 1, target + 1)], b))
  for s, (_, snap) in index.versions.items():
    if snap is None or s > target:
      continue
    b = _chain_bytes(index, s, target)
    if b is not None:
      options.append(Plan([("snapshot", s)] + [("delta", v) for v in range(s + 1, target + 1)],
                          snap + b))
  if not options:
    raise PlanError(f"no retained path from {current} to {target}")
  return min(options, key=lambda p: (p.bytes, len(p.steps)))
