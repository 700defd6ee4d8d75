r"""Benchmarks the sandbox fleet against plain interpreters, like against like, in one run.

    .venv/bin/python -m tools.bench_sandbox            # or: bazel run //tools:bench_sandbox
    .venv/bin/python -m tools.bench_sandbox --quick    # small sizes, a few seconds

Every row names both sides; each pair is measured interleaved in the same loop, so machine load
falls on both alike. One command at a time (one thread on each side) except in the bursts.
Reports (as a Markdown table, and JSON with --json):
  * cold against cold: a sandbox created from nothing (the spawn helper started, the sandbox
    forked from it, the files written, `python3 main.py` run to its result; main.py = "pass")
    against a plain
    interpreter started from nothing (`python3 main.py` in a fresh directory holding the same
    file, via subprocess.run); the sandbox's teardown after the result is reported beside;
  * warm against warm: a sandbox taken from a warm pool (files written, `python3 main.py` run)
    against a pre-forked plain interpreter without isolation (`PreforkedPython`: a fork server
    whose next child is forked ahead of demand and runs the script in-process, the same design
    as the sandbox's pre-forked command process, minus namespaces, cgroups, rlimits and the
    audit hook), and against the same warm pool with isolation switched off
    (`force_degraded=True`: the same zygote and protocol, no namespaces; rlimits, and the
    per-sandbox cgroups where the host has them); also with the pool's
    refill starting at once (refill_delay_s=0; by default a pool at its base size holds the refill
    back 30 ms while idle sandboxes remain, so it does not compete with the command for the CPU);
  * a second command in a started sandbox, `python3 main.py` (in-process fast path) and `true`
    (exec), against the same commands sent again to the fork server;
  * bursts of 100 and 1,000 episodes queued at once (each: a fresh sandbox, files, run,
    teardown) through the local fleet against the same number of fresh plain interpreters at
    the same concurrency: episodes/s, latency from enqueue to result p50/p99, peak live
    sandboxes;
  * memory per idle sandbox (PSS of its outer process, the zygote and its waiting command
    process) against an idle fork server (PSS of the server and its waiting child);
  * back to back on the default pool, and a profile of a start (see bench_sandbox_sustained).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from envs import sandbox
from envs.sandbox import fleet
from envs.sandbox import hostcheck
from envs.sandbox import launcher as launcher_lib
from envs.sandbox import pool as pool_lib
from envs.sandbox import slot as slot_lib
from tools import bench_sandbox_sustained as sustained


# The baselines run the same interpreter the sandboxes run (not a pyenv shim on PATH, which
# would add ~300 ms of bash and flatter the comparison).
PYTHON = hostcheck.SANDBOX_PYTHON
MAIN = {"main.py": "pass\n"}

# The fork server: stdlib only, run as `python3 -s -B -c _SERVER` (the flags the zygote runs
# with). Protocol: one JSON request per line on stdin, {"cwd": dir, "argv": [...]}; one JSON
# answer per line on stdout, {"code": exit status, "out": stdout and stderr}; {"ping": true} is
# answered by the server with the waiting child's pid. The child for the
# next request is forked as soon as the previous answer is written, so starting a command is a
# pipe write; `python3 FILE` runs in the child itself, anything else through exec.
_SERVER = r"""
import json, os, sys, traceback

def spare():
  req_r, req_w = os.pipe()
  out_r, out_w = os.pipe()
  pid = os.fork()
  if pid:
    os.close(req_r)
    os.close(out_w)
    return pid, req_w, out_r
  os.close(req_w)
  os.close(out_r)
  os.dup2(out_w, 1)
  os.dup2(out_w, 2)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  chunks = []
  while True:
    c = os.read(req_r, 65536)
    if not c:
      break
    chunks.append(c)
  req = json.loads(b"".join(chunks))
  os.chdir(req["cwd"])
  argv = req["argv"]
  if len(argv) == 2 and argv[0] in ("python", "python3"):
    code = 0
    sys.argv = argv[1:]
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    try:
      with open(argv[1]) as f:
        src = f.read()
      exec(compile(src, argv[1], "exec"), {"__name__": "__main__", "__file__": argv[1],
                                           "__builtins__": __builtins__})
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  try:
    os.execvp(argv[0], argv)
  except OSError:
    os._exit(127)

