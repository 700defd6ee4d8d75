"""The host's side of a sandbox's processes and cgroups: pidfds, cgroup files, stale sweeps.

`slot.Slot` starts, watches and tears down a sandbox through these: its first process is not
this process's child (the spawn helper's), so it is watched through a pidfd (`SandboxProcess`),
and everything it started is found and killed through its cgroups. Kept apart from `slot`,
which is the sandbox's lifecycle and request protocol.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time

from envs.sandbox import hostcheck


def cgroup_write(path: str, value: str) -> None:
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, value.encode())
  finally:
    os.close(fd)


def read_small(path: str) -> bytes:
  """A small file's contents (cgroup and /proc files), without a text file object: the host
  reads a few per episode."""
  fd = os.open(path, os.O_RDONLY)
  try:
    return os.read(fd, 1 << 16)
  finally:
    os.close(fd)


class SandboxProcess:
  """The sandbox's first process (its zygote), with the part of `subprocess.Popen`'s interface
  callers use: `pid`, `kill()`, `wait(timeout)`, `poll()`. Not this process's child (the spawn
  helper's), so its exit status is unknown: `poll()` and `wait()` give -1 once it has exited."""

  def __init__(self, pid: int, pidfd: int):
    self.pid = pid
    self._pidfd = pidfd
    self.returncode: int | None = None

  def kill(self) -> None:
    """Kills it, and so the whole sandbox (see `Slot.kill`)."""
    pidfd_kill(self._pidfd)

  def poll(self) -> int | None:
    if self.returncode is None and exited(self._pidfd):
      self.returncode = -1
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      if not select.select([self._pidfd], [], [], timeout)[0]:
        raise subprocess.TimeoutExpired(f"sandbox process {self.pid}", timeout)
      self.returncode = -1
    return self.returncode


def cgroup_violations(before: dict[str, int], after: dict[str, int],
                       already: list[str]) -> list[str]:
  out = []
  if after.get("memory", 0) > before.get("memory", 0):
    if not any(v.startswith("memory_limit") for v in already):
      out.append("memory_limit: sandbox memory cgroup limit reached")
  if after.get("pids", 0) > before.get("pids", 0):
    if not any(v.startswith("process_limit") for v in already):
      out.append("process_limit: sandbox pids cgroup limit reached")
  return out


def pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


def sweep_stale(features: hostcheck.HostFeatures, tmp_root: str = "/tmp") -> int:
  """Removes cgroups and slot directories left by dead processes (a killed fleet host).

  Returns how many cgroups were removed. This process's own are left to their pools (another
  pool here may be creating one right now).
  """
  removed = 0
  for parent in (features.cgroup_memory, features.cgroup_pids):
    if not parent:
      continue
    try:
      names = [n for n in os.listdir(parent) if n.startswith("envs-") and "-slot-" in n]
    except OSError:
      continue
    for name in names:
      try:
        pid = int(name.split("-")[1])
      except ValueError:
        continue
      path = os.path.join(parent, name)
      if pid == os.getpid() or pid_alive(pid):
        continue
      kill_cgroup(path)
      try:
        os.rmdir(path)
        removed += 1
      except OSError:
        pass  # Still in use (a live sandbox of this process) or still exiting.
  try:
    for name in os.listdir(tmp_root):
      parts = name.split("-")
      if name.startswith("envs-fleet-") and len(parts) > 3 and parts[2].isdigit():
        if not pid_alive(int(parts[2])):
          shutil.rmtree(os.path.join(tmp_root, name), ignore_errors=True)
  except OSError:
    pass
  return removed


def exited(pidfd: int) -> bool:
  return bool(select.select([pidfd], [], [], 0)[0])


def wait_pidfd(pidfd: int, timeout_s: float) -> bool:
  """Waits up to timeout_s for the process to exit; True if it did. A pidfd becomes readable
  as the process exits, so this returns at once (Popen.wait(timeout) polls, up to 50 ms late)."""
  return bool(select.select([pidfd], [], [], max(0.0, timeout_s))[0])


def pidfd_kill(pidfd: int) -> bool:
  try:
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return True
  except OSError:
    return False  # Already exited.


def close_fd(fd: int) -> None:
  if fd >= 0:
    try:
      os.close(fd)
    except OSError:
      pass


def empty_cgroup(path: str, ctl: str, deadline: float) -> bool:
  """Kills what is in a cgroup until nothing is (a pids cgroup: until nothing counts there,
  zombies included); False if something was left at the deadline."""
  while True:
    if ctl == "pids":
      left = read_int(os.path.join(path, "pids.current"))
    else:
      try:
        left = len(read_small(os.path.join(path, "cgroup.procs")).split())
      except OSError:
        left = 0
    if not left:
      return True
    if time.monotonic() >= deadline:
      return False
    kill_cgroup(path)
    time.sleep(0.002)


def kill_cgroup(path: str) -> None:
  try:
    with open(os.path.join(path, "cgroup.procs")) as f:
      for line in f:
        try:
          os.kill(int(line), signal.SIGKILL)
        except (OSError, ValueError):
          pass
  except OSError:
    pass


def read_int(path: str) -> int:
  try:
    return int(read_small(path).split()[0])
  except (OSError, ValueError, IndexError):
    return 0


def read_pids_events(path: str) -> int:
  try:
    for line in read_small(os.path.join(path, "pids.events")).splitlines():
      k, v = line.split()
      if k == b"max":
        return int(v)
  except (OSError, ValueError):
    pass
  return 0
