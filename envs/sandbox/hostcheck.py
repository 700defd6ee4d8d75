"""Detects what this host offers for sandboxing, once, and explains what is missing.

The fleet needs: bubblewrap (`bwrap`), unprivileged user namespaces (bwrap runs as an
unprivileged uid so RLIMIT_NPROC binds and files are not root's), and a stdlib Python at
/usr/bin/python3 to run inside. cgroup v1 memory and pids controllers are used when writable
(whole-sandbox memory and process caps, OOM attribution); without them per-process rlimits are
the only caps and every result says so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess

SANDBOX_UID = 65534  # nobody: sandboxes never run as a uid that owns anything on the host.
SANDBOX_PYTHON = "/usr/bin/python3"


@dataclasses.dataclass(frozen=True)
class HostFeatures:
  """What the host supports. `problems` explains every missing feature in words."""
  bwrap: str | None
  namespaces: bool
  python: str | None
  cgroup_memory: str | None  # a directory we may create per-sandbox cgroups under
  cgroup_pids: str | None
  is_root: bool
  problems: tuple[str, ...]

  @property
  def full_isolation(self) -> bool:
    return bool(self.bwrap and self.namespaces and self.python)

  def describe(self) -> str:
    if self.full_isolation:
      parts = ["bwrap: user+pid+net+ipc+uts+mount namespaces, uid nobody, rlimits"]
      parts.append("cgroup memory" if self.cgroup_memory else "no memory cgroup (rlimit AS only)")
      parts.append("cgroup pids" if self.cgroup_pids else "no pids cgroup (rlimit NPROC only)")
      return ", ".join(parts)
    return ("DEGRADED (no namespaces: network, filesystem and pid isolation NOT enforced; "
            "rlimits, uid and process-group kill only): " + "; ".join(self.problems))


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


@functools.lru_cache(maxsize=None)
def detect() -> HostFeatures:
  """Probes the host (about 10 ms, cached)."""
  problems = []
  bwrap = shutil.which("bwrap")
  python = SANDBOX_PYTHON if os.access(SANDBOX_PYTHON, os.X_OK) else None
  if not python:
    problems.append(f"{SANDBOX_PYTHON} is missing (apt-get install python3)")
  namespaces = False
  if not bwrap:
    problems.append("bubblewrap is not installed (apt-get install bubblewrap, or run "
                    "scripts/bootstrap.sh)")
  else:
    cmd = [bwrap, "--unshare-user", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr",
           "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink",
           "usr/lib64", "/lib64", "/usr/bin/true"]
    kw = {}
    if os.geteuid() == 0:
      kw = dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])
    try:
      r = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False, **kw)
      namespaces = r.returncode == 0
      if not namespaces:
        problems.append("bwrap cannot create unprivileged user namespaces here "
                        f"({r.stderr.strip()}); check kernel.unprivileged_userns_clone and "
                        "user.max_user_namespaces")
    except (OSError, subprocess.TimeoutExpired) as e:
      problems.append(f"bwrap failed to run: {e}")
  return HostFeatures(
      bwrap=bwrap,
      namespaces=namespaces,
      python=python,
      cgroup_memory=_own_cgroup_dir("memory"),
      cgroup_pids=_own_cgroup_dir("pids"),
      is_root=os.geteuid() == 0,
      problems=tuple(problems),
  )


class SandboxUnavailable(RuntimeError):
  """The host cannot isolate sandboxes and degraded mode was not allowed."""
