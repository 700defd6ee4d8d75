"""Tests for launch.xm_adapter.

The plan (what XManager is asked to run), the real xm objects built from it, and a small echo
experiment run end to end under the real xm_local executor. xmanager is a test requirement
(requirements-xm.txt, installed by `scripts/bootstrap.sh --test` without pip's dependency
resolution; see launch/README.md). Without it the adapter says how to install it (tested by
hiding the package).
"""

import json
import os
import subprocess
import sys

import pytest

from launch import discovery
from launch import spec
from launch import xm_adapter


def _experiment():
  jobs = [spec.Job("learner", spec.BazelBinary("//pipeline:learner"), args={"steps": 3}),
          spec.Job("sampler_0", spec.PyModule("launch.testdata.echo_server"),
                   env={"X": "1"}),
          spec.Job("tool", spec.Command(("/bin/echo", "hi")), args=["--v"], port=False)]
  return spec.sweep("xmexp", jobs, spec.grid({"learner.lr": [0.1, 0.2]}))


def test_plan_maps_executables_once_and_jobs_per_work_unit(tmp_path):
  p = xm_adapter.plan(_experiment(), str(tmp_path), repo_root="/repo",
                      bazel_args=("--config=x",))
  assert p.packages == (
      xm_adapter.PackagePlan("bazel_binary", "//pipeline:learner", (), ("--config=x",)),
      xm_adapter.PackagePlan("binary", sys.executable, ("-u", "-m", "launch.testdata.echo_server")),
      xm_adapter.PackagePlan("binary", "/bin/echo", ("hi",)))
  assert len(p.work_units) == 2
  learner, sampler, tool = p.work_units[1]
  assert (learner.package, learner.args) == (0, ("--steps=3", "--lr=0.2"))
  assert (sampler.package, sampler.args) == (1, ("-u", "-m", "launch.testdata.echo_server"))
  assert tool.args == ("hi", "--v") and "PYTHONPATH" not in tool.env
  assert sampler.env["X"] == "1" and sampler.env["PYTHONPATH"] == "/repo"
  assert sampler.env[discovery.JOB_NAME] == "sampler_0"
  assert sampler.env[discovery.WORK_UNIT] == "1"
  # The address map the jobs will read is the local executor's format.
  table = discovery.jobs({discovery.JOBS_JSON: p.jobs_files[1]})
  assert set(table) == {"learner", "sampler_0", "tool"} and table["tool"]["port"] is None
  assert discovery.address_of("learner", sampler.env).startswith("127.0.0.1:")
  with open(p.jobs_files[1], encoding="utf-8") as f:
    assert json.load(f)["params"] == {"learner.lr": 0.2}


def test_services_are_refused_naming_the_executors_that_stop_them(tmp_path):
  """rl.gin's shape: samplers and relays serve until the learner and controller end; xm_local
  would never stop them, so the adapter refuses before it writes or reserves anything."""
  jobs = [spec.Job("learner", spec.BazelBinary("//tools:rl_part"), ["learner"], port=False),
          spec.Job("relay_0", spec.BazelBinary("//tools:rl_part"), ["relay"], service=True),
          spec.Job("sampler_0", spec.BazelBinary("//tools:rl_part"), ["sampler"], service=True),
          spec.Job("controller", spec.BazelBinary("//tools:rl_part"), ["controller"])]
  exp = spec.sweep("rl", jobs, [{}])
  exp_dir = tmp_path / "exp"
  with pytest.raises(xm_adapter.XManagerUnsupported,
                     match=r"jobs relay_0, sampler_0 are services.*--executor=local.*"
                           r"--executor=ray"):
    xm_adapter.plan(exp, str(exp_dir))
  assert not exp_dir.exists()
  with pytest.raises(xm_adapter.XManagerUnsupported):
    xm_adapter.launch(exp, str(exp_dir))
  # A SpecError: //tools:launch reports it as `error: ...` (exit status 2), no traceback.
  assert issubclass(xm_adapter.XManagerUnsupported, spec.SpecError)
  # Without the services the same jobs are planned.
  plain = spec.sweep("rl", [j for j in jobs if not j.service], [{}])
  assert [j.name for j in xm_adapter.plan(plain, str(exp_dir)).work_units[0]] == [
      "learner", "controller"]


def test_without_xmanager_the_adapter_says_how_to_install_it(tmp_path, monkeypatch):
  real_import = xm_adapter.importlib.import_module

  def no_xmanager(name, *a, **kw):
    if name.startswith("xmanager"):
      raise ImportError(f"No module named {name!r}")
    return real_import(name, *a, **kw)

  monkeypatch.setattr(xm_adapter.importlib, "import_module", no_xmanager)
  assert not xm_adapter.available()
  with pytest.raises(xm_adapter.XManagerUnavailable, match="pip install xmanager"):
    xm_adapter.to_xm(xm_adapter.plan(_experiment(), str(tmp_path)))
  with pytest.raises(xm_adapter.XManagerUnavailable):
    xm_adapter.launch(_experiment(), str(tmp_path / "x"))


