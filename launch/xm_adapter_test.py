"""Tests for launch.xm_adapter.

The plan (what XManager is asked to run) is tested everywhere. With xmanager importable the real
xm objects built from it are checked too; without it, the adapter must say how to install it.
xmanager is not a requirement, not even for tests (it needs protobuf<7, and pip's resolution of
its Google Cloud dependencies takes tens of minutes; see launch/README.md), so CI and `bazel test`
run the error branch only, and the real one runs only by hand:
`PYTHONPATH=. <venv with xmanager>/bin/python -m pytest launch/xm_adapter_test.py`.
"""

import json
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


def test_real_xm_objects_or_clear_error(tmp_path):
  p = xm_adapter.plan(_experiment(), str(tmp_path))
  if not xm_adapter.available():
    with pytest.raises(xm_adapter.XManagerUnavailable, match="pip install xmanager"):
      xm_adapter.to_xm(p)
    with pytest.raises(xm_adapter.XManagerUnavailable):
      xm_adapter.launch(_experiment(), str(tmp_path / "x"))
    return
  from xmanager import xm  # pylint: disable=g-import-not-at-top
  from xmanager import xm_local  # pylint: disable=g-import-not-at-top
  packageables, groups = xm_adapter.to_xm(p)
  assert [type(pk.executable_spec).__name__ for pk in packageables] == [
      "BazelBinary", "Binary", "Binary"]
  assert packageables[0].executable_spec.label == "//pipeline:learner"
  assert list(packageables[0].executable_spec.bazel_args) == []
  assert packageables[2].executable_spec.path == "/bin/echo"
  assert all(isinstance(pk.executor_spec, xm_local.LocalSpec) for pk in packageables)
  executables = [xm_local.LocalBinary(name=f"e{i}", command=f"/bin/e{i}", args=xm.SequentialArgs())
                 for i in range(3)] if hasattr(xm_local, "LocalBinary") else ["e0", "e1", "e2"]
  group = groups[1](executables)
  assert isinstance(group, xm.JobGroup) and set(group.jobs) == {"learner", "sampler_0", "tool"}
  learner = group.jobs["learner"]
  assert isinstance(learner.executor, xm_local.Local)
  assert learner.executable is executables[0]
  assert learner.args.to_list() == ["--steps=3", "--lr=0.2"]
  assert learner.env_vars[discovery.JOB_NAME] == "learner"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
