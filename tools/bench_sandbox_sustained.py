"""Sandbox starts under sustained load, and where a start's time goes (for tools.bench_sandbox).

  * back to back: `n` calls of `sandbox.run(files={"main.py": "pass\\n"}, command=["python3",
    "main.py"])` on the default pool with nothing between them, so the pool refills while the
    calls go on; against the same `n` plain interpreters from nothing (a fresh directory, the
    file, `python3 main.py`: what the call replaces, without isolation) and `n` commands to a
    pre-forked plain interpreter (the fork server, like for like with a warm pool). Blocks of `n`
    on each side in turn, `rounds` times, so load falls on all alike.
  * start profile: sandboxes started one at a time from a running spawn helper, each phase's
    end stamped with time.perf_counter() by the process doing it (host, helper, Z: see
    envs/sandbox/spawner.py), the set-up processes' CPU seconds, then the episode's own steps
    and the teardown. What the previous design spent per start is measured beside it: bwrap
    with the namespaces and mounts it was run with, exec'ing /usr/bin/true, and a fresh
    interpreter importing what the zygote imports.
  * what a network namespace costs the kernel (`namespace_cost`): a child interpreter forks n
    processes that each unshare a user namespace, with and without a network namespace, and
    exit; the whole host's CPU time (/proc/stat) over the loop and until the kernel's workers
    have finished the namespaces' deferred teardown, less an idle window as long: what every
    sandbox's own network namespace adds, which cpuacct below does not see.
  * CPU per episode (where cgroup v1 cpuacct is writable, i.e. as root): the benchmark moves
    itself into a fresh cpuacct cgroup, which every process it then starts joins (the spawn
    helper and so every sandbox's processes, plain interpreters, the fork server), and reads the
    cgroup's CPU time over `n` episodes of each kind back to back. Load on the machine changes
    wall times, much less CPU time, so these ratios hold on a busy host. Kernel workers (the
    deferred part of a network namespace's teardown) are not counted.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time

from envs import sandbox
from envs.sandbox import hostcheck
from envs.sandbox import launcher as launcher_lib
from envs.sandbox import pool as pool_lib
from envs.sandbox import slot as slot_lib

PYTHON = hostcheck.SANDBOX_PYTHON
MAIN = {"main.py": "pass\n"}

# (label, end mark, start mark): one row of the start profile each.
PHASES = (
    ("host: slot directory, cgroups made, limits written", "host_dirs_cgroups", "host_start"),
    ("request reaches the spawn helper", "spawner_received", "host_dirs_cgroups"),
    ("helper forks Z into a new PID namespace (zygote imported)", "z_forked",
     "spawner_received"),
    ("helper's answer (a pidfd) reaches the host", "host_spawn_reply", "spawner_forked"),
    ("Z joins the cgroups", "z_cgroups", "z_forked"),
    ("Z: mount, net, IPC, UTS, cgroup namespaces", "z_namespaces", "z_cgroups"),
    ("Z: root file system (tmpfs, binds, /proc, /dev, pivot_root, ro)", "z_root",
     "z_namespaces"),
    ("Z: loopback up, hostname, new session", "z_net_uts", "z_root"),
    ("Z: own user namespace capped, final one, capabilities dropped", "z_privileges",
     "z_net_uts"),
    ("zygote forks its first command process, waits for its set-up, says ready", "z_ready",
     "z_privileges"),
    ("ready message reaches the host", "host_ready", "z_ready"),
    ("start, end to end (host_start to host_ready)", "host_ready", "host_start"),
)
# bwrap as the previous design ran it (slot.py before #22), minus the zygote.
_OLD_BWRAP = ["--unshare-user", "--unshare-all", "--die-with-parent", "--as-pid-1",
              "--disable-userns", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr",
              "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
              "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin", "--proc",
              "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--remount-ro", "/", "/usr/bin/true"]
_ZYGOTE_IMPORTS = ("import ctypes, gc, json, marshal, os, select, signal, stat, struct, sys, "
                   "time, atexit, builtins, importlib.machinery, resource, runpy, traceback")


def _pct(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def back_to_back(n: int, rounds: int, server) -> dict:
  """Latencies (s) of back-to-back calls: default-pool sandboxes, plain interpreters from
  nothing, and commands to `server` (a started `bench_sandbox.PreforkedPython`)."""
  out = {"sandbox": [], "plain": [], "prefork": []}
  pool = sandbox.default_pool()
  pool.wait_warm()
  root = tempfile.mkdtemp(prefix="bench-b2b-")
  try:
    for i in range(rounds + 1):  # The first round warms caches; not counted.
      lat = {k: [] for k in out}
      for _ in range(n):
        t = time.perf_counter()
        r = sandbox.run(files=dict(MAIN), command=["python3", "main.py"])
        lat["sandbox"].append(time.perf_counter() - t)
        assert r.ok, r
      for _ in range(n):
        t = time.perf_counter()
        d = tempfile.mkdtemp(dir=root)
        _write(d)
        subprocess.run([PYTHON, "main.py"], cwd=d, check=True)
        lat["plain"].append(time.perf_counter() - t)
        shutil.rmtree(d)
      for _ in range(n):
        t = time.perf_counter()
        d = tempfile.mkdtemp(dir=root)
        _write(d)
        code, _ = server.run(d, ["python3", "main.py"])
        lat["prefork"].append(time.perf_counter() - t)
        assert code == 0
        shutil.rmtree(d)
      if i:
        for k, v in lat.items():
          out[k] += v
  finally:
    shutil.rmtree(root, ignore_errors=True)
  out["pool"] = {"size": pool.size, "target": pool.target, "misses": pool.stats["misses"],
                 "acquired": pool.stats["acquired"]}
  return out


def _write(d: str) -> None:
  for rel, text in MAIN.items():
    with open(os.path.join(d, rel), "w") as f:
      f.write(text)


def start_profile(n: int) -> dict:
  """Per phase of a start, p50 of the wall milliseconds over n sequential starts; CPU of the
  set-up processes; the episode's steps and teardown; the previous design's two parts."""
  features = hostcheck.detect()
  root = tempfile.mkdtemp(prefix=f"envs-fleet-{os.getpid()}-profile-", dir="/tmp")
  os.chmod(root, 0o711)
  spawn = launcher_lib.Launcher(features, slot_lib.prepare_opt(features, root), root)
  marks, steps = [], {"populate": [], "exec": [], "kill_to_gone": [], "remove": [],
                      "host_cpu": []}
  try:
    for i in range(n + 3):  # The first three warm caches.
      cpu = time.thread_time()
      s = slot_lib.Slot(root, features, launcher=spawn, profile=True)
      s.wait_ready()
      host_cpu = time.thread_time() - cpu
      t0 = time.perf_counter()
      s.populate(dict(MAIN))
      t1 = time.perf_counter()
      r = s.exec(["python3", "main.py"])
      t2 = time.perf_counter()
      assert r.ok, r
      s.close()
      t3 = time.perf_counter()
      s.cleanup()
      t4 = time.perf_counter()
      if i >= 3:
        marks.append(s.profile)
        for k, v in (("populate", t1 - t0), ("exec", t2 - t1), ("kill_to_gone", t3 - t2),
                     ("remove", t4 - t3), ("host_cpu", host_cpu)):
          steps[k].append(v)
  finally:
    spawn.close()
    shutil.rmtree(root, ignore_errors=True)
  ms = lambda xs: statistics.median(xs) * 1e3
  phases = [(label, ms([m[end] - m[start] for m in marks])) for label, end, start in PHASES]
  cpu = {"helper (the fork, parent side)": ms([m["s_cpu"] for m in marks]),
         "Z (cgroups, namespaces, root file system, privileges, zygote's first fork)":
             ms([m["z_cpu"] for m in marks]),
         "host (slot, cgroups, request, ready)": ms(steps.pop("host_cpu"))}
  # Each a fork's own: copy-on-write copies of the helper's (or the zygote's) pages and first
  # touches of its mappings, the memory cost of starting from a fork.
  faults = {"helper (receipt to answer, parent side of the fork)": [m["s_minflt"] for m in marks],
            "Z (fork to ready: set-up, zygote, its first fork)": [m["z_minflt"] for m in marks],
            "first command process (fork to ready: its set-up and warm-up)":
                [m["spare_minflt"] for m in marks]}
  out = {"n": n, "phases_ms": phases, "cpu_ms": cpu,
         "faults": {k: statistics.median(v) for k, v in faults.items()},
         "steps_ms": {k: ms(v) for k, v in steps.items()}}
  out["old_ms"] = _old_design(n)
  return out


# Forks argv[1] processes that unshare the namespaces in argv[2] (a CLONE_* mask) and exit.
_UNSHARE_LOOP = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
n, flags = int(sys.argv[1]), int(sys.argv[2])
for _ in range(n):
  pid = os.fork()
  if pid == 0:
    os._exit(0 if libc.unshare(flags) == 0 else ctypes.get_errno() or 255)
  status = os.waitpid(pid, 0)[1]
  if status != 0:
    sys.exit("unshare failed: " + os.strerror(os.waitstatus_to_exitcode(status)))
"""
# envs/sandbox/spawner.py's values (it runs as a script beside the zygote, not importable here).
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


