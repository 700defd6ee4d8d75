"""Detects what this host offers for sandboxing, once, and explains what is missing.

The fleet needs unprivileged user namespaces (the spawn helper, `spawner`, makes each sandbox's
namespaces as an unprivileged uid, so RLIMIT_NPROC binds and files are not root's) and a stdlib
Python at /usr/bin/python3 to run the helper and the programs inside. The check builds one real
sandbox (every namespace, the mounts, the dropped privileges) and runs nothing in it. cgroup v1 memory and pids controllers are used when writable
(whole-sandbox memory and process caps, OOM attribution); without them per-process rlimits are
the only caps and every result says so.

Process limits. RLIMIT_NPROC is not a per-process limit: the kernel compares it with the number
of tasks of the caller's real uid, and every sandbox runs as the same uid (nobody). Since Linux
5.14 that count is kept per user namespace, so inside a sandbox it covers that sandbox
alone, but a degraded sandbox (no namespaces) counts every process of the uid on the host: one
tenant's fork bomb, or many live sandboxes, would make another sandbox's fork fail. So where a
sandbox has its own pids cgroup, the cgroup is its process bound and RLIMIT_NPROC is only the
host-wide safety cap `nproc_cap` (the same for every sandbox; see `slot`); where it has none,
its `isolation` string says whether its process limit is shared.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import resource
import shutil
import subprocess
import tempfile

SANDBOX_UID = 65534  # nobody: sandboxes never run as a uid that owns anything on the host.
SANDBOX_PYTHON = "/usr/bin/python3"


@dataclasses.dataclass(frozen=True)
class HostFeatures:
  """What the host supports. `problems` explains every missing feature in words."""
  namespaces: bool
  python: str | None
  cgroup_memory: str | None  # a directory we may create per-sandbox cgroups under
  cgroup_pids: str | None
  is_root: bool
  problems: tuple[str, ...]
  # RLIMIT_NPROC of sandbox processes where a pids cgroup bounds each sandbox: a cap on all
  # tasks of the sandbox uid together, far above any one sandbox's bound (see `nproc_cap`).
  nproc_cap: int = 0
  # Whether the kernel counts RLIMIT_NPROC per user namespace (Linux >= 5.14), i.e. per
  # sandbox; before, every sandbox of the uid shares one count.
  nproc_per_userns: bool = True

  @property
  def full_isolation(self) -> bool:
    return bool(self.namespaces and self.python)

  @property
  def nproc_shared(self) -> bool:
    """Whether a sandbox's process limit counts other sandboxes' processes (no pids cgroup)."""
    if self.cgroup_pids:
      return False
    return not (self.full_isolation and self.nproc_per_userns)

  def describe(self) -> str:
    """The isolation in words. `Slot` describes each sandbox with what it really got."""
    uid = "uid nobody" if self.is_root else "this user's uid"
    shared = (f"process limit SHARED: RLIMIT_NPROC counts every process of {uid} on the host, "
              "other sandboxes' included")
    if self.full_isolation:
      parts = [f"namespaces: user+pid+net+ipc+uts+mount+cgroup, {uid}, no capabilities, rlimits"]
      parts.append("cgroup memory" if self.cgroup_memory else "no memory cgroup (rlimit AS only)")
      if self.cgroup_pids:
        parts.append("cgroup pids")
      elif self.nproc_per_userns:
        parts.append("no pids cgroup (rlimit NPROC only, counted per sandbox user namespace)")
      else:
        parts.append(f"no pids cgroup ({shared}: kernel before 5.14)")
      return ", ".join(parts)
    kept = ["rlimits", uid, "process-group kill"]
    kept += [name for name, on in (("cgroup memory", self.cgroup_memory),
                                   ("cgroup pids", self.cgroup_pids)) if on]
    text = ("DEGRADED (no namespaces: network, filesystem and pid isolation NOT enforced; "
            + ", ".join(kept) + " only")
    if not self.cgroup_pids:
      text += "; " + shared
    return text + "): " + "; ".join(self.problems)


def _own_cgroup_dir(controller: str) -> str | None:
  """Our cgroup v1 directory for `controller` if we may create children there."""
  base = f"/sys/fs/cgroup/{controller}"
  if not os.path.isdir(base) or os.geteuid() != 0:
    return None
  rel = ""
  try:
    with open("/proc/self/cgroup") as f:
      for line in f:
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if controller in controllers.split(","):
          rel = path.lstrip("/")
  except OSError:
    return None
  parent = os.path.join(base, rel)
  probe = os.path.join(parent, f"envs-probe-{os.getpid()}")
  try:
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError:
    return None
  return parent


def _kernel_at_least(major: int, minor: int) -> bool:
  try:
    got = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
  except ValueError:
    return False
  return got >= (major, minor)


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def nproc_cap() -> int:
  """The host-wide cap on tasks of the sandbox uid: half the host's pid space.

  Half of min(kernel.pid_max, kernel.threads-max), so sandboxes together can never take the
  pids the host itself needs, yet far above what any one sandbox's pids cgroup allows (so it
  never binds before the cgroup does). Not above our own hard limit, which only root may raise.
  """
  space = min(v for v in (_read_int("/proc/sys/kernel/pid_max"),
                          _read_int("/proc/sys/kernel/threads-max"), 1 << 22) if v)
  cap = max(1024, space // 2)
  hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
  if os.geteuid() != 0 and hard != resource.RLIM_INFINITY:
    cap = min(cap, hard)
  return cap


def _probe_namespaces(python: str) -> str | None:
  """Builds one sandbox as the spawn helper does, as the sandbox uid; None if it worked, else
  why not."""
  here = os.path.dirname(os.path.abspath(__file__))
  with open(os.path.join(here, "spawner.py")) as f:
    source = f.read()
  root = tempfile.mkdtemp(prefix=f"envs-probe-{os.getpid()}-", dir="/tmp")
  try:
    os.chmod(root, 0o755)
    paths = {k: os.path.join(root, k) for k in ("workspace", "opt", "site", "newroot")}
    for path in paths.values():
      os.mkdir(path, 0o755)
    kw = {}
    if os.geteuid() == 0:
      os.chown(paths["workspace"], SANDBOX_UID, SANDBOX_UID)
      kw = dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])
    # Source as -c: the source tree may sit where the sandbox uid cannot read.
    r = subprocess.run([python, "-s", "-B", "-c", source, "--probe", json.dumps(paths)],
                       capture_output=True, text=True, timeout=30, check=False, cwd=root, **kw)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")
  except (OSError, subprocess.TimeoutExpired) as e:
    return str(e)
  finally:
    shutil.rmtree(root, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def detect() -> HostFeatures:
  """Probes the host (a few tens of ms, cached)."""
  problems = []
  python = SANDBOX_PYTHON if os.access(SANDBOX_PYTHON, os.X_OK) else None
  namespaces = False
  if not python:
    problems.append(f"{SANDBOX_PYTHON} is missing (apt-get install python3)")
  else:
    why = _probe_namespaces(python)
    namespaces = why is None
    if why:
      problems.append(f"cannot create unprivileged user namespaces and mounts here ({why}); "
                      "check kernel.unprivileged_userns_clone and user.max_user_namespaces")
  return HostFeatures(
      namespaces=namespaces,
      python=python,
      cgroup_memory=_own_cgroup_dir("memory"),
      cgroup_pids=_own_cgroup_dir("pids"),
      is_root=os.geteuid() == 0,
      problems=tuple(problems),
      nproc_cap=nproc_cap(),
      # ucounts-based RLIMIT_NPROC (commit 21d1c5e386bc, "Reimplement RLIMIT_NPROC on top of
      # ucounts") counts per user namespace.
      nproc_per_userns=_kernel_at_least(5, 14),
  )


class SandboxUnavailable(RuntimeError):
  """The host cannot isolate sandboxes and degraded mode was not allowed."""
