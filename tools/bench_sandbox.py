r"""Benchmarks the sandbox fleet against plain `python3 -c pass` subprocesses, in one run.

    .venv/bin/python -m tools.bench_sandbox            # or: bazel run //tools:bench_sandbox
    .venv/bin/python -m tools.bench_sandbox --quick    # small sizes, a few seconds

Reports (as a Markdown table, and JSON with --json):
  * start latency p50/p99: a warm sandbox acquired, the task files written into it and
    `python3 main.py` (main.py = "pass") run to completion, sequentially, with the pool given
    time to refill, against `subprocess.run(["python3", "-c", "pass"])`; also with the pool's
    refill starting at once (refill_delay_s=0), so it competes with the command for the CPU;
  * a second command in a started sandbox: `python3 main.py` (in-process fast path) and `true`
    (exec);
  * bursts of 100 and 1,000 episodes queued at once (each: fresh sandbox, files, run, teardown)
    through the local fleet: episodes/s, latency from enqueue to result p50/p99, peak live
    sandboxes, against the same number of plain subprocesses at the same concurrency;
  * memory per idle sandbox (PSS of the bwrap and zygote processes) and cold start time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

from envs import fleet
from envs import hostcheck
from envs import pool as pool_lib
from envs import sandbox


# The baseline runs the same interpreter the sandboxes run (not a pyenv shim on PATH, which
# would add ~300 ms of bash and flatter the comparison).
PYTHON = hostcheck.SANDBOX_PYTHON


def _pct(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def plain_latency(n: int) -> list[float]:
  out = []
  for _ in range(n):
    t = time.perf_counter()
    subprocess.run([PYTHON, "-c", "pass"], check=True)
    out.append(time.perf_counter() - t)
  return out


def sandbox_latency(pool: pool_lib.WarmPool, n: int, *, again: bool = False
                    ) -> dict[str, list[float]]:
  """Latencies on a warm pool: "total" (start to finished), "exec" (the first command alone);
  with again=True also "again" (a second `python3 main.py`) and "true" (then `true`)."""
  out = {"total": [], "exec": [], "again": [], "true": []}
  for _ in range(n):
    pool.wait_warm()
    t = time.perf_counter()
    with sandbox.Sandbox({"main.py": "pass\n"}, pool=pool) as sb:
      t1 = time.perf_counter()
      r = sb.exec(["python3", "main.py"])
      t2 = time.perf_counter()
      assert r.exit_code == 0, r
      out["total"].append(t2 - t)
      out["exec"].append(t2 - t1)
      if again:
        for key, argv in (("again", ["python3", "main.py"]), ("true", ["true"])):
          time.sleep(0.005)  # As between an agent's commands: the next command process is ready.
          t3 = time.perf_counter()
          r = sb.exec(argv)
          out[key].append(time.perf_counter() - t3)
          assert r.exit_code == 0, r
  return out


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
  t = time.perf_counter()

  def one(_):
    subprocess.run([PYTHON, "-c", "pass"], check=True)
    return time.perf_counter() - t

  with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
    lat = list(ex.map(one, range(n)))
  wall = time.perf_counter() - t
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
  with pool_lib.WarmPool(size=n, max_live=n) as pool:
    t = time.perf_counter()
    pool.wait_warm(timeout_s=120)
    warm_s = time.perf_counter() - t
    time.sleep(0.2)
    pss = [_tree_pss_kb(pid) for pid in pool.idle_pids()]
  return {"pss_mib": sum(pss) / len(pss) / 1024, "sandboxes": len(pss),
          "cold_start_ms": warm_s / n * 1000}


def run(*, latency_n: int, bursts: tuple[int, ...], concurrency: int, pool_size: int,
        max_live: int, idle_n: int) -> dict:
  out = {"host": {"cpus": os.cpu_count(), "load1": os.getloadavg()[0]}}
  plain = plain_latency(latency_n)
  with pool_lib.WarmPool(size=pool_size) as pool:
    out["isolation"] = pool.isolation
    sandbox_latency(pool, 3)  # Warm caches.
    lat = sandbox_latency(pool, latency_n, again=True)
  with pool_lib.WarmPool(size=pool_size, refill_delay_s=0) as pool:
    sandbox_latency(pool, 3)
    now = sandbox_latency(pool, max(1, latency_n // 2))["total"]
  ms = lambda xs, q: _pct(xs, q) * 1e3
  out["latency_ms"] = {
      "plain_p50": ms(plain, 50), "plain_p99": ms(plain, 99),
      "sandbox_p50": ms(lat["total"], 50), "sandbox_p99": ms(lat["total"], 99),
      "exec_p50": ms(lat["exec"], 50), "exec_p99": ms(lat["exec"], 99),
      "again_p50": ms(lat["again"], 50), "again_p99": ms(lat["again"], 99),
      "true_p50": ms(lat["true"], 50), "true_p99": ms(lat["true"], 99),
      "refill_now_p50": ms(now, 50), "refill_now_p99": ms(now, 99)}
  out["bursts"] = {}
  for n in bursts:
    out["bursts"][n] = {"sandbox": sandbox_burst(n, concurrency, pool_size, max_live),
                        "plain": plain_burst(n, concurrency)}
  out["idle"] = idle_memory(idle_n)
  return out


def to_markdown(res: dict) -> str:
  lat = res["latency_ms"]
  lines = [
      f"Host: {res['host']['cpus']} CPUs, 1-min load {res['host']['load1']:.1f} at start. "
      f"Isolation: {res['isolation']}.", "",
      f"| measure | sandbox fleet | plain `{PYTHON} -c pass` | ratio (plain / sandbox) |",
      "| --- | --- | --- | --- |",
      f"| start latency p50 (acquire + files + `python3 main.py` done) | "
      f"{lat['sandbox_p50']:.2f} ms | {lat['plain_p50']:.2f} ms | "
      f"{lat['plain_p50'] / lat['sandbox_p50']:.1f}x |",
      f"| start latency p99 | {lat['sandbox_p99']:.2f} ms | {lat['plain_p99']:.2f} ms | "
      f"{lat['plain_p99'] / lat['sandbox_p99']:.1f}x |",
      f"| start latency p50 / p99, pool refill started at once (refill_delay_s=0) | "
      f"{lat['refill_now_p50']:.2f} / {lat['refill_now_p99']:.2f} ms | | |",
      f"| first command alone (`python3 main.py`) p50 / p99 | {lat['exec_p50']:.2f} / "
      f"{lat['exec_p99']:.2f} ms | | |",
      f"| next command, `python3 main.py` / `true`, p50 | {lat['again_p50']:.2f} / "
      f"{lat['true_p50']:.2f} ms | | |"]
  for n, b in res["bursts"].items():
    s, p = b["sandbox"], b["plain"]
    lines.append(f"| burst of {n}: episodes/s | {s['eps']:.0f} | {p['eps']:.0f} | "
                 f"{p['eps'] / s['eps']:.2f}x |")
    lines.append(f"| burst of {n}: enqueue-to-result p50 / p99 | {s['p50'] * 1e3:.0f} / "
                 f"{s['p99'] * 1e3:.0f} ms (peak {s['peak_live']} live sandboxes) | "
                 f"{p['p50'] * 1e3:.0f} / {p['p99'] * 1e3:.0f} ms | |")
  idle = res["idle"]
  lines.append(f"| memory per idle sandbox (PSS, {idle['sandboxes']} idle) | "
               f"{idle['pss_mib']:.1f} MiB | | |")
  lines.append(f"| cold start (spawn to ready, amortised over {idle['sandboxes']}) | "
               f"{idle['cold_start_ms']:.0f} ms | | |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small sizes (a few seconds)")
  ap.add_argument("--concurrency", type=int, default=8)
  ap.add_argument("--pool-size", type=int, default=8)
  ap.add_argument("--max-live", type=int, default=24)
  ap.add_argument("--json", help="also write results as JSON here")
  args = ap.parse_args(argv)
  if args.quick:
    res = run(latency_n=10, bursts=(10,), concurrency=4, pool_size=2, max_live=6, idle_n=2)
  else:
    res = run(latency_n=200, bursts=(100, 1000), concurrency=args.concurrency,
              pool_size=args.pool_size, max_live=args.max_live, idle_n=8)
  print(to_markdown(res))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
