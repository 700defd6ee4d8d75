"""The public sandbox interface: run a command on some files in a fresh, isolated sandbox.

    from envs import sandbox
    r = sandbox.run(files={"main.py": "print(1)"}, command=["python3", "main.py"],
                    timeout_s=5, memory_mb=256)
    r.exit_code, r.stdout, r.stderr, r.timed_out, r.violations

Each call gets a fresh sandbox from a process-wide warm pool (`pool`), so after the first
call a run costs milliseconds. `Sandbox` is the richer per-episode handle the harness uses: one
sandbox for the whole episode, many commands and file operations against the same workspace.

Isolation (see `hostcheck`, `spawner`): user, PID, network, IPC, UTS, cgroup and mount
namespaces, only /usr (read-only) and the workspace visible, uid nobody without capabilities,
rlimits on CPU time, address space, processes, file size and open files, capped output, cgroup
memory and pids limits where available, and every process killed after each command. When the
host lacks user namespaces, `run` raises `SandboxUnavailable` unless ENVS_SANDBOX_ALLOW_DEGRADED=1 is set.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Mapping

from envs.sandbox import hostcheck
from envs.sandbox import pool as pool_lib
from envs.sandbox import slot as slot_lib

Result = slot_lib.Result
SandboxUnavailable = hostcheck.SandboxUnavailable
SlotError = slot_lib.SlotError

_default_pool: pool_lib.WarmPool | None = None
_default_lock = threading.Lock()


def default_pool() -> pool_lib.WarmPool:
  """The process-wide warm pool, started on first use."""
  global _default_pool
  with _default_lock:
    if _default_pool is None:
      allow = os.environ.get("ENVS_SANDBOX_ALLOW_DEGRADED") == "1"
      size = int(os.environ.get("ENVS_SANDBOX_POOL_SIZE", "2"))
      # Room to grow under demand: a back-to-back caller outruns the refill (a start costs
      # more CPU than a call's wait), so the idle buffer must cover a stream's deficit: with 8
      # (4 x size) back-to-back p99 was 25.8 ms, with 32 14.9 ms (BENCHMARKS.md, "Sandbox
      # fleet"). Idle slots above `size` go after a
      # quiet spell (WarmPool.shrink_after_s), so a quiet process holds `size`.
      max_live = int(os.environ.get("ENVS_SANDBOX_POOL_MAX_LIVE", str(max(32, 4 * size))))
      _default_pool = pool_lib.WarmPool(size=size, max_live=max_live, allow_degraded=allow)
      atexit.register(_default_pool.close)
    return _default_pool


class Sandbox:
  """One episode's sandbox: a fresh workspace holding `files`, many commands.

  Use as a context manager; the sandbox and every process in it are destroyed on exit.
  """

  def __init__(self, files: Mapping[str, str | bytes] | None = None, *,
               pool: pool_lib.WarmPool | None = None, acquire_timeout_s: float = 60.0):
    self.pool = pool or default_pool()
    self.slot = self.pool.acquire(timeout_s=acquire_timeout_s)
    try:
      if files:
        self.slot.populate(dict(files))
    except BaseException:
      self.pool.release(self.slot)
      raise

  @property
  def isolation(self) -> str:
    return self.slot.isolation

  def exec(self, command: list[str], **limits) -> Result:
    """Runs a command; see `Slot.exec` for limits (timeout_s, memory_mb, nproc, ...)."""
    return self.slot.exec(command, **limits)

  def write_files(self, files: Mapping[str, str], delete: tuple[str, ...] = ()) -> None:
    self.slot.write_files(dict(files), delete)

  def read_files(self, paths: list[str] | None = None) -> dict[str, str]:
    return self.slot.read_files(paths)[0]

  def list_files(self, path: str = ".") -> list[str]:
    return self.slot.list_files(path)

  def close(self) -> None:
    if self.slot is not None:
      self.pool.release(self.slot)
      self.slot = None

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def run(files: Mapping[str, str | bytes] | None = None, command: list[str] | None = None, *,
        timeout_s: float = 10.0, memory_mb: int = 512, pool: pool_lib.WarmPool | None = None,
        **limits) -> Result:
  """Runs `command` in a fresh sandbox holding `files` (paths relative to the workspace).

  Args:
    files: the workspace contents, {relative path: text or bytes}.
    command: argv, run with the workspace as the working directory.
    timeout_s: wall-clock limit; the whole process tree is killed when it passes.
    memory_mb: address-space limit per process, and the sandbox's memory cgroup limit.
    pool: a `WarmPool` (default: the process-wide one).
    **limits: cpu_s, nproc, fsize_mb, max_output_bytes, env, stdin (see `Slot.exec`).

  Returns:
    A `Result`. A broken sandbox gives `infra_error` set instead of raising.
  """
  if not command:
    raise ValueError("command must be a non-empty argv list")
  try:
    sb = Sandbox(files, pool=pool)
  except slot_lib.SlotError as e:
    p = pool or default_pool()
    return Result(exit_code=-1, stdout="", stderr="", timed_out=False, violations=[],
                  isolation=p.isolation, infra_error=str(e))
  with sb:
    return sb.exec(list(command), timeout_s=timeout_s, memory_mb=memory_mb,
                   **{"last": True, **limits})
