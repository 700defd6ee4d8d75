"""Sandbox starts under sustained load, and where a start's time goes (for tools.bench_sandbox).

  * back to back: `n` calls of `sandbox.run(files={"main.py": "pass\\n"}, command=["python3",
    "main.py"])` on the default pool with nothing between them, so the pool refills while the
    calls go on; against the same `n` plain interpreters from nothing (a fresh directory, the
    file, `python3 main.py`: what the call replaces, without isolation) and `n` commands to a
    pre-forked plain interpreter (the fork server, like for like with a warm pool). Blocks of `n`
    on each side in turn, `rounds` times, so load falls on all alike.
  * start profile: sandboxes started one at a time from a running spawn helper, each phase's
    end stamped with time.perf_counter() by the process doing it (host, helper, C, Z: see
    envs/sandbox/spawner.py), the set-up processes' CPU seconds, then the episode's own steps
    and the teardown. What the previous design spent per start is measured beside it: bwrap
    with the namespaces and mounts it was run with, exec'ing /usr/bin/true, and a fresh
    interpreter importing what the zygote imports.
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
from envs.sandbox import slot as slot_lib

PYTHON = hostcheck.SANDBOX_PYTHON
MAIN = {"main.py": "pass\n"}

# (label, end mark, start mark): one row of the start profile each.
PHASES = (
    ("host: slot directory, cgroups made, limits written", "host_dirs_cgroups", "host_start"),
    ("request reaches the spawn helper", "spawner_received", "host_dirs_cgroups"),
    ("helper forks C (a copy of the helper, zygote imported)", "c_forked", "spawner_received"),
    ("C joins the cgroups, sets RLIMIT_NPROC", "c_cgroups", "c_forked"),
    ("C: user namespace and id maps", "c_userns", "c_cgroups"),
    ("C: mount, PID, net, IPC, UTS, cgroup namespaces", "c_namespaces", "c_userns"),
    ("C forks Z (PID 1)", "c_forked_init", "c_namespaces"),
    ("C's answer (pidfds) reaches the host", "host_spawn_reply", "c_forked_init"),
    ("Z: root file system (tmpfs, binds, /proc, /dev, pivot_root, ro)", "z_root", "z_forked"),
    ("Z: loopback up, hostname, new session", "z_net_uts", "z_root"),
    ("Z: nested user namespace, capabilities dropped", "z_privileges", "z_net_uts"),
    ("zygote forks its first command process, says ready", "z_ready", "z_privileges"),
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
  cpu = {"C (helper's fork: cgroups, namespaces, fork of Z)": ms([m["c_cpu"] for m in marks]),
         "Z (root file system, privileges, zygote's first fork)": ms([m["z_cpu"] for m in marks]),
         "host (slot, cgroups, request, ready)": ms(steps.pop("host_cpu"))}
  out = {"n": n, "phases_ms": phases, "cpu_ms": cpu,
         "steps_ms": {k: ms(v) for k, v in steps.items()}}
  out["old_ms"] = _old_design(n)
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


def markdown(b2b: dict, prof: dict) -> tuple[list[str], list[str]]:
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
  prof_lines = [
      "", f"Start profile ({prof['n']} sandboxes started one at a time from a running spawn "
      "helper; p50 wall ms of each phase, stamped by the process doing it; Z's phases overlap "
      "C's answer):", "", "| phase | p50 ms |", "| --- | --- |"]
  prof_lines += [f"| {label} | {v:.2f} |" for label, v in prof["phases_ms"]]
  prof_lines += [f"| CPU: {k} | {v:.2f} |" for k, v in prof["cpu_ms"].items()]
  prof_lines += [f"| episode step: {k} | {v:.2f} |" for k, v in prof["steps_ms"].items()]
  prof_lines += [f"| previous design, for comparison: {k} | {v:.2f} |"
                 for k, v in prof["old_ms"].items()]
  return rows, prof_lines
