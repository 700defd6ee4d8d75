"""The multi-process learner (`//tools:rl_part -- learner`) and the in-process one (the main job's
RL phase) are built with identical settings from one gin config.

Both real paths run: `rl_part.main` through pipeline.processes.run_learner, and what
`//tools:main` does (its flag parsing, configs.load_experiment, experiment.run.make_rl_learner).
The test captures what each hands to rl.learner.build_learner and the learner that came back, and
overrides every kind of setting away from its default, so a path that drops or re-derives one
(the old run_learner trained with aux_loss on and default clipping) fails.
"""

import sys

import numpy as np
import pytest

from experiment import run as run_lib
from moe import build
from moe import sharding
from rl import learner as learner_lib
from tools import configs
from tools import main as main_lib
from tools import rl_part

FLAGS = ["--gin_file=tools/configs/experiments/default.gin",
         "--gin.OptimizerConfig.learning_rate=3e-4", "--gin.OptimizerConfig.warmup_steps=3",
         "--gin.LossConfig.replay='proximal'", "--gin.PolicyLossConfig.clip_eps_high=0.28",
         "--gin.PolicyLossConfig.kl_coef=0.01", "--gin.LearnerConfig.micro_batches=2",
         "--gin.PipelineConfig.max_staleness=3", "--gin.ExperimentConfig.seed=5"]


@pytest.fixture
def built(monkeypatch):
  """Every build_learner call: (config, model config, keyword arguments, the learner)."""
  calls = []
  real = learner_lib.build_learner

  def capture(config, model_cfg, **kw):
    learner = real(config, model_cfg, **kw)
    calls.append((config, model_cfg, kw, learner))
    return learner

  monkeypatch.setattr(learner_lib, "build_learner", capture)
  return calls


def test_in_process_and_multi_process_learners_get_identical_settings(tmp_path, built):
  assert rl_part.main(["learner", f"--workdir={tmp_path}", "--steps=0", *FLAGS]) == 0
  _, files, bindings = main_lib.parse_args(FLAGS)
  cfg = configs.load_experiment(files, bindings)
  run_lib.make_rl_learner(cfg, build.create(cfg.model, seed=cfg.seed),
                          sharding.make_mesh(cfg.mesh_shape))
  assert len(built) == 2
  (multi_cfg, multi_model, multi_kw, multi), (in_cfg, in_model, in_kw, inproc) = built
  assert multi_cfg == in_cfg == cfg.rl.learner and multi_model == in_model == cfg.model
  for key in ("seed", "max_staleness"):
    assert multi_kw[key] == in_kw[key]
  for attr in ("opt_cfg", "loss_cfg", "micro_batches", "minibatches", "sampler_dtype"):
    assert getattr(multi, attr) == getattr(inproc, attr), attr
  # ... and they are the flags' values, not defaults.
  loss, opt = multi.loss_cfg, multi.opt_cfg
  assert (opt.learning_rate, opt.warmup_steps) == (3e-4, 3)
  assert (loss.objective, loss.aux_loss, loss.replay, loss.max_staleness) == (
      "policy", False, "proximal", 3)
  assert (loss.policy.clip_eps_low, loss.policy.clip_eps_high, loss.policy.kl_coef) == (
      0.2, 0.28, 0.01)
  assert (multi.micro_batches, multi.sampler_dtype, multi_kw["seed"]) == (2, np.float32, 5)


def test_a_second_staleness_bound_is_refused(tmp_path):
  """PipelineConfig.max_staleness is the run's one bound; naming another in the loss fails."""
  with pytest.raises(ValueError, match="disagrees with the pipeline's bound"):
    rl_part.main(["learner", f"--workdir={tmp_path}", "--steps=0", *FLAGS,
                  "--gin.LossConfig.max_staleness=1"])


def test_multi_process_flags_are_the_learners_and_checked(tmp_path, capsys):
  """--num_processes/--process_id/--coordinator start jax.distributed for a learner only, and
  bad values stop with a usage error before any JAX work (the real multi-process learner:
  tools/rl_part_multihost_test.py)."""
  for argv, message in [
      (["sampler", "--num_processes=2", "--process_id=1", "--coordinator=127.0.0.1:1"],
       "--num_processes, --process_id and --coordinator are the learner's"),
      (["learner", "--num_processes=2", "--process_id=0"],
       "2 processes need a coordinator address host:port"),
      (["learner", "--num_processes=2", "--process_id=2", "--coordinator=127.0.0.1:1"],
       "process_id 2 is not one of 2 processes")]:
    with pytest.raises(SystemExit) as e:
      rl_part.main([argv[0], f"--workdir={tmp_path}", *argv[1:]])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_learner_checks_its_mesh_against_its_devices_and_other_parts_do_not(tmp_path,
                                                                               capsys):
  """The learner trains on the experiment's mesh over this process's devices (all of them its
  own, unlike the in-process run that shares them with samplers); the other parts ignore it."""
  import jax  # pylint: disable=g-import-not-at-top
  wide = ["ExperimentConfig.mesh_shape=(64, 1, 1, 1)", "PipelineConfig.batch_rows=64",
          "PretrainConfig.batch_rows=64"]
  assert rl_part.main(["learner", f"--workdir={tmp_path}", "--steps=0",
                       *[f"--gin.{b}" for b in wide]]) == 2
  assert (f"mesh_shape (data=64, fsdp=1, expert=1, tensor=1) needs 64 devices but "
          f"{jax.device_count()}") in capsys.readouterr().err
  cfg = rl_part._load_experiment(configs, [rl_part.DEFAULT_EXPERIMENT], wide, learner=False)
  assert cfg.mesh_shape == (64, 1, 1, 1)
  with pytest.raises(configs.ConfigError, match="plan-only experiment"):
    rl_part._load_experiment(configs, ["tools/configs/experiments/moe_1b_plan.gin"], [],
                             learner=True)


def test_the_default_compilation_cache_is_the_runs_under_a_launcher_else_the_users(
    tmp_path, monkeypatch):
  """A part placed again on another node must find what the run compiled: under a launcher the
  default cache is the experiment directory's; a part started by hand uses the user's."""
  from launch import discovery  # pylint: disable=g-import-not-at-top
  from tools import compilation_cache  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  for var in (discovery.JOBS_JSON, discovery.JOB_NAME, discovery.EXPERIMENT_DIR):
    monkeypatch.delenv(var, raising=False)
  assert rl_part._default_cache_dir() == compilation_cache.default_dir() == str(
      tmp_path / "xdg" / "moe-rl" / "jax")
  monkeypatch.setenv(discovery.JOBS_JSON, str(tmp_path / "jobs.json"))
  monkeypatch.setenv(discovery.JOB_NAME, "sampler_0")
  monkeypatch.setenv(discovery.EXPERIMENT_DIR, str(tmp_path / "exp"))
  assert rl_part._default_cache_dir() == str(tmp_path / "exp" / "jax_cache")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
