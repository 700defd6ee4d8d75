"""One pre-started sandbox: new namespaces running the zygote, with a private directory.

The pool's spawn helper (`launcher`, `spawner`) forks the sandbox into new user, mount, PID,
network, IPC, UTS and cgroup namespaces and its own cgroups (bwrap's isolation, set up with the
same system calls; see `spawner`). A slot is started ahead of demand (by `pool`), used by exactly
one episode, then destroyed:
killing the zygote, PID 1 of the sandbox's PID namespace, takes down every process inside, and
`close` returns only once they are all gone (see there). Single use is what guarantees that an
episode never sees another episode's files or processes.

Process limits: every sandbox runs as the same host uid, and RLIMIT_NPROC counts all tasks of a
uid (per user namespace since Linux 5.14; host-wide without namespaces). So where the sandbox has
its own pids cgroup (degraded sandboxes too: cgroups do not need namespaces), `pids.max` is the
sandbox's process bound and every process of the sandbox gets RLIMIT_NPROC = the host-wide cap
`HostFeatures.nproc_cap`, which also bounds (as the user namespaces' limit) all sandboxes'
processes together; one sandbox's processes never count against another's bound. Without a pids
cgroup RLIMIT_NPROC (nproc + 8) is the bound, and where the kernel counts it across sandboxes
(degraded mode, kernels before 5.14) the sandbox's `isolation`, and any refused fork's
`process_limit` violation, say that it is shared.

Machine state: a fresh slot's workspace is an empty host directory bind-mounted at /workspace. The
task snapshot is materialized into it by `populate` as plain file copies from the snapshot held
in memory (a few hundred microseconds for a small repository). Not hardlinks: a hardlink farm
shares inodes, so one in-place write would corrupt the snapshot for every later episode. Not
overlayfs: it is set up at the sandbox's start, which would tie warm slots to one snapshot.
After sandboxed code has run, the host never touches the workspace directly (a planted symlink
would redirect a root-owned write or read to a host path); later reads and writes go through the
zygote, inside the sandbox's view.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import select
import shutil
import struct
import subprocess
import threading
import time

from envs.sandbox import hostcheck
from envs.sandbox import host_procs
from envs.sandbox import launcher as launcher_lib

# Removes what dead fleet hosts left behind (the pool calls it at start).
sweep_stale = host_procs.sweep_stale

_HERE = os.path.dirname(os.path.abspath(__file__))
_IDS = itertools.count()
_IN_SANDBOX = ("spawner.py", "zygote.py", "command_process.py", "audit_hook.py",
               "testrunner.py")
_DEFAULT_MEMORY_MB = 512
_DEFAULT_NPROC = 64
# RLIMIT_NPROC above `nproc` where it is the process bound: it counts the zygote, its spare and
# the sandbox's outer process of this uid too.
_NPROC_SLACK = 8
# How long `close` waits for the sandbox's processes to be gone (the kernel tears a PID namespace
# down in milliseconds; this is for a host under heavy load).
_TEARDOWN_S = 10.0
# How long a degraded zygote gets at close to kill and reap its own processes before it is killed.
_DEGRADED_EXIT_S = 2.0
_SHARED_NPROC = ("; this sandbox's process limit is SHARED: RLIMIT_NPROC counts every process of "
                 "its uid on the host, other sandboxes' included")
# Extra memory for the zygote itself and tmpfs metadata on top of what the command may use.
_ZYGOTE_MB = 48


def prepare_opt(features: hostcheck.HostFeatures, root: str) -> str:
  """Copies the in-sandbox programs to root/opt (mounted read-only at /opt/envs) and compiles them.

  A copy because the source tree may sit under a directory the sandbox uid cannot traverse
  (Bazel's runfiles live under /root); compiled once with the sandbox's python so no sandbox
  start pays for compiling them (~10 ms). Also root/opt_site/sitecustomize.py (the audit hook for
  pythons that sandboxed code starts).
  """
  opt = os.path.join(root, "opt")
  site = os.path.join(root, "opt_site")
  for d in (opt, site):
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
  for name in _IN_SANDBOX:
    shutil.copyfile(os.path.join(_HERE, name), os.path.join(opt, name))
    os.chmod(os.path.join(opt, name), 0o644)
  shutil.copyfile(os.path.join(_HERE, "audit_hook.py"), os.path.join(site, "sitecustomize.py"))
  os.chmod(os.path.join(site, "sitecustomize.py"), 0o644)
  if features.python:
    subprocess.run([features.python, "-m", "compileall", "-q", opt], capture_output=True,
                   check=False)
    cache = os.path.join(opt, "__pycache__")
    if os.path.isdir(cache):
      os.chmod(cache, 0o755)
      for name in os.listdir(cache):
        os.chmod(os.path.join(cache, name), 0o644)
  return opt


class SlotError(RuntimeError):
  """The sandbox itself failed (infrastructure), not the code in it."""


@dataclasses.dataclass
class Result:
  """What a command did in a sandbox.

  exit_code: the exit status, or -N when killed by signal N (as `subprocess`).
  violations: what the sandbox blocked or detected, one "kind: detail" string each.
  isolation: how the sandbox was isolated; starts with "DEGRADED" when namespaces were missing.
  infra_error: set when the sandbox failed rather than the code; then exit_code is meaningless.
  events: raw audit events (network, writes outside the workspace, signals).
  """
  exit_code: int
  stdout: str
  stderr: str
  timed_out: bool
  violations: list[str]
  wall_s: float = 0.0
  isolation: str = ""
  infra_error: str | None = None
  events: list[dict] = dataclasses.field(default_factory=list)

  @property
  def ok(self) -> bool:
    return self.infra_error is None and self.exit_code == 0 and not self.timed_out


class Slot:
  """A started sandbox. Not thread-safe for concurrent requests; one episode owns it."""

  def __init__(self, root: str, features: hostcheck.HostFeatures, *,
               launcher: launcher_lib.Launcher, degraded: bool = False, profile: bool = False):
    """Starts the sandbox (`wait_ready` waits for it). With `profile`, `self.profile` gets the
    time.perf_counter() at the end of each phase of the start, host and sandbox side, and the CPU
    seconds of the sandbox's set-up processes (for the benchmark's profile)."""
    self.profile: dict | None = {"host_start": time.perf_counter()} if profile else None
    self.id = next(_IDS)
    self.opt_dir = launcher.opt_dir
    self.features = features
    self.degraded = degraded
    # The slot's one directory, under the pool's root: its workspace (bind-mounted at /workspace).
    self.workspace = os.path.join(root, f"slot-{self.id}")
    os.mkdir(self.workspace)
    self.uid = hostcheck.SANDBOX_UID if features.is_root else os.geteuid()
    if features.is_root:
      os.chown(self.workspace, self.uid, self.uid)
    self.cgroups = {}
    for ctl, parent in (("memory", features.cgroup_memory), ("pids", features.cgroup_pids)):
      if parent:
        path = os.path.join(parent, f"envs-{os.getpid()}-slot-{self.id}")
        try:
          os.mkdir(path)
          self.cgroups[ctl] = path
        except OSError:
          pass
    # What this sandbox really got: a cgroup that could not be made is not there.
    self.effective, self.isolation = _effective(features, degraded, tuple(sorted(self.cgroups)))
    # False at the end of `close` if some process of the sandbox outlived its bounded wait.
    self.processes_gone: bool | None = None
    self.used = False
    self.closed = False
    self._killed = False
    self._init_killed = False
    self._lock = threading.Lock()
    self._limits: dict[str, str] = {}  # cgroup file -> the value last written there
    # Cgroup limit-hit counters as of the end of the last command: the next command's baseline.
    # None when a request since may have moved them (then they are read again).
    self._counts: dict[str, int] | None = None
    self.started_at = time.monotonic()
    try:
      # The default limits before anything runs in the cgroups, so an exec with the defaults
      # writes nothing.
      self._set_limits(_DEFAULT_MEMORY_MB, _DEFAULT_NPROC)
      if profile:
        self.profile["host_dirs_cgroups"] = time.perf_counter()
      if launcher.namespaces == degraded:
        raise ValueError(f"a {'degraded' if degraded else 'namespaced'} sandbox needs a "
                         "launcher of its kind")
      self.spawned, self._w, self._r = launcher.spawn(
          workspace=self.workspace,
          cgroup_procs=[os.path.join(p, "cgroup.procs") for p in self.cgroups.values()],
          profile=self.profile)
      if profile:
        self.profile["host_spawn_reply"] = time.perf_counter()
    except Exception as e:
      self.closed = True
      self._remove()
      raise SlotError(f"sandbox {self.id} did not start: {e}") from e
    self.pid = self.spawned.pid
    self.proc = host_procs.SandboxProcess(self.spawned.pid, self.spawned.pidfd)
    self.zygote_pid = None
    self.runner_path = (os.path.join(self.opt_dir, "testrunner.py") if degraded else
                        "/opt/envs/testrunner.py")

  # -- start -----------------------------------------------------------------------------------

  def alive(self) -> bool:
    """Whether the sandbox's first process (the zygote) is still running."""
    return not host_procs.exited(self.spawned.pidfd)

  def _rlimit_nproc(self, nproc: int) -> int:
    """RLIMIT_NPROC for a command allowed `nproc` processes (see the module docstring)."""
    if "pids" in self.cgroups:
      return max(self.features.nproc_cap, nproc + _NPROC_SLACK)
    return nproc + _NPROC_SLACK

  def wait_ready(self, timeout_s: float = 10.0) -> None:
    try:
      resp = self._recv(timeout_s)
    except ValueError as e:  # The set-up failed and said why.
      raise SlotError(f"sandbox {self.id}: {e}") from e
    self.zygote_pid = resp["pid"]
    self._counts = self._read_counts()
    if self.profile is not None:
      self.profile.update(resp.get("profile", {}))
      self.profile["host_ready"] = time.perf_counter()
    self.ready_s = time.monotonic() - self.started_at

  # -- protocol --------------------------------------------------------------------------------

  def _send(self, obj) -> None:
    body = json.dumps(obj).encode()
    data = struct.pack(">I", len(body)) + body
    try:
      while data:
        data = data[os.write(self._w, data):]
    except OSError as e:
      raise SlotError(f"sandbox {self.id} control pipe closed: {e}") from e

  def _read_exact(self, n: int, deadline: float) -> bytes:
    chunks = []
    while n:
      left = deadline - time.monotonic()
      if left <= 0:
        raise SlotError(f"sandbox {self.id} did not answer in time")
      ready, _, _ = select.select([self._r], [], [], left)
      if not ready:
        continue
      chunk = os.read(self._r, min(n, 1 << 20))
      if not chunk:
        raise SlotError(f"sandbox {self.id} exited unexpectedly (alive={self.alive()})")
      chunks.append(chunk)
      n -= len(chunk)
    return b"".join(chunks)

  def _recv(self, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    (n,) = struct.unpack(">I", self._read_exact(4, deadline))
    resp = json.loads(self._read_exact(n, deadline))
    if not resp.get("ok"):
      raise ValueError(resp.get("error", "sandbox request failed"))
    return resp

  def request(self, req: dict, timeout_s: float = 30.0) -> dict:
    """Sends one request to the zygote. Raises SlotError if the sandbox is broken."""
    if self.closed:
      raise SlotError(f"sandbox {self.id} is closed")
    with self._lock:
      self.used = True
      self._counts = None
      self._send(req)
      try:
        return self._recv(timeout_s)
      except SlotError:
        self.close()
        raise

  def spare_pid(self, timeout_s: float = 30.0) -> int | None:
    """The pid of the zygote's waiting command process (the "spare"), or None if it has none.

    The zygote forks the next spare right after answering a request and before reading the
    next one, so this round trip returns only once the spare that follows the last request
    exists and has done its set-up: a test can look for it without sleeping. The pid is the sandbox's own (its PID
    namespace's) unless the sandbox is degraded.
    """
    return self.request({"op": "ping"}, timeout_s=timeout_s)["spare_pid"]

  # -- files -----------------------------------------------------------------------------------

  def populate(self, files: dict[str, str | bytes]) -> None:
    """Copies a snapshot into the fresh workspace, host side. Only before any code has run."""
    if self.used:
      raise SlotError("populate() is only safe before sandboxed code has run; use write_files")
    for rel, content in files.items():
      norm = os.path.normpath(rel)
      if os.path.isabs(norm) or norm.startswith(".."):
        raise ValueError(f"file path {rel!r} escapes the workspace")
      path = os.path.join(self.workspace, norm)
      parent = os.path.dirname(path)
      if not os.path.isdir(parent):
        os.makedirs(parent)
        if self.features.is_root:
          d = parent
          while d != self.workspace:
            os.chown(d, self.uid, self.uid)
            d = os.path.dirname(d)
      data = content.encode() if isinstance(content, str) else content
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
      try:
        os.write(fd, data)
        if self.features.is_root:
          os.fchown(fd, self.uid, self.uid)
      finally:
        os.close(fd)

  def write_files(self, files: dict[str, str], delete: tuple[str, ...] = ()) -> None:
    self.request({"op": "write_files", "files": files, "delete": list(delete)})

  def read_files(self, paths: list[str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Returns (files, skipped) read inside the sandbox; all regular files when paths is None."""
    resp = self.request({"op": "read_files", "paths": paths})
    return resp["files"], resp["skipped"]

  def list_files(self, path: str = ".", limit: int = 1000) -> list[str]:
    return self.request({"op": "list_files", "path": path, "limit": limit})["paths"]

  # -- exec ------------------------------------------------------------------------------------

  def exec(self, argv: list[str], *, timeout_s: float = 10.0,
           memory_mb: int = _DEFAULT_MEMORY_MB, cpu_s: float | None = None,
           nproc: int = _DEFAULT_NPROC, fsize_mb: int = 64,
           max_output_bytes: int = 1 << 20, env: dict[str, str] | None = None,
           cwd: str | None = None, stdin: str = "", fast_path: bool = True,
           last: bool = False) -> Result:
    """Runs argv in the sandbox; the whole process tree is killed when it ends.

    `last`: no command follows (`sandbox.run`), so the zygote forks no command process ahead
    for the next one (a later exec still works, forking one on demand).
    """
    self._set_limits(memory_mb, nproc)
    before = self._counts if self._counts is not None else self._read_counts()
    req = {"op": "exec", "argv": list(argv), "timeout_s": timeout_s, "memory_mb": memory_mb,
           "cpu_s": int(cpu_s if cpu_s is not None else max(1, timeout_s) + 1), "nproc": nproc,
           "rlimit_nproc": self._rlimit_nproc(nproc),
           "fsize_mb": fsize_mb, "max_output_bytes": max_output_bytes, "env": env or {},
           "cwd": cwd, "stdin": stdin, "fast_path": fast_path, "fork_next": not last}
    try:
      resp = self.request(req, timeout_s=timeout_s + 10.0)
    except SlotError as e:
      return Result(exit_code=-1, stdout="", stderr="", timed_out=False, violations=[],
                    isolation=self.isolation, infra_error=str(e))
    after = self._read_counts()
    self._counts = after
    violations = list(resp["violations"])
    violations += host_procs.cgroup_violations(before, after, violations)
    for ev in resp["events"]:
      violations.append(f"{ev['kind']}: {ev['detail']}")
    if self.effective.nproc_shared:
      violations = [v + _SHARED_NPROC if v.startswith("process_limit") else v
                    for v in violations]
    if self.degraded:
      violations.append("degraded_isolation: " + self.isolation)
    return Result(exit_code=resp["exit_code"], stdout=resp["stdout"], stderr=resp["stderr"],
                  timed_out=resp["timed_out"], violations=violations, wall_s=resp["wall_s"],
                  isolation=self.isolation, events=resp["events"])

  def _set_limits(self, memory_mb: int, nproc: int) -> None:
    """Sets the sandbox's cgroup limits for the next command; writes only what changed."""
    for ctl, name, value in (("memory", "memory.limit_in_bytes", (memory_mb + _ZYGOTE_MB) << 20),
                             ("pids", "pids.max", nproc + 1)):
      if ctl in self.cgroups and self._limits.get(name) != str(value):
        host_procs.cgroup_write(os.path.join(self.cgroups[ctl], name), str(value))
        self._limits[name] = str(value)

  def _read_counts(self) -> dict[str, int]:
    """How often each cgroup limit has been hit so far."""
    counts = {}
    if "memory" in self.cgroups:
      counts["memory"] = host_procs.read_int(os.path.join(self.cgroups["memory"], "memory.failcnt"))
    if "pids" in self.cgroups:
      counts["pids"] = host_procs.read_pids_events(self.cgroups["pids"])
    return counts

  # -- teardown --------------------------------------------------------------------------------

  def kill(self) -> None:
    """Starts destroying the sandbox without waiting for it; `close` waits. Idempotent."""
    if self._killed:
      return
    self._killed = True
    if not self.degraded:
      # Kill the namespace's init (the zygote), through its pidfd: the kernel then kills
      # everything else in the namespace, and the init's exit completes only once all of it has
      # been reaped. So its exit means every process is gone.
      self._init_killed = host_procs.pidfd_kill(self.spawned.pidfd)
    else:
      # Without namespaces the zygote is the subreaper of everything it started: at EOF on its
      # control pipe it kills and reaps every one, says so, then exits. (Killed first, its
      # processes would be orphaned to the host's init, which may take seconds to reap them.)
      host_procs.close_fd(self._w)
      self._w = -1

  def close(self) -> None:
    """Kills the sandbox and every process in it, and waits until they are gone; idempotent.

    Gone means reaped, not merely killed: a dying or zombie task still counts against
    RLIMIT_NPROC and the pids cgroup (and holds memory), so a sandbox whose processes were still
    being torn down would count against whatever starts next. The wait is bounded
    (`_TEARDOWN_S`); `processes_gone` says whether it was enough.
    """
    if self.closed:
      return
    self.closed = True
    self.kill()
    self.processes_gone = self._wait_gone(time.monotonic() + _TEARDOWN_S)
    for fd in (self._w, self._r, self.spawned.pidfd):
      host_procs.close_fd(fd)
    self._w = self._r = -1

  def _wait_gone(self, deadline: float) -> bool:
    left = lambda: max(0.0, deadline - time.monotonic())
    if self.degraded:
      # Busy or stuck if it has not said it is done in time: killed; then what it left is
      # found only through a cgroup.
      gone = self._said_bye(time.monotonic() + min(_DEGRADED_EXIT_S, left()))
      if not gone:
        host_procs.pidfd_kill(self.spawned.pidfd)
    else:
      gone = self._init_killed
    if not host_procs.wait_pidfd(self.spawned.pidfd, left()):
      host_procs.pidfd_kill(self.spawned.pidfd)
      host_procs.wait_pidfd(self.spawned.pidfd, 1.0)
      return False
    # Where there is a cgroup it has the last word: kill whatever is in it until nothing is.
    for ctl in ("pids", "memory"):
      if ctl in self.cgroups:
        return host_procs.empty_cgroup(self.cgroups[ctl], ctl, deadline)
    return gone

  def _said_bye(self, deadline: float) -> bool:
    """Whether a degraded zygote reported, after its control pipe closed, that it killed and
    reaped every process it started."""
    try:
      while True:
        resp = self._recv(max(0.0, deadline - time.monotonic()))
        if resp.get("bye"):
          return bool(resp.get("clean"))
    except (SlotError, ValueError):
      return False

  def _remove(self) -> None:
    for path in self.cgroups.values():
      for _ in range(200):
        try:
          os.rmdir(path)
          break
        except FileNotFoundError:
          break
        except OSError:
          # Processes are still exiting (the kernel kills the namespace asynchronously).
          host_procs.kill_cgroup(path)
          time.sleep(0.005)
    shutil.rmtree(self.workspace, ignore_errors=True)

  def cleanup(self) -> None:
    """Kills the sandbox, waits until its processes are gone, removes its directory and
    cgroups."""
    self.close()
    self._remove()


@functools.lru_cache(maxsize=None)
def _effective(features: hostcheck.HostFeatures, degraded: bool,
               cgroups: tuple[str, ...]) -> tuple[hostcheck.HostFeatures, str]:
  """A sandbox's features and isolation string, worked out once per kind of sandbox."""
  effective = dataclasses.replace(
      features, namespaces=features.namespaces and not degraded,
      cgroup_memory=features.cgroup_memory if "memory" in cgroups else None,
      cgroup_pids=features.cgroup_pids if "pids" in cgroups else None)
  return effective, effective.describe()
