"""Tests for launch.spec: validation, arg rendering, sweeps."""

import sys

import pytest

from launch import spec


def test_labels():
  assert spec.parse_label("//pipeline:learner") == ("pipeline", "learner")
  assert spec.parse_label("//launch/testdata:echo_server") == ("launch/testdata", "echo_server")
  assert spec.parse_label("//tools") == ("tools", "tools")
  for bad in ("pipeline:learner", "//pipeline/...", "//pkg:all", "//", "", ":x", "//a:b:c"):
    with pytest.raises(spec.SpecError):
      spec.parse_label(bad)


def test_render_args():
  assert spec.render_args({"lr": 0.1, "flag": True, "off": False, "xs": [1, 2],
                           "gin.Trainer.steps": 5}) == [
                               "--lr=0.1", "--flag=true", "--off=false", "--xs=1,2",
                               "--gin.Trainer.steps=5"]
  assert spec.render_args(["a", "--b"]) == ["a", "--b"]
  with pytest.raises(spec.SpecError):
    spec.render_args("--lr=1")
  with pytest.raises(spec.SpecError):
    spec.render_args([1])


def test_job_and_work_unit_validation():
  exe = spec.PyModule("launch.testdata.echo_server")
  with pytest.raises(spec.SpecError, match="job name"):
    spec.Job("bad name", exe)
  with pytest.raises(spec.SpecError, match="executable"):
    spec.Job("x", "//pipeline:learner")
  with pytest.raises(spec.SpecError, match="env"):
    spec.Job("x", exe, env={"A": 1})
  with pytest.raises(spec.SpecError, match="unique"):
    spec.WorkUnit(jobs=(spec.Job("a", exe), spec.Job("a", exe)))
  with pytest.raises(spec.SpecError):
    spec.WorkUnit(jobs=())
  with pytest.raises(spec.SpecError):
    spec.PyModule("not a module")
  with pytest.raises(spec.SpecError):
    spec.Command(())
  with pytest.raises(spec.SpecError):
    spec.Experiment("bad/name", (spec.WorkUnit(jobs=(spec.Job("a", exe),)),))


def test_resources_are_a_placement_bundle_and_checked():
  res = spec.Resources(num_cpus=2, num_gpus=0.5, memory=1 << 30, custom={"sampler_host": 1})
  assert res.bundle() == {"CPU": 2, "GPU": 0.5, "memory": 1 << 30, "sampler_host": 1}
  assert spec.Resources(num_cpus=0, custom={"TPU": 4}).bundle() == {"TPU": 4}
  with pytest.raises(spec.SpecError, match="cannot be empty"):
    spec.Resources(num_cpus=0)
  with pytest.raises(spec.SpecError, match=">= 0"):
    spec.Resources(num_gpus=-1)
  with pytest.raises(spec.SpecError, match="max_restarts"):
    spec.Job("x", spec.PyModule("a.b"), max_restarts=-1)
  with pytest.raises(spec.SpecError, match="Resources"):
    spec.Job("x", spec.PyModule("a.b"), resources={"CPU": 1})


def test_grid_and_sweep_2x2():
  points = spec.grid({"learner.lr": [1e-4, 3e-4], "seed": [0, 1]})
  assert points == [{"learner.lr": 1e-4, "seed": 0}, {"learner.lr": 1e-4, "seed": 1},
                    {"learner.lr": 3e-4, "seed": 0}, {"learner.lr": 3e-4, "seed": 1}]
  jobs = [spec.Job("learner", spec.BazelBinary("//pipeline:learner"), args={"steps": 10}),
          spec.Job("sampler_0", spec.BazelBinary("//pipeline:sampler"), args=["--fast"])]
  exp = spec.sweep("s", jobs, points)
  assert len(exp.work_units) == 4
  assert exp.bazel_labels == ["//pipeline:learner", "//pipeline:sampler"]
  wu = exp.work_units[3]
  assert wu.params == {"learner.lr": 3e-4, "seed": 1}
  assert wu.job("learner").argv_args == ["--steps=10", "--seed=1", "--lr=0.0003"]
  assert wu.job("sampler_0").argv_args == ["--fast", "--seed=1"]  # learner.lr is learner-only
  assert [w.job("learner").args["lr"] for w in exp.work_units] == [1e-4, 1e-4, 3e-4, 3e-4]
  assert jobs[0].args == {"steps": 10}  # the template is not modified
  with pytest.raises(spec.SpecError):
    spec.grid({"lr": []})
  with pytest.raises(KeyError):
    wu.job("nope")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
