"""Deterministic fault injection for the pipeline's parts: kill a process at a named point.

What: parts call `faults.point("learner.after_publish")` at the places where a crash is worth
testing. Nothing happens unless the environment variable `RL_FAULTS` names that point:
`RL_FAULTS="learner.after_publish@3,controller.after_write@5"` makes the process kill itself with
SIGKILL (as `kill -9` would: no cleanup, no atexit, no flush) the 3rd time it reaches
`learner.after_publish`. `RL_FAULTS_LOG=PATH` appends "name count pid" before each kill, so a
test can tell that the fault fired where it asked.

Why: the multi-process fault tests must kill a part at an exact point (right after a publish,
between a write and its checkpoint), not at a time that may or may not fall there on a loaded
machine. A test sets the variable for one child process only.
"""

from __future__ import annotations

import collections
import os
import signal
import threading

ENV = "RL_FAULTS"
LOG_ENV = "RL_FAULTS_LOG"

_lock = threading.Lock()
_hits: collections.Counter = collections.Counter()


def parse(spec: str) -> dict:
  """`"a@3,b"` -> {"a": 3, "b": 1}; raises ValueError naming a malformed entry."""
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, _, count = item.partition("@")
    if not name or (count and not count.isdigit()) or count == "0":
      raise ValueError(f"{ENV}: bad entry {item!r} (want NAME or NAME@COUNT, COUNT >= 1)")
    out[name] = int(count) if count else 1
  return out


def point(name: str) -> None:
  """Kills this process with SIGKILL if `RL_FAULTS` asks for it at this hit of `name`."""
  spec = os.environ.get(ENV)
  if not spec:
    return
  want = parse(spec).get(name)
  if want is None:
    return
  with _lock:
    _hits[name] += 1
    hit = _hits[name]
  if hit != want:
    return
  log = os.environ.get(LOG_ENV)
  if log:
    with open(log, "a") as f:
      f.write(f"{name} {hit} {os.getpid()}\n")
      f.flush()
      os.fsync(f.fileno())
  os.kill(os.getpid(), signal.SIGKILL)
