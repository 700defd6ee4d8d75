"""The one gin front end: config registration, command-line gin flags, parsing, validation.

Library packages never import gin. This module registers their plain dataclasses as external
configurables, so gin files can write `PipelineConfig.max_staleness = 2` or
`RLConfig.learner = @LearnerConfig()`, and every entry point in tools/ reads its gin flags and
parses gin here: `load_experiment(...)` (the main job, the resource planner, the RL parts), or
`parse(...)` + `model_config()` (tools that only need a model).

Every binary spells its gin flags the same way:
    --gin_file=PATH        a gin file (repeatable; a relative path is from the working directory,
                           the Bazel workspace (`bazel run` sets it) or the repository)
    --gin.SCOPE.NAME=V     a binding, exactly `SCOPE.NAME = V` in a gin file
Binaries whose flags are one configurable's parameters (//tools:eval, //tools:launch) also take
`--NAME=V` for `--gin.<configurable>.NAME=V` (`split_flags`); argparse binaries take their own
flags besides (`parse_flags`). An unknown flag is an error before any work starts.

Gin files come in tiers (t5x style):
  moe/configs/*.gin                    model sizes: `ModelConfig.*` only.
  tools/configs/runs/*.gin             run types (pretrain, rl, eval, serve): bind their phase's
                                       config into `ExperimentConfig` and mark what an experiment
                                       must set with `%gin.REQUIRED`.
  tools/configs/experiments/*.gin      experiments: include one size and the run types, set the
                                       numbers. Files named `*_plan.gin` describe real-size runs
                                       that are only validated and planned (//tools:plan).

The phases of an experiment are the run files it includes: `ExperimentConfig.pretrain` /
`ExperimentConfig.rl` left unbound means that phase is skipped (steps = 0). Evaluation has no off
switch and falls back to `EvalConfig()` defaults without runs/eval.gin.

`load_experiment` turns every way a config can be wrong into a `ConfigError` before any work
starts: unknown configurables or parameters, `%gin.REQUIRED` values left unset, bindings that
nothing uses (e.g. `RLConfig.steps` without a run file that binds `ExperimentConfig.rl`), a mesh
the devices or the model cannot take, and the dataclasses' own `__post_init__` checks. With
`ExperimentConfig.hf_checkpoint` the model checked (and returned) is the checkpoint's.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import os
from typing import Callable, Optional, Sequence

import gin
from gin import config as gin_config

from experiment.config import AgentConfig, EvalConfig, ExperimentConfig, PretrainConfig, RLConfig
from moe.config import ModelConfig
from moe.sharding import MESH_AXES
from pipeline.config import PipelineConfig
from rl.learner import LearnerConfig
from rl.objectives import PolicyLossConfig
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig
from rollout.engine import EngineConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS_DIR = os.path.join(REPO_ROOT, "tools", "configs", "experiments")
RUNS_DIR = os.path.join(REPO_ROOT, "tools", "configs", "runs")
MODEL_SIZES_DIR = os.path.join(REPO_ROOT, "moe", "configs")

# The gin-wrapped constructors: calling one applies the parsed bindings. Instances are of the
# plain library classes (gin wraps the constructor, not the type).
GinModelConfig = gin.external_configurable(ModelConfig, module="moe")
GinPipelineConfig = gin.external_configurable(PipelineConfig, module="pipeline")
GinLearnerConfig = gin.external_configurable(LearnerConfig, module="rl")
GinOptimizerConfig = gin.external_configurable(OptimizerConfig, module="rl")
GinLossConfig = gin.external_configurable(LossConfig, module="rl")
GinPolicyLossConfig = gin.external_configurable(PolicyLossConfig, module="rl")
GinPretrainConfig = gin.external_configurable(PretrainConfig, module="experiment")
GinRLConfig = gin.external_configurable(RLConfig, module="experiment")
GinEvalConfig = gin.external_configurable(EvalConfig, module="experiment")
GinAgentConfig = gin.external_configurable(AgentConfig, module="experiment")
GinExperimentConfig = gin.external_configurable(ExperimentConfig, module="experiment")
# The sampling server's settings (//tools:serve, tools/configs/runs/serve.gin); not part of an
# experiment, so not in CONFIGURABLES below.
GinEngineConfig = gin.external_configurable(EngineConfig, module="rollout")

# Configurable name -> full gin selector, for the ones this module registers.
CONFIGURABLES = {
    "ModelConfig": "moe.ModelConfig",
    "PipelineConfig": "pipeline.PipelineConfig",
    "LearnerConfig": "rl.LearnerConfig",
    "OptimizerConfig": "rl.OptimizerConfig",
    "LossConfig": "rl.LossConfig",
    "PolicyLossConfig": "rl.PolicyLossConfig",
    "PretrainConfig": "experiment.PretrainConfig",
    "RLConfig": "experiment.RLConfig",
    "EvalConfig": "experiment.EvalConfig",
    "AgentConfig": "experiment.AgentConfig",
    "ExperimentConfig": "experiment.ExperimentConfig",
}


class ConfigError(ValueError):
  """A command-line flag, gin file or binding is unknown, malformed or inconsistent."""


def workspace_root() -> str:
  """The workspace `bazel run` was started from, else this repository."""
  return os.environ.get("BUILD_WORKSPACE_DIRECTORY") or REPO_ROOT


def workspace_path(path: str) -> str:
  """A path given on the command line: absolute as given, else relative to the workspace (under
  `bazel run` the working directory is the runfiles tree, not where the user typed)."""
  return path if os.path.isabs(path) else os.path.join(workspace_root(), path)


def resolve_path(path: str) -> str:
  """A gin file's path: absolute, else relative to the cwd, the Bazel workspace or the repo."""
  if os.path.isabs(path) or os.path.exists(path):
    if not os.path.exists(path):
      raise ConfigError(f"gin file not found: {path}")
    return path
  for root in (os.environ.get("BUILD_WORKSPACE_DIRECTORY"), REPO_ROOT):
    if root and os.path.exists(os.path.join(root, path)):
      return os.path.join(root, path)
  raise ConfigError(f"gin file not found: {path}")


