"""Bounded waits for tests: wait for a condition or an event, and fail loudly at the deadline.

Why: on a loaded CI machine (2 cores shared by many test targets) a fixed `time.sleep` before an
assertion is sometimes too short, and a `while time.time() < deadline` loop that falls through
at its deadline turns a hang into a confusing failure further on, or into none at all. These
helpers return as soon as the condition holds and raise `TimeoutError` naming what they waited
for, so a test takes no longer than the machine needs and a real hang fails with a clear message.
"""

import threading
import time
from typing import Callable, Union

# Far above any scheduling delay on a loaded 2-core machine, far below a Bazel test timeout.
DEFAULT_TIMEOUT_S = 60.0

Message = Union[str, Callable[[], str]]


def _text(what: Message) -> str:
  return what() if callable(what) else what


def wait_until(condition: Callable[[], object], what: Message, *,
               timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = 0.01):
  """Polls `condition()` until it returns a truthy value, and returns that value.

  Args:
    condition: called every `poll_s` seconds (and once more at the deadline).
    what: what is awaited, for the error: a string, or a callable called at the deadline (so the
      message can show the state that was left, e.g. the pids still alive).
    timeout_s: how long to wait before raising.
    poll_s: the polling period.

  Raises:
    TimeoutError: `condition()` stayed falsy for `timeout_s` seconds.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    value = condition()
    if value:
      return value
    if time.monotonic() >= deadline:
      raise TimeoutError(f"waited {timeout_s:g}s for {_text(what)}")
    time.sleep(poll_s)


def wait_event(event: threading.Event, what: Message, *,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Waits for `event` to be set; raises TimeoutError naming `what` if it is not in time."""
  if not event.wait(timeout_s):
    raise TimeoutError(f"waited {timeout_s:g}s for {_text(what)}")


def pid_alive(pid: int) -> bool:
  """True if process `pid` exists and has not exited (a zombie has: only its reaping is left)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except (OSError, IndexError):
    return False


def wait_exited(pids, what: str = "the processes to exit", *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Waits until none of `pids` is alive (see `pid_alive`); the error lists the survivors."""
  pids = list(pids)
  wait_until(lambda: not any(pid_alive(p) for p in pids),
             lambda: f"{what} (still alive: {[p for p in pids if pid_alive(p)]})",
             timeout_s=timeout_s)


def url_answers(url: str, timeout_s: float = 2.0) -> bool:
  """True if a GET of `url` answers with a success status (a server's /health, say) within
  `timeout_s`; False if nothing listens there yet, or it answers an error."""
  import urllib.request  # pylint: disable=g-import-not-at-top
  try:
    with urllib.request.urlopen(url, timeout=timeout_s):
      return True
  except OSError:  # refused, timed out, or an HTTP error status (HTTPError is an OSError)
    return False
