"""Host side of the spawn helper (`spawner`): starts it once, asks it for sandboxes.

The helper is started with a plain fork + exec (`subprocess.Popen` without `preexec_fn`, whose
child runs no Python and no at-fork hooks), as the sandbox uid, in its own session, with its
OOM score set from here. So starting a sandbox never forks this process, which may be running
threads (JAX's, the pool's) and for which `os.fork` is unsafe (JAX warns "os.fork() was
called..."); the forks happen in the single-threaded helper.

One helper per pool. It has no PR_SET_PDEATHSIG (that would tie it to the thread that started
it); it exits, killing every sandbox it made, at EOF on its socket, which comes when this
process closes it or dies.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

from envs.sandbox import host_procs
from envs.sandbox import hostcheck


class SpawnError(RuntimeError):
  """The helper could not make a sandbox."""


@dataclasses.dataclass
class Spawned:
  """A sandbox's first process Z, the zygote (PID 1 of the sandbox's PID namespace): its host
  pid and a pidfd. Z exits only once every process of the sandbox is gone."""
  pid: int
  pidfd: int


class Launcher:
  """The spawn helper process and the socket to it. Thread-safe."""

  def __init__(self, features: hostcheck.HostFeatures, opt_dir: str, root: str, *,
               namespaces: bool = True):
    """Starts the helper for namespaced sandboxes, or degraded ones (`namespaces=False`)."""
    self.features = features
    self.namespaces = namespaces
    self.opt_dir = opt_dir
    self.site_dir = os.path.join(os.path.dirname(opt_dir), "opt_site")
    # An empty directory each sandbox mounts its own new root (a tmpfs) on, in its own mount
    # namespace.
    self.newroot = os.path.join(root, "newroot")
    os.makedirs(self.newroot, exist_ok=True)
    os.chmod(self.newroot, 0o755)
    self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    kw = {}
    if features.is_root:
      kw = dict(user=hostcheck.SANDBOX_UID, group=hostcheck.SANDBOX_UID, extra_groups=[])
    try:
      self.proc = subprocess.Popen(
          [features.python or "python3", "-s", "-B", os.path.join(opt_dir, "spawner.py"),
           str(theirs.fileno()), "--ns" if namespaces else "--degraded",
           # The cap on all tasks of the sandbox uid where pids cgroups bound each sandbox.
           str(features.nproc_cap if features.cgroup_pids else 0)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
          stdout=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
          cwd=root, start_new_session=True, close_fds=True, **kw)
    finally:
      theirs.close()
    if features.is_root:
      try:
        # Inherited by every sandbox's processes: the zygote should survive an OOM (sandboxed
        # code raises its own score to 1000).
        with open(f"/proc/{self.proc.pid}/oom_score_adj", "w") as f:
          f.write("-1000")
      except OSError:
        pass  # Not permitted in some containers.
    self._lock = threading.Lock()
    self._ids = itertools.count()

  def spawn(self, *, workspace: str, cgroup_procs: list[str], timeout_s: float = 10.0,
            profile: dict | None = None) -> tuple[Spawned, int, int]:
    """Starts one sandbox; returns its processes and the host's ends of its control pipe
    (write, read). The sandbox joins the cgroups whose cgroup.procs paths are given before
    anything runs in it. With `profile` (a dict), the helper's phase marks are added to it."""
    to_zygote_r, to_zygote_w = os.pipe()
    from_zygote_r, from_zygote_w = os.pipe()
    fds = [to_zygote_r, from_zygote_w]
    try:
      for path in cgroup_procs:
        fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
      req = {"ns": self.namespaces, "workspace": workspace, "opt": self.opt_dir,
             "site": self.site_dir, "newroot": self.newroot}
      if profile is not None:
        req["profile"] = True
      with self._lock:
        req["id"] = next(self._ids)
        try:
          socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
        except OSError as e:
          raise SpawnError(f"spawn helper is gone ({e}; rc={self.proc.poll()})") from e
        reply, got = self._recv(req["id"], time.monotonic() + timeout_s)
    except BaseException:
      os.close(to_zygote_w)
      os.close(from_zygote_r)
      raise
    finally:
      for fd in fds:
        os.close(fd)
    if "error" in reply:
      for fd in got:
        os.close(fd)
      os.close(to_zygote_w)
      os.close(from_zygote_r)
      raise SpawnError(reply["error"])
    if profile is not None:
      profile.update(reply.get("profile", {}))
    return Spawned(_pidfd_pid(got[0]), got[0]), to_zygote_w, from_zygote_r

  def _recv(self, want: int, deadline: float) -> tuple[dict, list[int]]:
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self._sock], [], [], left)[0]:
        raise SpawnError(f"spawn helper did not answer in time (rc={self.proc.poll()})")
      msg, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 8)
      if not msg:
        raise SpawnError(f"spawn helper exited (rc={self.proc.poll()})")
      reply = json.loads(msg)
      if reply.get("id") == want:
        return reply, fds
      # A late answer to a request that timed out: nobody waits for that sandbox. Killing its
      # init (the last pidfd) takes down all of it.
      if fds:
        try:
          signal.pidfd_send_signal(fds[-1], signal.SIGKILL)
        except OSError:
          pass
      for fd in fds:
        os.close(fd)

  def close(self) -> None:
    """Closes the socket: the helper ends every sandbox it made and exits."""
    try:
      self._sock.close()
    except OSError:
      pass
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(timeout=10)



def _pidfd_pid(pidfd: int) -> int:
  """The pid, in this process's PID namespace, of the process a pidfd refers to (the helper
  knows only its own namespace's)."""
  for line in host_procs.read_small(f"/proc/self/fdinfo/{pidfd}").splitlines():
    if line.startswith(b"Pid:"):
      return int(line.split()[1])
  raise SpawnError("no pid in the pidfd's fdinfo")