# -- command-line flags -------------------------------------------------------------------------
def _binding(key: str, value: str) -> str:
  return f"{key[len('gin.'):]} = {value}"


def _literal(v: str) -> str:
  """The gin text for a flag value: itself if it is a literal, else a quoted string."""
  try:
    ast.literal_eval(v)
    return v
  except (ValueError, SyntaxError):
    return repr(v)


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str]
                ) -> tuple[argparse.Namespace, list[str], list[str]]:
  """(the parser's flags, gin files, gin bindings) of an argparse binary's command line.

  Adds `--gin_file` (repeatable) to `parser`; `--gin.SCOPE.NAME=V` flags become bindings and any
  other unknown flag is a usage error (exit status 2). Abbreviated flags are refused, so a
  mistyped `--gin=...` cannot pass for `--gin_file`.
  """
  parser.allow_abbrev = False
  parser.add_argument("--gin_file", action="append", default=[],
                      help="gin file (repeatable); --gin.SCOPE.NAME=V binds one value")
  args, rest = parser.parse_known_args(list(argv))
  bindings = []
  for a in rest:
    key, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
    if not key.startswith("gin.") or not eq:
      parser.error(f"unknown argument {a!r} (gin bindings look like --gin.RLConfig.steps=100)")
    bindings.append(_binding(key, value))
  return args, list(args.gin_file), bindings