def _host_cpu_s() -> float:
  """CPU seconds the whole host has spent busy (user, nice, system, irq, softirq, steal)."""
  with open("/proc/stat") as f:
    v = [int(x) for x in f.readline().split()[1:]]
  return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def namespace_cost(n: int, settle_s: float = 2.0) -> dict | None:
  """Host CPU ms per process that unshares a user namespace, and one with a network namespace
  too (see the module docstring), each the median of 3 runs of n; None where unprivileged
  user namespaces are not allowed. Needs a quiet host: every process's CPU is counted."""
  def host_ms(flags: int) -> float:
    t0, c0 = time.perf_counter(), _host_cpu_s()
    subprocess.run([PYTHON, "-c", _UNSHARE_LOOP, str(n), str(flags)], check=True,
                   capture_output=True)
    time.sleep(settle_s)  # The deferred teardown of the last namespaces.
    busy, wall = _host_cpu_s() - c0, time.perf_counter() - t0
    c1 = _host_cpu_s()
    time.sleep(wall)  # The same window with nothing running: the host's own background.
    return (busy - (_host_cpu_s() - c1)) / n * 1e3
  try:
    host_ms(_CLONE_NEWUSER)
  except subprocess.CalledProcessError:
    return None
  out = {}
  for name, flags in (("user", _CLONE_NEWUSER), ("user_net", _CLONE_NEWUSER | _CLONE_NEWNET)):
    out[name] = statistics.median(host_ms(flags) for _ in range(3))
  out["n"] = n
  return out