def test_real_xm_objects(tmp_path):
  # A test requirement (requirements-xm.txt): missing, this is a failure, not a skip.
  assert xm_adapter.available(), "xmanager is not importable: run scripts/bootstrap.sh --test"
  from xmanager import xm  # pylint: disable=g-import-not-at-top
  from xmanager import xm_local  # pylint: disable=g-import-not-at-top
  from xmanager.xm_local import executables  # pylint: disable=g-import-not-at-top
  p = xm_adapter.plan(_experiment(), str(tmp_path))
  packageables, groups = xm_adapter.to_xm(p)
  assert all(isinstance(pk, xm.Packageable) for pk in packageables)
  assert [type(pk.executable_spec) for pk in packageables] == [
      xm.BazelBinary, xm.Binary, xm.Binary]
  assert packageables[0].executable_spec.label == "//pipeline:learner"
  assert list(packageables[0].executable_spec.bazel_args) == []
  assert packageables[1].executable_spec.path == sys.executable
  assert packageables[2].executable_spec.path == "/bin/echo"
  assert all(isinstance(pk.executor_spec, xm_local.LocalSpec) for pk in packageables)
  # The executables xm_local's packaging would hand back, one per packageable.
  binaries = [executables.LocalBinary(name=f"e{i}", command=f"/bin/e{i}") for i in range(3)]
  assert len(groups) == 2  # one job group per work unit of the sweep
  group = groups[1](binaries)
  assert isinstance(group, xm.JobGroup) and set(group.jobs) == {"learner", "sampler_0", "tool"}
  learner, sampler, tool = (group.jobs[n] for n in ("learner", "sampler_0", "tool"))
  assert all(isinstance(j, xm.Job) and isinstance(j.executor, xm_local.Local)
             for j in (learner, sampler, tool))
  assert learner.executable is binaries[0] and tool.executable is binaries[2]
  assert learner.args.to_list() == ["--steps=3", "--lr=0.2"]
  assert sampler.args.to_list() == ["-u", "-m", "launch.testdata.echo_server"]
  assert tool.args.to_list() == ["hi", "--v"]
  assert learner.env_vars[discovery.JOB_NAME] == "learner"
  assert sampler.env_vars["X"] == "1" and sampler.env_vars[discovery.WORK_UNIT] == "1"


# Runs under xm_local in a fresh interpreter: xm_local keeps process-wide state (absl flags, an
# atexit hook that stops its jobs) and its experiment database under $HOME/.xmanager.
_LAUNCH = """
import sys
from launch import spec, xm_adapter
jobs = [spec.Job("server", spec.PyModule("launch.testdata.echo_server"), args={"clients": 2}),
        spec.Job("client_0", spec.PyModule("launch.testdata.echo_client"),
                 args={"message": "hello"}),
        spec.Job("client_1", spec.PyModule("launch.testdata.echo_client"),
                 args={"message": "world"}),
        spec.Job("tool", spec.Command(("/bin/echo", "tool ran")), port=False)]
xp = xm_adapter.launch(spec.sweep("xmecho", jobs, [{}]), sys.argv[1])
print("xm experiment", type(xp).__name__, xp.experiment_id, flush=True)
"""


def test_echo_experiment_runs_end_to_end_under_xm_local(tmp_path):
  """xm_local packages the jobs (`xm.binary`: the Python modules and a command), starts them,
  and waits for them; the clients find the server by name through the jobs.json the adapter
  wrote. Not run here: `xm.bazel_binary` packaging (a nested `bazel build` from inside a test;
  checked by hand, launch/README.md) and docker / cloud executors (no docker, no network)."""
  exp_dir = tmp_path / "exp"
  env = dict(os.environ, HOME=str(tmp_path / "home"),
             PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  r = subprocess.run([sys.executable, "-c", _LAUNCH, str(exp_dir)], env=env, cwd=str(tmp_path),
                     capture_output=True, text=True, timeout=240)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-4000:]
  assert "[server] got 'hello'" in out and "[server] got 'world'" in out, out[-4000:]
  assert "client_0 got reply 'echo:hello'" in out and "client_1 got reply 'echo:world'" in out
  assert "[tool] tool ran" in out and "xm experiment LocalExperiment" in out, out[-4000:]
  # xm_local recorded the experiment in its database under the job's $HOME.
  assert (tmp_path / "home" / ".xmanager" / "experiments.sqlite3").exists()
  table = discovery.jobs({discovery.JOBS_JSON: str(exp_dir / "wu0" / "jobs.json")})
  assert set(table) == {"server", "client_0", "client_1", "tool"}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