def split_flags(argv: Sequence[str], main: Callable, *, extra_flags: Sequence[str] = ()
                ) -> tuple[list[str], list[str], dict]:
  """(gin files, gin bindings, extra flag values) of a binary whose flags are `main`'s parameters.

  `main` is the gin configurable that `--NAME=V` shorthands bind (`--gin.main.NAME=V`);
  `extra_flags` are plain flags the caller handles itself (returned as {name: value}; a bare
  `--name` is "true").

  Raises:
    ConfigError: a malformed or unknown flag, or a gin file that does not exist.
  """
  name = getattr(main, "__name__", None) or main.__wrapped__.__name__
  params = set(inspect.signature(main).parameters)
  files, bindings, extra = [], [], {}
  for arg in argv:
    if not arg.startswith("--"):
      raise ConfigError(f"unexpected argument {arg!r} (flags look like --name=value)")
    key, eq, value = arg[2:].partition("=")
    if key == "gin_file":
      if not eq:
        raise ConfigError("--gin_file needs a value")
      files.append(resolve_path(value))
    elif key.startswith("gin."):
      if not eq:
        raise ConfigError(f"{arg}: a binding needs a value (--gin.X=V)")
      bindings.append(_binding(key, value))
    elif key in extra_flags:
      extra[key] = value if eq else "true"
    elif key in params:
      if not eq:
        raise ConfigError(f"{arg} needs a value")
      bindings.append(f"{name}.{key} = {_literal(value)}")
    else:
      known = sorted(params | set(extra_flags) | {"gin_file", "gin.X"})
      raise ConfigError(f"unknown flag --{key} (known: {', '.join('--' + k for k in known)})")
  return files, bindings, extra


def is_plan_experiment(path: str) -> bool:
  """Whether an experiment file describes a real-size run that is only planned (`*_plan.gin`)."""
  return os.path.basename(path).endswith("_plan.gin")


def experiment_files() -> list[str]:
  """Every experiment file under tools/configs/experiments/, sorted."""
  return sorted(os.path.join(EXPERIMENTS_DIR, f) for f in os.listdir(EXPERIMENTS_DIR)
                if f.endswith(".gin"))


def parse(gin_files: Sequence[str] = (), bindings: Sequence[str] = (), *,
          finalize: bool = True) -> None:
  """Clears gin and parses `gin_files` (paths relative to the repo root work) then `bindings`.

  With `finalize`, a `%gin.REQUIRED` value that no later binding overrides is an error here.

  Raises:
    ConfigError: a missing file, or gin's own error (unknown configurable or parameter, syntax,
      an unset `%gin.REQUIRED`), with what to do about it.
  """
  gin.clear_config()
  paths = [resolve_path(f) for f in gin_files]
  for root in (os.environ.get("BUILD_WORKSPACE_DIRECTORY"), REPO_ROOT):
    if root:
      gin.add_config_file_search_path(root)
  try:
    gin.parse_config_files_and_bindings(paths, list(bindings), finalize_config=finalize)
  except (ValueError, KeyError, SyntaxError, TypeError, NameError, IOError) as e:
    msg = str(e)
    if "No configurable matching" in msg:
      msg += f"\n  config classes registered by tools/configs.py: {', '.join(CONFIGURABLES)}"
    if "%gin.REQUIRED" in msg:
      msg += ("\n  set it in the experiment file (after the include) or on the command line "
              "(--gin.NAME=VALUE)")
    raise ConfigError(f"bad gin config: {msg}") from e


def model_config() -> ModelConfig:
  """The ModelConfig bound by the parsed gin files."""
  try:
    return GinModelConfig()
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e


def validate_mesh(model: ModelConfig, mesh_shape: Sequence[int],
                  num_devices: Optional[int] = None) -> None:
  """Raises ConfigError unless `model` can be laid out on a (data, fsdp, expert, tensor) mesh.

  Args:
    model: the model to shard.
    mesh_shape: sizes of the mesh axes `moe.sharding.MESH_AXES`.
    num_devices: devices available to the run; None skips that check (a planned mesh).
  """
  shape = tuple(mesh_shape)
  if len(shape) != len(MESH_AXES) or not all(isinstance(s, int) and s >= 1 for s in shape):
    raise ConfigError(f"mesh_shape must be {len(MESH_AXES)} positive integers {MESH_AXES}, "
                      f"got {mesh_shape!r}")
  axes = dict(zip(MESH_AXES, shape))
  if model.num_experts % axes["expert"]:
    raise ConfigError(f"impossible mesh: the expert axis ({axes['expert']}) must divide "
                      f"num_experts ({model.num_experts}) so every device holds whole experts")
  if model.num_heads % axes["tensor"]:
    raise ConfigError(f"impossible mesh: the tensor axis ({axes['tensor']}) must divide "
                      f"num_heads ({model.num_heads})")
  _check_devices(shape, num_devices)