def _old_design(n: int) -> dict:
  """p50 wall ms of the previous start's two parts, as the sandbox uid (where bwrap exists)."""
  kw = {}
  if os.geteuid() == 0:
    kw = dict(user=hostcheck.SANDBOX_UID, group=hostcheck.SANDBOX_UID, extra_groups=[])
  runs = {"interpreter importing the zygote's modules (python3 -s -B -c ...)":
          [PYTHON, "-s", "-B", "-c", _ZYGOTE_IMPORTS]}
  bwrap = shutil.which("bwrap")
  if bwrap:
    runs["bwrap: namespaces + mounts, exec /usr/bin/true"] = [bwrap] + _OLD_BWRAP
  out = {k: [] for k in runs}
  for i in range(n + 3):
    for k, argv in runs.items():
      t = time.perf_counter()
      subprocess.run(argv, check=True, cwd="/", **kw)
      if i >= 3:
        out[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) * 1e3 for k, v in out.items()}


_CPUACCT = "/sys/fs/cgroup/cpuacct"


def cpu_per_episode(n: int, server_factory) -> dict | None:
  """CPU ms per episode (p50 is not defined for a sum: the mean over n) of: sandbox.run on a
  fresh pool (start, refill and teardown included), a plain interpreter from nothing, a command
  to a fork server (`server_factory()`), and the previous design's two start parts. None where
  no cpuacct cgroup can be made."""
  cg = os.path.join(_CPUACCT, f"envs-bench-{os.getpid()}")
  try:
    with open("/proc/self/cgroup") as f:
      parent = next(line.rstrip().split(":", 2)[2] for line in f
                    if "cpuacct" in line.split(":")[1].split(","))
    os.mkdir(cg)
  except (OSError, StopIteration):
    return None
  usage = lambda: int(open(os.path.join(cg, "cpuacct.usage")).read()) / 1e6
  out = {}
  try:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
      f.write(str(os.getpid()))
    root = tempfile.mkdtemp(prefix="bench-cpu-")
    with pool_lib.WarmPool(size=2) as pool, server_factory() as server:
      pool.wait_warm()
      sides = {
          "sandbox": lambda d: sandbox.run(files=dict(MAIN), command=["python3", "main.py"],
                                           pool=pool),
          "plain": lambda d: subprocess.run([PYTHON, "main.py"], cwd=d, check=True),
          "prefork": lambda d: server.run(d, ["python3", "main.py"]),
      }
      for name, fn in sides.items():
        pool.wait_warm()
        u = usage()
        for _ in range(n):
          d = tempfile.mkdtemp(dir=root)
          _write(d)
          fn(d)
          shutil.rmtree(d)
        if name == "sandbox":
          pool.wait_warm()  # The refills its episodes caused count too.
        out[name] = (usage() - u) / n
    shutil.rmtree(root, ignore_errors=True)
    kw = {}
    if os.geteuid() == 0:
      kw = dict(user=hostcheck.SANDBOX_UID, group=hostcheck.SANDBOX_UID, extra_groups=[])
    old = {"old_interpreter": [PYTHON, "-s", "-B", "-c", _ZYGOTE_IMPORTS]}
    if shutil.which("bwrap"):
      old["old_bwrap"] = [shutil.which("bwrap")] + _OLD_BWRAP
    for name, argv in old.items():
      u = usage()
      for _ in range(n):
        subprocess.run(argv, check=True, cwd="/", **kw)
      out[name] = (usage() - u) / n
  finally:
    with open(os.path.join(_CPUACCT, parent.lstrip("/"), "cgroup.procs"), "w") as f:
      f.write(str(os.getpid()))
    os.rmdir(cg)
  out["n"] = n
  return out


