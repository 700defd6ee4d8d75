"""Tests for //tools:launch (tools/launcher.py): gin experiment files, sweeps, bad flags.

Runs without Bazel (--use_bazel=False resolves //pkg:name to `python -m pkg.name`, see
launch.targets); the executor itself is tested in launch/local_test.py.
"""

import glob
import json
import os
import sys

import pytest

from tools import launcher as launch_tool

ECHO = "--experiment=launch/testdata/echo.gin"


def test_echo_experiment_runs_from_gin(tmp_path, capsys):
  rc = launch_tool.main([ECHO, "--use_bazel=False", f"--root_dir={tmp_path}", "--grace_s=1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "[0/client_0] client_0 got reply 'echo:hello'" in out
  assert "[0/client_1] client_1 got reply 'echo:world'" in out
  (exp_dir,) = glob.glob(str(tmp_path / "echo-*"))
  with open(os.path.join(exp_dir, "status.json"), encoding="utf-8") as f:
    jobs = json.load(f)["work_units"][0]["jobs"]
  assert {n: j["state"] for n, j in jobs.items()} == {
      "server": "succeeded", "client_0": "succeeded", "client_1": "succeeded"}


def test_sweep_binding_makes_one_work_unit_per_point(capsys):
  rc = launch_tool.main([ECHO, "--dry_run=True",
                         '--gin.experiment.sweep={"client_0.message": ["a", "b"], '
                         '"server.clients": [2, 3]}'])
  out = capsys.readouterr().out
  assert rc == 0
  assert "4 work unit(s)" in out
  assert "work unit 3 {'client_0.message': 'b', 'server.clients': 3}" in out
  assert "  client_0: //launch/testdata:echo_client --message=b" in out
  assert out.count("server: //launch/testdata:echo_server --clients=3") == 2


def test_failing_sweep_point_exit_code(tmp_path, capsys):
  # client_0 expects another prefix in unit 1 only: that unit fails, the launcher says so.
  rc = launch_tool.main([ECHO, "--use_bazel=False", f"--root_dir={tmp_path}", "--grace_s=1",
                         "--on_failure=continue",
                         '--gin.experiment.points=[{}, {"client_0.expect_prefix": "nope"}]'])
  out = capsys.readouterr().out
  assert rc == 1
  assert "[launch] [1/client_0] failed (exit code 1)" in out


@pytest.mark.parametrize("argv, message", [
    ([ECHO, "--bogus=1"], "unknown flag --bogus"),
    (["--use_bazel=False"], "give an experiment gin file"),
    (["--experiment=nope/missing.gin"], "gin file not found"),
    ([ECHO, "--gin.experiment.nonexistent=3"], "bad gin config"),
    ([ECHO, "--dry_run=True", "--gin.server/job.target='pipeline:learner'"],
     "not an absolute Bazel label"),
    ([ECHO, "--executor=k8s"], "executor must be"),
])
def test_bad_configs_fail_before_anything_starts(argv, message, capsys):
  assert launch_tool.main(argv) == 2
  assert message in capsys.readouterr().err


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