def _check_devices(shape: Sequence[int], num_devices: Optional[int]) -> None:
  # Checked after everything about the config itself, which is wrong whatever the machine.
  need = math.prod(shape)
  if num_devices is not None and need > num_devices:
    named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape))
    raise ConfigError(
        f"impossible mesh: mesh_shape ({named}) needs {need} devices but {num_devices} "
        f"{'is' if num_devices == 1 else 'are'} available (on a CPU, "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={need} simulates more)")


def validate_experiment(cfg: ExperimentConfig, num_devices: Optional[int] = None) -> None:
  """Checks `validate_mesh`, the batches, then the devices; raises ConfigError.

  The batch of every phase that runs must split over data x fsdp; `num_devices` None skips the
  device count (a planned mesh).
  """
  validate_mesh(cfg.model, cfg.mesh_shape, None)
  axes = dict(zip(MESH_AXES, cfg.mesh_shape))
  split = axes["data"] * axes["fsdp"]
  batches = []
  if cfg.pretrain.steps:
    batches.append(("PretrainConfig.batch_rows", cfg.pretrain.batch_rows))
  if cfg.rl.steps:
    batches.append(("PipelineConfig.batch_rows", cfg.rl.pipeline.batch_rows))
  for name, rows in batches:
    if rows % split:
      raise ConfigError(f"impossible mesh: {name} ({rows}) must be a multiple of "
                        f"data x fsdp ({axes['data']} x {axes['fsdp']} = {split}), the axes "
                        f"the batch is split over")
  _check_devices(cfg.mesh_shape, num_devices)
  if num_devices is not None and num_devices > 1:
    from pipeline import resources  # pylint: disable=g-import-not-at-top
    learner = len(resources.split_devices(range(num_devices),
                                          cfg.inference_fraction).learner_devices)
    if math.prod(cfg.mesh_shape) > learner:
      raise ConfigError(
          f"impossible mesh: mesh_shape {tuple(cfg.mesh_shape)} needs "
          f"{math.prod(cfg.mesh_shape)} devices but the learner gets {learner} of {num_devices} "
          f"(ExperimentConfig.inference_fraction = {cfg.inference_fraction:.3g} goes to the "
          "samplers)")


def _bound(selector: str) -> bool:
  try:
    gin.query_parameter(selector)
    return True
  except ValueError:
    return False


def _unused_bindings() -> list[str]:
  """Bindings of this module's configurables that the last construction never read.

  Uses gin's config and operative-config tables (gin 0.5 keeps them as module dicts keyed by
  (scope, selector)); a binding absent from the operative config was parsed but never applied.
  """
  ours = set(CONFIGURABLES.values())
  bound = gin_config._CONFIG  # pylint: disable=protected-access
  operative = gin_config._OPERATIVE_CONFIG  # pylint: disable=protected-access
  unused = []
  for (scope, selector), params in bound.items():
    if selector not in ours:
      continue
    used = operative.get((scope, selector), {})
    for name in params:
      if name not in used:
        prefix = f"{scope}/" if scope else ""
        unused.append(f"{prefix}{selector.split('.')[-1]}.{name}")
  return sorted(unused)


_CONSTRUCTED_BY = {
    "ModelConfig": "ExperimentConfig.model = @ModelConfig() (every run file binds it)",
    "PretrainConfig": "ExperimentConfig.pretrain = @PretrainConfig() (tools/configs/runs/"
                      "pretrain.gin)",
    "RLConfig": "ExperimentConfig.rl = @RLConfig() (tools/configs/runs/rl.gin)",
    "PipelineConfig": "RLConfig.pipeline = @PipelineConfig() (tools/configs/runs/rl.gin)",
    "LearnerConfig": "RLConfig.learner = @LearnerConfig() (tools/configs/runs/rl.gin)",
    "OptimizerConfig": "LearnerConfig.optimizer = @OptimizerConfig() (tools/configs/runs/rl.gin)",
    "LossConfig": "LearnerConfig.loss = @LossConfig() (tools/configs/runs/rl.gin)",
    "PolicyLossConfig": "LossConfig.policy = @PolicyLossConfig() (tools/configs/runs/rl.gin)",
    "EvalConfig": "ExperimentConfig.eval = @EvalConfig() (tools/configs/runs/eval.gin)",
    "AgentConfig": "ExperimentConfig.agent = @AgentConfig() (tools/configs/experiments/agent.gin)",
    "ExperimentConfig": "nothing: load_experiment constructs it",
}