child = spare()
sys.stdout.write("{}\n")
sys.stdout.flush()
for line in sys.stdin:
  pid, req_w, out_r = child
  if line.startswith('{"ping"'):  # Answered here: the spare for the next request exists.
    sys.stdout.write(json.dumps({"spare_pid": pid}) + "\n")
    sys.stdout.flush()
    continue
  os.write(req_w, line.encode())
  os.close(req_w)
  chunks = []
  while True:
    c = os.read(out_r, 65536)
    if not c:
      break
    chunks.append(c)
  os.close(out_r)
  _, status = os.waitpid(pid, 0)
  sys.stdout.write(json.dumps({"code": os.waitstatus_to_exitcode(status),
                               "out": b"".join(chunks).decode(errors="replace")}) + "\n")
  sys.stdout.flush()
  child = spare()
"""


class PreforkedPython:
  """A pre-forked plain interpreter, the warm baseline: no isolation of any kind.

  A started `python3` (the fork server) keeps one child forked ahead of demand, waiting on a
  pipe; `run` hands it a working directory and argv and waits for its exit status and output.
  Each command runs in a fresh child, as each sandbox command does; the server itself never
  runs the command's code.
  """

  def __init__(self):
    self.proc = subprocess.Popen([PYTHON, "-s", "-B", "-c", _SERVER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, bufsize=1,
                                 env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if self.proc.stdout.readline() != "{}\n":
      raise RuntimeError(f"fork server did not start (rc={self.proc.poll()})")

  def run(self, cwd: str, argv: list[str]) -> tuple[int, str]:
    self.proc.stdin.write(json.dumps({"cwd": cwd, "argv": argv}) + "\n")
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"fork server exited (rc={self.proc.poll()})")
    resp = json.loads(line)
    return resp["code"], resp["out"]

  def ping(self) -> int:
    """The pid of the child waiting for the next request. The server forks it right after
    answering the previous request and answers this one itself, so it exists when this returns
    (as `Slot.spare_pid` for a sandbox)."""
    self.proc.stdin.write('{"ping": true}\n')
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"fork server exited (rc={self.proc.poll()})")
    return json.loads(line)["spare_pid"]

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=10)
    self.proc.stdout.close()

  def __enter__(self) -> "PreforkedPython":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _pct(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _write_main(d: str) -> None:
  for rel, text in MAIN.items():
    with open(os.path.join(d, rel), "w") as f:
      f.write(text)


def plain_cold(root: str) -> float:
  """A plain interpreter from nothing: a fresh directory, the files, `python3 main.py`."""
  t = time.perf_counter()
  d = tempfile.mkdtemp(dir=root)
  _write_main(d)
  subprocess.run([PYTHON, "main.py"], cwd=d, check=True)
  dt = time.perf_counter() - t
  shutil.rmtree(d)
  return dt


class ColdSandboxes:
  """Sandboxes created from nothing, one at a time, outside any pool (the cold side).

  The in-sandbox programs are copied and compiled once (`slot.prepare_opt`), as a fleet does
  once per host; everything else is in the timing: the spawn helper's start (an interpreter
  importing the zygote), the sandbox's namespaces, mounts and cgroups, the zygote's first command
  process, the files and the command.
  """

  def __init__(self):
    self.features = hostcheck.detect()
    if not self.features.full_isolation:
      raise hostcheck.SandboxUnavailable("; ".join(self.features.problems))
    self.root = tempfile.mkdtemp(prefix=f"envs-fleet-{os.getpid()}-cold-", dir="/tmp")
    os.chmod(self.root, 0o711)
    self.opt_dir = slot_lib.prepare_opt(self.features, self.root)

  def start(self) -> tuple[float, float]:
    """(seconds from nothing to the command's result, seconds of the teardown after it)."""
    t = time.perf_counter()
    spawn = launcher_lib.Launcher(self.features, self.opt_dir, self.root)
    slot = None
    try:
      slot = slot_lib.Slot(self.root, self.features, launcher=spawn)
      slot.wait_ready()
      slot.populate(dict(MAIN))
      r = slot.exec(["python3", "main.py"])
      t1 = time.perf_counter()
      assert r.exit_code == 0 and r.infra_error is None, r
    finally:
      t2 = time.perf_counter()
      if slot is not None:
        slot.cleanup()
      spawn.close()
    return t1 - t, time.perf_counter() - t2

  def close(self) -> None:
    shutil.rmtree(self.root, ignore_errors=True)


def cold_latency(n: int) -> dict[str, list[float]]:
  """Cold sandbox and cold plain interpreter, alternating, n each."""
  out = {"sandbox": [], "teardown": [], "plain": []}
  cold = ColdSandboxes()
  try:
    cold.start()  # Page cache and the first cgroup directories: not part of any timing.
    plain_cold(cold.root)
    for _ in range(n):
      start, teardown = cold.start()
      out["sandbox"].append(start)
      out["teardown"].append(teardown)
      out["plain"].append(plain_cold(cold.root))
  finally:
    cold.close()
  return out


def _warm_sandbox(pool: pool_lib.WarmPool, again: bool, out: dict, prefix: str) -> None:
  t = time.perf_counter()
  with sandbox.Sandbox(MAIN, pool=pool) as sb:
    t1 = time.perf_counter()
    r = sb.exec(["python3", "main.py"])
    t2 = time.perf_counter()
    assert r.exit_code == 0, r
    out[prefix + "total"].append(t2 - t)
    out[prefix + "exec"].append(t2 - t1)
    if again:
      for key, argv in (("again", ["python3", "main.py"]), ("true", ["true"])):
        sb.slot.spare_pid()  # As between an agent's commands: the next command process is ready.
        t3 = time.perf_counter()
        r = sb.exec(argv)
        out[prefix + key].append(time.perf_counter() - t3)
        assert r.exit_code == 0, r


def _warm_plain(server: PreforkedPython, root: str, out: dict) -> None:
  server.ping()  # Its child for the next request is waiting, as a warm sandbox's is.
  t = time.perf_counter()
  d = tempfile.mkdtemp(dir=root)
  _write_main(d)
  code, _ = server.run(d, ["python3", "main.py"])
  out["plain_total"].append(time.perf_counter() - t)
  assert code == 0
  for key, argv in (("again", ["python3", "main.py"]), ("true", ["true"])):
    server.ping()
    t3 = time.perf_counter()
    code, _ = server.run(d, argv)
    out["plain_" + key].append(time.perf_counter() - t3)
    assert code == 0
  shutil.rmtree(d)


def warm_latency(pool_size: int, n: int) -> dict:
  """Warm sandbox, warm degraded sandbox and pre-forked plain interpreter, in turn, n each.

  Before each start every pool is full again, so no refill runs during a timed start.
  """
  keys = ("total", "exec", "again", "true")
  out = {k: [] for p in ("", "degraded_", "plain_") for k in (p + x for x in keys)}
  root = tempfile.mkdtemp(prefix="bench-prefork-")
  with pool_lib.WarmPool(size=pool_size) as pool, \
       pool_lib.WarmPool(size=pool_size, force_degraded=True) as degraded, \
       PreforkedPython() as server:
    isolation = pool.isolation
    for i in range(n + 3):  # The first three warm caches.
      for p in (pool, degraded):
        p.wait_warm()
      _warm_sandbox(pool, True, out, "")
      for p in (pool, degraded):
        p.wait_warm()
      _warm_sandbox(degraded, False, out, "degraded_")
      for p in (pool, degraded):
        p.wait_warm()
      _warm_plain(server, root, out)
      if i < 3:
        for v in out.values():
          v.clear()
  shutil.rmtree(root, ignore_errors=True)
  out["isolation"] = isolation
  return out


def refill_now_latency(pool_size: int, n: int) -> list[float]:
  out = {"total": [], "exec": []}
  with pool_lib.WarmPool(size=pool_size, refill_delay_s=0) as pool:
    for i in range(n + 3):
      pool.wait_warm()
      _warm_sandbox(pool, False, out, "")
      if i < 3:
        out["total"].clear()
  return out["total"]


def _bench_job(host: fleet.Host, payload: tuple[int, float]) -> float:
  i, enqueued = payload
  r = sandbox.run({"main.py": f"print({i})\n"}, ["python3", "main.py"], pool=host.pool)
  assert r.stdout == f"{i}\n", r
  return time.perf_counter() - enqueued


def sandbox_burst(n: int, concurrency: int, pool_size: int, max_live: int) -> dict:
  with fleet.LocalFleet(pool_size=pool_size, concurrency=concurrency, max_live=max_live) as f:
    f.pool.wait_warm()
    t = time.perf_counter()
    results = f.run(fleet.Job(str(i), _bench_job, (i, t)) for i in range(n))
    wall = time.perf_counter() - t
    peak = f.pool.stats["peak_live"]
  lat = [r.value for r in results.values()]
  assert len(lat) == n and all(r.error is None for r in results.values())
  return {"eps": n / wall, "p50": _pct(lat, 50), "p99": _pct(lat, 99), "peak_live": peak}


def plain_burst(n: int, concurrency: int) -> dict:
  """n fresh plain interpreters, each in a fresh directory with its own main.py, `concurrency`
  at a time: the same work per episode as the sandbox burst's, without isolation."""
  root = tempfile.mkdtemp(prefix="bench-plain-")
  t = time.perf_counter()

  def one(i):
    d = tempfile.mkdtemp(dir=root)
    with open(os.path.join(d, "main.py"), "w") as f:
      f.write(f"print({i})\n")
    r = subprocess.run([PYTHON, "main.py"], cwd=d, check=True, capture_output=True, text=True)
    assert r.stdout == f"{i}\n", r
    shutil.rmtree(d)
    return time.perf_counter() - t

  with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
    lat = list(ex.map(one, range(n)))
  wall = time.perf_counter() - t
  shutil.rmtree(root, ignore_errors=True)
  return {"eps": n / wall, "p50": _pct(lat, 50), "p99": _pct(lat, 99)}


def _tree_pss_kb(pid: int) -> int:
  """PSS of a process and its descendants, from /proc (kB)."""
  total, stack = 0, [pid]
  while stack:
    p = stack.pop()
    try:
      with open(f"/proc/{p}/smaps_rollup") as f:
        for line in f:
          if line.startswith("Pss:"):
            total += int(line.split()[1])
      for tid in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{tid}/children") as f:
          stack += [int(c) for c in f.read().split()]
    except OSError:
      pass
  return total


def idle_memory(n: int) -> dict:
  """Mean PSS of an idle sandbox (outer process, zygote, waiting command process) and of an idle fork
  server (server, waiting child), both in MiB."""
  with pool_lib.WarmPool(size=n, max_live=n) as pool:
    pool.wait_warm(timeout_s=120)
    for slot in list(pool._idle):  # pylint: disable=protected-access
      slot.spare_pid()  # Each zygote's command process has been forked (and warmed up).
    pss = [_tree_pss_kb(pid) for pid in pool.idle_pids()]
  with PreforkedPython() as server:
    server.ping()
    plain = _tree_pss_kb(server.proc.pid)
  return {"pss_mib": sum(pss) / len(pss) / 1024, "sandboxes": len(pss),
          "plain_pss_mib": plain / 1024}


def run(*, latency_n: int, cold_n: int, bursts: tuple[int, ...], concurrency: int,
        pool_size: int, max_live: int, idle_n: int, b2b_n: int, b2b_rounds: int,
        profile_n: int, cpu_n: int, namespace_n: int = 0,
        namespace_settle_s: float = 2.0) -> dict:
  out = {"host": {"cpus": os.cpu_count(), "load1": os.getloadavg()[0]},
         "concurrency": concurrency}
  out["profile"] = sustained.start_profile(profile_n)
  if namespace_n:
    out["profile"]["namespace_cost"] = sustained.namespace_cost(namespace_n,
                                                                namespace_settle_s)
  with PreforkedPython() as server:
    b2b = sustained.back_to_back(b2b_n, b2b_rounds, server)
  out["back_to_back"] = b2b
  out["cpu_ms"] = sustained.cpu_per_episode(cpu_n, PreforkedPython)
  out["back_to_back_ms"] = {f"{k}_p{q}": _pct(b2b[k], q) * 1e3
                            for k in ("sandbox", "plain", "prefork") for q in (50, 99)}
  cold = cold_latency(cold_n)
  warm = warm_latency(pool_size, latency_n)
  out["isolation"] = warm.pop("isolation")
  now = refill_now_latency(pool_size, max(1, latency_n // 2))
  ms = lambda xs, q: _pct(xs, q) * 1e3
  out["cold_ms"] = {f"{k}_p{q}": ms(v, q) for k, v in cold.items() for q in (50, 99)}
  lat = {}
  for k, v in warm.items():
    if not v:
      continue  # The degraded side runs no second command.
    name = {"total": "sandbox", "degraded_total": "degraded", "plain_total": "plain"}.get(k, k)
    for q in (50, 99):
      lat[f"{name}_p{q}"] = ms(v, q)
  lat["refill_now_p50"], lat["refill_now_p99"] = ms(now, 50), ms(now, 99)
  out["latency_ms"] = lat
  out["samples"] = {"cold": len(cold["sandbox"]), "warm": len(warm["total"]),
                    "refill_now": len(now)}
  out["bursts"] = {}
  for n in bursts:
    out["bursts"][n] = {"sandbox": sandbox_burst(n, concurrency, pool_size, max_live),
                        "plain": plain_burst(n, concurrency)}
  out["idle"] = idle_memory(idle_n)
  out["host"]["load1_end"] = os.getloadavg()[0]
  return out


def to_markdown(res: dict) -> str:
  """One row per comparison: what each side is, both figures, and sandbox / baseline."""
  c, lat, n = res["cold_ms"], res["latency_ms"], res["samples"]
  plain_cold_cmd = f"plain `{PYTHON} main.py` from nothing (fresh dir + file, subprocess.run)"
  b2b_rows, profile_lines = sustained.markdown(res["back_to_back"], res["profile"],
                                               res.get("cpu_ms"))
  prefork = "pre-forked plain interpreter, no isolation (fork server, `python3 main.py` in-process)"
  x = lambda a, b: f"{a / b:.2f}x"
  rows = [
      ("cold start p50: sandbox from nothing (spawn helper's start + sandbox + files + "
       f"`python3 main.py` result) vs {plain_cold_cmd}; {n['cold']} each", c["sandbox_p50"],
       c["plain_p50"]),
      ("cold start p99, same pair", c["sandbox_p99"], c["plain_p99"]),
      ("warm start p50: sandbox from a warm pool (acquire + files + `python3 main.py` result) "
       f"vs {prefork} (fresh dir + file + run); {n['warm']} each", lat["sandbox_p50"],
       lat["plain_p50"]),
      ("warm start p99, same pair", lat["sandbox_p99"], lat["plain_p99"]),
      ("warm start p50: the same warm pool with isolation off (`force_degraded`: same zygote, "
       f"no namespaces) vs {prefork}", lat["degraded_p50"], lat["plain_p50"]),
      ("warm start p50: sandbox, pool refill started at once (`refill_delay_s=0`; "
       f"{n['refill_now']} starts) vs {prefork} (from the warm rows)", lat["refill_now_p50"],
       lat["plain_p50"]),
      ("next command in the same sandbox, `python3 main.py` p50, vs the same to the fork server",
       lat["again_p50"], lat["plain_again_p50"]),
      ("next command in the same sandbox, `true` (exec) p50, vs the same to the fork server",
       lat["true_p50"], lat["plain_true_p50"]),
  ]
  lines = [
      f"Host: {res['host']['cpus']} CPUs, 1-min load {res['host']['load1']:.1f} at start, "
      f"{res['host'].get('load1_end', float('nan')):.1f} at end. Isolation: {res['isolation']}. "
      "One command at a time on each side unless a row says otherwise.", "",
      "| comparison (sandbox side vs baseline side) | sandbox | baseline | sandbox / baseline |",
      "| --- | --- | --- | --- |"]
  for name, a, b in rows:
    lines.append(f"| {name} | {a:.2f} ms | {b:.2f} ms | {x(a, b)} |")
  lines += b2b_rows
  lines.append(f"| cold sandbox teardown after the result, p50 (kill, reap, remove; the pool "
               f"does it in the background; no plain counterpart: its exit is in its start) | "
               f"{c['teardown_p50']:.2f} ms | | |")
  for n_, b in res["bursts"].items():
    s, p = b["sandbox"], b["plain"]
    conc = res["concurrency"]
    lines.append(f"| burst of {n_}: episodes/s, each a new sandbox (local fleet, {conc} at a "
                 f"time) vs a new plain `python3 main.py` (fresh dir + file, {conc} at a time) | "
                 f"{s['eps']:.0f}/s | {p['eps']:.0f}/s | {s['eps'] / p['eps']:.2f}x |")
    lines.append(f"| burst of {n_}: enqueue-to-result p50, same pair (p99 {s['p99'] * 1e3:.0f}"
                 f" vs {p['p99'] * 1e3:.0f} ms; peak {s['peak_live']} live sandboxes) | "
                 f"{s['p50'] * 1e3:.0f} ms | {p['p50'] * 1e3:.0f} ms | "
                 f"{s['p50'] / p['p50']:.2f}x |")
  idle = res["idle"]
  lines.append(f"| memory, PSS per idle sandbox (outer process + zygote + waiting command process, "
               f"{idle['sandboxes']} idle) vs an idle fork server (server + waiting child) | "
               f"{idle['pss_mib']:.1f} MiB | {idle['plain_pss_mib']:.1f} MiB | "
               f"{x(idle['pss_mib'], idle['plain_pss_mib'])} |")
  return "\n".join(lines + profile_lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small sizes (a few seconds)")
  ap.add_argument("--concurrency", type=int, default=8)
  ap.add_argument("--pool-size", type=int, default=8)
  ap.add_argument("--max-live", type=int, default=24)
  ap.add_argument("--json", help="also write results as JSON here")
  args = ap.parse_args(argv)
  if args.quick:
    res = run(latency_n=10, cold_n=5, bursts=(10,), concurrency=4, pool_size=2, max_live=6,
              idle_n=2, b2b_n=10, b2b_rounds=1, profile_n=5, cpu_n=5, namespace_n=20,
              namespace_settle_s=0.2)
  else:
    res = run(latency_n=200, cold_n=50, bursts=(100, 1000), concurrency=args.concurrency,
              pool_size=args.pool_size, max_live=args.max_live, idle_n=8, b2b_n=30,
              b2b_rounds=10, profile_n=50, cpu_n=200, namespace_n=500)
  print(to_markdown(res))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
