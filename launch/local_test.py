"""Tests for the local executor: real processes talking over 127.0.0.1 by job name.

Covers logs (per-job files and prefixed streaming), status and exit codes, the failure policy
(a failing job stops its work unit), SIGINT stopping every process group with no process left,
a 2x2 sweep running 4 work units with the right args, and services (a server that runs until
stopped) stopped, as succeeded, once the other jobs of their work unit ended.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import discovery
from launch import local
from launch import spec
from launch import targets
from testlib import waiting

SERVER = spec.PyModule("launch.testdata.echo_server")
CLIENT = spec.PyModule("launch.testdata.echo_client")


def _executor(tmp_path, **kw):
  kw.setdefault("out", io.StringIO())
  return local.LocalExecutor(str(tmp_path), use_bazel=False, grace_s=1.0, **kw)


def _pids_in(pid_file, n: int, run: local.ExperimentRun) -> list[int]:
  """The pids the sleepers wrote to `pid_file`, once there are `n` of them (else stops `run`)."""
  def read():
    pids = pid_file.read_text().split() if pid_file.exists() else []
    return len(pids) >= n and [int(p) for p in pids]
  try:
    return waiting.wait_until(read, f"{n} pids in {pid_file}")
  except TimeoutError:
    run.stop(reason="test failed")
    raise


def _wait_or_stop(run: local.ExperimentRun) -> None:
  """Waits for `run` to end; if it does not in time, stops its jobs and fails."""
  if not run.wait(timeout=waiting.DEFAULT_TIMEOUT_S):
    summary = run.summary()
    run.stop(reason="test failed")
    raise TimeoutError(f"the experiment did not end in {waiting.DEFAULT_TIMEOUT_S:g}s:\n"
                       f"{summary}")


def test_work_unit_jobs_find_each_other_by_name(tmp_path):
  jobs = [spec.Job("server", SERVER, args={"clients": 2}),
          spec.Job("client_0", CLIENT, args={"message": "hi"}),
          # The label form, resolved to `python -m launch.testdata.echo_client` without Bazel.
          spec.Job("client_1", spec.BazelBinary("//launch/testdata:echo_client"),
                   args=["--message=yo"], env={"EXTRA": "1"})]
  ex = _executor(tmp_path)
  run = ex.run(spec.sweep("echo", jobs))
  assert run.succeeded(), run.summary()
  st = run.statuses[0]
  assert {n: (s.state, s.returncode) for n, s in st.items()} == {
      "server": ("succeeded", 0), "client_0": ("succeeded", 0), "client_1": ("succeeded", 0)}
  assert st["client_1"].argv[-3:] == ["-m", "launch.testdata.echo_client", "--message=yo"]
  with open(st["client_0"].log_path, encoding="utf-8") as f:
    assert "client_0 got reply 'echo:hi'" in f.read()
  with open(st["server"].log_path, encoding="utf-8") as f:
    log = f.read()
  assert "got 'hi'" in log and "got 'yo'" in log and "server done" in log
  out = ex.out.getvalue()
  assert "[0/client_1] client_1 got reply 'echo:yo'" in out
  assert "[launch] [0/server] succeeded (exit code 0)" in out
  # Status and the address map are on disk.
  with open(os.path.join(run.dir, "status.json"), encoding="utf-8") as f:
    status = json.load(f)
  assert status["work_units"][0]["jobs"]["server"]["state"] == "succeeded"
  jobs_map = discovery.jobs({discovery.JOBS_JSON: os.path.join(run.dir, "wu0", "jobs.json")})
  assert jobs_map["server"] == {"host": "127.0.0.1", "port": st["server"].port}
  assert "client_1" in run.summary() and "succeeded" in run.summary()


def test_failing_job_stops_its_work_unit(tmp_path):
  jobs = [spec.Job("server", SERVER, args={"clients": 5}),  # would wait forever for clients
          spec.Job("bad", spec.PyModule("launch.testdata.fail_job"), args={"code": 7,
                                                                           "delay": 0.2})]
  ex = _executor(tmp_path)
  run = ex.launch(spec.sweep("fail", jobs))
  # Without the failure policy the server would wait for its clients forever.
  _wait_or_stop(run)
  st = run.statuses[0]
  assert (st["bad"].state, st["bad"].returncode) == ("failed", 7)
  assert st["server"].state == "stopped" and st["server"].returncode == -signal.SIGTERM
  assert not run.succeeded()
  with open(st["bad"].log_path, encoding="utf-8") as f:
    assert "error: giving up" in f.read()  # stderr goes to the same log
  assert "stopping 1 job(s): 0/bad failed" in ex.out.getvalue()
  waiting.wait_exited(run.pids())


def test_failure_policy_continue_and_stop_experiment(tmp_path):
  jobs = [spec.Job("bad", spec.PyModule("launch.testdata.fail_job"), args={"code": 1}),
          spec.Job("ok", spec.PyModule("launch.testdata.fail_job"), args={"code": 0,
                                                                          "delay": 0.5})]
  run = _executor(tmp_path, on_failure="continue").run(spec.sweep("cont", jobs))
  assert [run.statuses[0][n].state for n in ("bad", "ok")] == ["failed", "succeeded"]
  # stop_experiment: the first unit's failure stops the second unit's sleeper too.
  sleeper = spec.Job("ok", spec.PyModule("launch.testdata.sleeper"),
                     args=[f"--pid_file={tmp_path / 'pids'}"], port=False)
  exp = spec.Experiment("stopall", (spec.WorkUnit((jobs[0],)), spec.WorkUnit((sleeper,))))
  ex = _executor(tmp_path, on_failure="stop_experiment")
  run = ex.launch(exp)
  _pids_in(tmp_path / "pids", 2, run)  # the sleeper is up
  _wait_or_stop(run)
  assert run.statuses[0]["bad"].state == "failed"
  assert run.statuses[1]["ok"].state == "stopped"
  with pytest.raises(spec.SpecError):
    _executor(tmp_path, on_failure="ignore")


def test_sigterm_ignored_escalates_to_sigkill(tmp_path):
  pid_file = tmp_path / "pids"
  job = spec.Job("stubborn", spec.PyModule("launch.testdata.sleeper"),
                 args=[f"--pid_file={pid_file}", "--ignore_term"], port=False)
  ex = _executor(tmp_path)
  run = ex.launch(spec.sweep("kill", [job]))
  pids = _pids_in(pid_file, 2, run)
  t0 = time.monotonic()
  run.stop(reason="test")
  # It waited the grace period (1 s) for the SIGTERM it ignored, then sent SIGKILL. No upper
  # bound on the time: the exit status and the message show the escalation happened.
  assert time.monotonic() - t0 >= 1.0
  assert run.statuses[0]["stubborn"].returncode == -signal.SIGKILL
  assert "[0/stubborn] did not exit in 1.0s: SIGKILL" in ex.out.getvalue()
  waiting.wait_exited(pids)  # its child too: SIGKILL went to the whole process group


def test_sigint_stops_every_process_group(tmp_path):
  """Ctrl-C on the launcher process: all jobs and their children end, none is left behind."""
  pid_file = tmp_path / "pids"
  proc = subprocess.Popen(
      [sys.executable, "-m", "launch.testdata.run_experiment", str(tmp_path / "exp"),
       str(pid_file), "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=targets.python_env(targets.workspace_root()), cwd=targets.workspace_root())
  line = proc.stdout.readline().strip()
  if line != "launched":  # stop what did start before failing
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=waiting.DEFAULT_TIMEOUT_S)
  assert line == "launched", line
  pids = [int(p) for p in pid_file.read_text().split()]
  # 2 units x 2 jobs x (job + child)
  assert len(pids) == 8 and all(waiting.pid_alive(p) for p in pids)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=waiting.DEFAULT_TIMEOUT_S)
  assert proc.returncode == 130, out
  assert out.count("stopped") == 4, out
  waiting.wait_exited(pids)


def test_sweep_2x2_runs_four_work_units_with_their_args(tmp_path):
  jobs = [spec.Job("server", SERVER, args={"clients": 1, "prefix": "p"}),
          spec.Job("client", CLIENT, args={"message": "m", "expect_prefix": "p"})]
  points = spec.grid({"server.prefix": ["a", "b"], "client.message": ["x", "y"]})
  exp = spec.sweep("grid", [jobs[0], jobs[1]], points)
  # The client must expect the prefix of its own unit's server.
  exp = spec.Experiment(exp.name, tuple(
      spec.WorkUnit(tuple(j.with_overrides({"expect_prefix": wu.params["server.prefix"]})
                          if j.name == "client" else j for j in wu.jobs), wu.params)
      for wu in exp.work_units))
  ex = _executor(tmp_path, max_parallel=2)
  run = ex.run(exp)
  assert run.succeeded(), run.summary()
  assert len(run.statuses) == 4
  replies = []
  for i in range(4):
    with open(run.statuses[i]["client"].log_path, encoding="utf-8") as f:
      replies.append(f.read().split("got reply ")[1].strip())
  assert replies == ["'a:x'", "'a:y'", "'b:x'", "'b:y'"]
  with open(os.path.join(run.dir, "experiment.json"), encoding="utf-8") as f:
    doc = json.load(f)
  assert doc["work_units"][2]["params"] == {"server.prefix": "b", "client.message": "x"}
  assert doc["work_units"][2]["jobs"]["server"]["argv"][-2:] == ["--clients=1", "--prefix=b"]
  ports = {run.statuses[i]["server"].port for i in range(4)}
  assert len(ports) >= 2  # units running at the same time never share a port


def test_missing_program_and_missing_module(tmp_path):
  bad = spec.Job("ghost", spec.Command(("/nonexistent/program",)), port=False)
  run = _executor(tmp_path).run(spec.sweep("ghost", [bad]))
  assert run.statuses[0]["ghost"].state == "failed"
  with pytest.raises(targets.TargetError, match="does not exist"):
    _executor(tmp_path).launch(spec.sweep("x", [spec.Job("a", spec.BazelBinary("//nope:gone"))]))


def test_services_stop_when_the_other_jobs_ended(tmp_path):
  jobs = [spec.Job("server", SERVER, args={"clients": 10**6}, service=True),
          spec.Job("client_0", CLIENT, args={"message": "hi"})]
  run = _executor(tmp_path).launch(spec.Experiment("svc", (spec.WorkUnit(tuple(jobs)),)))
  _wait_or_stop(run)
  assert run.succeeded(), run.summary()
  st = run.statuses[0]["server"]
  assert st.state == local.SUCCEEDED and st.returncode == -signal.SIGTERM
  assert not waiting.pid_alive(st.pid)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