def _with_checkpoint(cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` as the run will see it when it starts from a Hugging Face checkpoint: the
  checkpoint's model (experiment.hf_checkpoint.with_checkpoint_model, config.json only), so the
  mesh and batches are checked against it; a missing task file fails here too."""
  for name in ("hf_checkpoint", "task_file"):
    path = getattr(cfg, name)
    if path and not os.path.exists(path):
      raise ConfigError(f"ExperimentConfig.{name}: {path} does not exist")
  if not cfg.hf_checkpoint:
    return cfg
  from experiment import hf_checkpoint  # pylint: disable=g-import-not-at-top
  try:
    return hf_checkpoint.with_checkpoint_model(cfg)
  except ValueError as e:  # moe.hf.CheckpointError, or the run does not fit the model
    raise ConfigError(f"bad experiment config: --hf_checkpoint {cfg.hf_checkpoint}: {e}") from e


def load_experiment(gin_files: Sequence[str], bindings: Sequence[str] = (), *,
                    num_devices: Optional[int] = None,
                    check_devices: bool = True) -> ExperimentConfig:
  """Parses gin files and `NAME = VALUE` bindings and builds the validated ExperimentConfig.

  Args:
    gin_files: experiment files (paths absolute or relative to the repo / Bazel workspace).
    bindings: gin bindings applied after the files (e.g. "RLConfig.steps = 100").
    num_devices: devices the run will use (default: `jax.device_count()`).
    check_devices: False for planned real-size runs: the mesh is checked against the model and
      the batches but not against the devices of this machine. `*_plan.gin` files are refused
      unless this is False.

  Raises:
    ConfigError: anything wrong with the configuration, with a message that says what to fix.
  """
  plans = [f for f in gin_files if is_plan_experiment(f)]
  if check_devices and plans:
    raise ConfigError(f"{plans[0]} is a plan-only experiment (a real-size run): validate and "
                      f"plan it with `bazel run //tools:plan -- --gin_file={plans[0]}`")
  parse(gin_files, bindings, finalize=True)
  if not any(sel == CONFIGURABLES["ModelConfig"]
             for _, sel in gin_config._CONFIG):  # pylint: disable=protected-access
    raise ConfigError("no model size: include a model size file (moe/configs/tiny.gin, "
                      "small.gin, ...) in the experiment or pass it with --gin_file")
  skipped = {}
  if not _bound("ExperimentConfig.pretrain"):
    skipped["pretrain"] = PretrainConfig(steps=0)
  if not _bound("ExperimentConfig.rl"):
    skipped["rl"] = RLConfig(steps=0)
  try:
    cfg = GinExperimentConfig(**skipped)
  except TypeError as e:
    msg = str(e)
    if "'model'" in msg:
      msg = ("ExperimentConfig.model is not bound: include a run file (tools/configs/runs/*.gin) "
             "or bind ExperimentConfig.model = @ModelConfig()")
    raise ConfigError(f"bad experiment config: {msg}") from e
  except ValueError as e:
    raise ConfigError(f"bad experiment config: {e}") from e
  unused = _unused_bindings()
  if unused:
    hints = sorted({_CONSTRUCTED_BY[u.split("/")[-1].split(".")[0]] for u in unused})
    raise ConfigError(f"bindings that nothing uses: {', '.join(unused)}; they take effect only "
                      f"if the experiment binds {'; '.join(hints)}")
  cfg = _with_checkpoint(cfg)
  if check_devices and num_devices is None:
    import jax  # pylint: disable=g-import-not-at-top
    num_devices = jax.device_count()
  validate_experiment(cfg, num_devices if check_devices else None)
  return cfg