def markdown(b2b: dict, prof: dict, cpu: dict | None = None) -> tuple[list[str], list[str]]:
  """Rows for bench_sandbox's table, and the start profile as its own table."""
  n = len(b2b["sandbox"])
  p = lambda side, q: _pct(b2b[side], q) * 1e3
  call = "`sandbox.run(main.py = pass, python3 main.py)`"
  rows = []
  for q in (50, 99):
    rows.append(
        f"| back to back p{q}: {call} on the default pool (size {b2b['pool']['size']}, grew to "
        f"{b2b['pool']['target']}), {n} calls in blocks, vs plain `{PYTHON} main.py` from "
        f"nothing (fresh dir + file, subprocess.run) back to back | {p('sandbox', q):.2f} ms | "
        f"{p('plain', q):.2f} ms | {p('sandbox', q) / p('plain', q):.2f}x |")
    rows.append(
        f"| back to back p{q}, same sandbox calls vs the pre-forked plain interpreter (fork "
        f"server, fresh dir + file + run) back to back | {p('sandbox', q):.2f} ms | "
        f"{p('prefork', q):.2f} ms | {p('sandbox', q) / p('prefork', q):.2f}x |")
  if cpu:
    label = (f"CPU per episode, mean of {cpu['n']} back to back (cpuacct: the benchmark and "
             "everything it starts; a sandbox episode's start, refill and teardown included)")
    rows.append(f"| {label}: {call} vs plain `{PYTHON} main.py` from nothing | "
                f"{cpu['sandbox']:.2f} ms | {cpu['plain']:.2f} ms | "
                f"{cpu['sandbox'] / cpu['plain']:.2f}x |")
    rows.append(f"| CPU per episode, same sandbox episodes vs a command to the pre-forked plain "
                f"interpreter (fork server) | {cpu['sandbox']:.2f} ms | {cpu['prefork']:.2f} ms | "
                f"{cpu['sandbox'] / cpu['prefork']:.2f}x |")
  prof_lines = [
      "", f"Start profile ({prof['n']} sandboxes started one at a time from a running spawn "
      "helper; p50 wall ms of each phase, stamped by the process doing it; Z's phases overlap "
      "the helper's answer):", "", "| phase | p50 ms |", "| --- | --- |"]
  prof_lines += [f"| {label} | {v:.2f} |" for label, v in prof["phases_ms"]]
  prof_lines += [f"| CPU: {k} | {v:.2f} |" for k, v in prof["cpu_ms"].items()]
  prof_lines += [f"| page faults (p50 count, not ms): {k} | {v:.0f} |"
                 for k, v in prof.get("faults", {}).items()]
  prof_lines += [f"| episode step: {k} | {v:.2f} |" for k, v in prof["steps_ms"].items()]
  prof_lines += [f"| previous design, for comparison: {k} | {v:.2f} |"
                 for k, v in prof["old_ms"].items()]
  ns = prof.get("namespace_cost")
  if ns:
    prof_lines.append(
        f"| host CPU ms (/proc/stat, kernel workers included) of a process that unshares a user "
        f"and a network namespace, less one that unshares the user namespace alone ({ns['n']} "
        f"each, median of 3 runs; every sandbox has its own network namespace) | "
        f"{ns['user_net'] - ns['user']:.2f} |")
  if cpu:
    prof_lines.append(f"| CPU ms per run of the previous design's interpreter start (cpuacct) | "
                      f"{cpu['old_interpreter']:.2f} |")
    if "old_bwrap" in cpu:
      prof_lines.append(f"| CPU ms per run of the previous design's bwrap, exec /usr/bin/true "
                        f"(cpuacct) | {cpu['old_bwrap']:.2f} |")
  return rows, prof_lines
