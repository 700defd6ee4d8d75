"""Tests for the sandbox benchmark: the warm baseline (a pre-forked plain interpreter) runs each
command in a fresh child forked ahead of demand, and --quick reports every cold-vs-cold and
warm-vs-warm row from the samples it measured."""

import json
import os
import re
import sys

import pytest

from tools import bench_sandbox


def _ppid(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def test_fork_server_runs_each_command_in_its_spare_child(tmp_path):
  (tmp_path / "main.py").write_text(
      "import os, sys\n"
      "print(os.getpid(), os.getcwd(), globals().get('seen'))\n"
      "seen = 1\n"
      "sys.exit(3)\n")
  with bench_sandbox.PreforkedPython() as server:
    pids = set()
    for _ in range(2):
      spare = server.ping()
      assert _ppid(spare) == server.proc.pid  # Forked ahead, by the server, before the request.
      code, out = server.run(str(tmp_path), ["python3", "main.py"])
      pid, cwd, seen = out.split()
      # The script ran in that very child (no interpreter start), in the requested directory,
      # and nothing it set survives into the next command's child.
      assert code == 3 and int(pid) == spare and cwd == str(tmp_path) and seen == "None"
      pids.add(spare)
    assert len(pids) == 2 and server.proc.pid not in pids
    # Anything but `python3 FILE` is exec'ed, with the exit status passed through.
    assert server.run(str(tmp_path), ["sh", "-c", "pwd; exit 5"]) == (5, f"{tmp_path}\n")
    (tmp_path / "main.py").write_text("raise ValueError('boom')\n")
    code, out = server.run(str(tmp_path), ["python3", "main.py"])
    assert code == 1 and "ValueError: boom" in out


def test_quick_run_reports_like_for_like_rows_from_its_samples(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert bench_sandbox.main(["--quick", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  res = json.loads(out.read_text())
  assert res["samples"] == {"cold": 5, "warm": 10, "refill_now": 5}
  cold, warm = res["cold_ms"], res["latency_ms"]
  # Every side measured; p99 of the same samples is never below their p50.
  for d, sides in ((cold, ("sandbox", "plain", "teardown")),
                   (warm, ("sandbox", "plain", "degraded", "again", "plain_again", "true",
                           "plain_true", "refill_now"))):
    for side in sides:
      assert 0 < d[f"{side}_p50"] <= d[f"{side}_p99"], (side, d)
  # A cold sandbox starts the spawn helper (a whole interpreter) and a sandbox; a warm one is a
  # queue pop and a pipe write. A benchmark that mixed the two up would fail this.
  assert cold["sandbox_p50"] > warm["sandbox_p50"]
  rows = {}
  for line in text.splitlines():
    m = re.match(r"\| (.+?) \| ([\d.]+) ms \| ([\d.]+) ms \| ([\d.]+)x \|$", line)
    if m:
      rows[m.group(1)] = tuple(float(g) for g in m.group(2, 3, 4))
  by_start = lambda prefix: next(v for k, v in rows.items() if k.startswith(prefix))
  for prefix, a, b in (("cold start p50", cold["sandbox_p50"], cold["plain_p50"]),
                       ("cold start p99", cold["sandbox_p99"], cold["plain_p99"]),
                       ("warm start p50: sandbox from a warm pool", warm["sandbox_p50"],
                        warm["plain_p50"]),
                       ("warm start p50: the same warm pool with isolation off",
                        warm["degraded_p50"], warm["plain_p50"])):
    sb, base, ratio = by_start(prefix)
    assert (sb, base) == (round(a, 2), round(b, 2)), prefix
    assert ratio == pytest.approx(a / b, abs=0.006), prefix
  # Each row names both of its sides.
  cold_row = next(k for k in rows if k.startswith("cold start p50"))
  assert "sandbox from nothing" in cold_row and "plain" in cold_row
  warm_row = next(k for k in rows if k.startswith("warm start p50: sandbox from a warm pool"))
  assert "pre-forked plain interpreter, no isolation" in warm_row
  assert "burst of 10: episodes/s" in text and "idle fork server" in text
  assert res["idle"]["pss_mib"] > 0 and res["idle"]["plain_pss_mib"] > 0
  assert res["bursts"]["10"]["sandbox"]["eps"] > 0 and res["bursts"]["10"]["plain"]["eps"] > 0
  # Back to back: every side measured, the rows show the same figures.
  b2b = res["back_to_back_ms"]
  assert len(res["back_to_back"]["sandbox"]) == len(res["back_to_back"]["plain"]) == 10
  for q in (50, 99):
    sb, base, ratio = by_start(f"back to back p{q}: `sandbox.run")
    assert (sb, base) == (round(b2b[f"sandbox_p{q}"], 2), round(b2b[f"plain_p{q}"], 2))
    assert by_start(f"back to back p{q}, same sandbox calls vs the pre-forked")[1] == round(
        b2b[f"prefork_p{q}"], 2)
  # The start profile: every phase stamped (the end-to-end start is the longest), CPU > 0, and
  # the previous design's interpreter start measured beside it.
  phases = dict(res["profile"]["phases_ms"])
  assert all(v >= 0 for v in phases.values()), phases
  end_to_end = next(v for k, v in phases.items() if k.startswith("start, end to end"))
  assert end_to_end == max(phases.values())
  assert all(v > 0 for v in res["profile"]["cpu_ms"].values())
  assert any("interpreter" in k for k in res["profile"]["old_ms"])
  # Page faults of each forked process of a start: counted (a fork writes to some of its
  # pages before it is ready), and printed as counts.
  faults = res["profile"]["faults"]
  assert len(faults) == 3 and all(v > 0 for v in faults.values()), faults
  for k, v in faults.items():
    assert f"| page faults (p50 count, not ms): {k} | {v:.0f} |" in text
  assert "Start profile (5 sandboxes" in text
  # What a network namespace costs the host (kernel workers included), per process, beside a
  # user namespace alone; both runs measured, the row shows their difference.
  ns = res["profile"]["namespace_cost"]
  assert ns["n"] == 20 and all(isinstance(ns[k], float) for k in ("user", "user_net")), ns
  row = re.search(r"\| host CPU ms .*less one that unshares the user namespace alone \(20 "
                  r"each.*\| (-?[\d.]+) \|", text)
  assert row and float(row.group(1)) == round(ns["user_net"] - ns["user"], 2), text


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
