"""Params-only model checkpoints for serving: orbax arrays plus the ModelConfig as JSON.

Layout of a checkpoint directory (an orbax composite checkpoint):
  <path>/params/        every model variable (parameters and router biases) as an orbax PyTree,
                        nested by the '/'-separated moe.params.flatten names
  <path>/model_config/  the ModelConfig as JSON (orbax JsonSave)
The learner's training checkpoints (rl/checkpointing.py) write the same two items in every step
directory, so `load_model(<train_dir>/<step>)` serves a training checkpoint directly.

Restoring with a mesh places each array straight onto its devices (the shardings come from the
logical-axis table), so the mesh may differ from the one the checkpoint was written on.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from moe import build
from moe import params as params_lib
from moe import sharding
from moe.config import ModelConfig
from moe.model import MoEDecoder

PARAMS_ITEM = "params"
CONFIG_ITEM = "model_config"


def config_to_json(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_json(data: Mapping[str, Any]) -> ModelConfig:
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(data) - known)
  if unknown:
    raise ValueError(f"model_config has unknown fields {unknown}")
  return ModelConfig(**dict(data))


def nest(flat: Mapping[str, Any]) -> dict:
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}} (orbax stores nested dicts as directories)."""
  out: dict = {}
  for name, value in flat.items():
    node = out
    parts = name.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = value
  return out


def unnest(tree: Mapping[str, Any], prefix: str = "") -> dict:
  """Inverse of `nest`."""
  out = {}
  for k, v in tree.items():
    name = f"{prefix}/{k}" if prefix else str(k)
    if isinstance(v, Mapping):
      out.update(unnest(v, name))
    else:
      out[name] = v
  return out


def save_args(flat: Mapping[str, Any], cfg: ModelConfig) -> dict:
  """The orbax Composite items of a params checkpoint (shared with training checkpoints)."""
  return {PARAMS_ITEM: ocp.args.StandardSave(nest(flat)),
          CONFIG_ITEM: ocp.args.JsonSave(config_to_json(cfg))}


def save_params(model: MoEDecoder, path: str) -> None:
  """Writes every variable of `model` and its ModelConfig to the directory `path` (must not
  exist). Blocks until the checkpoint is complete."""
  path = os.path.abspath(path)
  flat = params_lib.flatten(model, to_numpy=False)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(path, ocp.args.Composite(**save_args(flat, model.config)))


def _require_checkpoint(path: str, items=(PARAMS_ITEM, CONFIG_ITEM)) -> str:
  """The absolute `path`, after checking it holds the checkpoint items `items`.

  Raises:
    FileNotFoundError: naming the path and what is missing (orbax would raise a bare KeyError
      for a directory that is not a model checkpoint, e.g. a Hugging Face one).
  """
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no model checkpoint at {path}: no such directory")
  missing = [i for i in items if not os.path.isdir(os.path.join(path, i))]
  if missing:
    raise FileNotFoundError(f"{path} is not a model checkpoint: it has no {missing} item "
                            f"(moe.checkpoint.save_params and rl.checkpointing write "
                            f"{PARAMS_ITEM}/ and {CONFIG_ITEM}/)")
  return path


def load_config(path: str) -> ModelConfig:
  """The ModelConfig of the checkpoint at `path` (raises FileNotFoundError if there is none)."""
  path = _require_checkpoint(path, (CONFIG_ITEM,))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(path, ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))
  return config_from_json(restored[CONFIG_ITEM])


def _restore_flat(path: str, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(_require_checkpoint(path), ocp.args.Composite(
        **{PARAMS_ITEM: ocp.args.StandardRestore(nest(targets))}))
  flat = unnest(restored[PARAMS_ITEM])
  if set(flat) != set(targets):
    raise ValueError(f"checkpoint {path} does not match its model_config: "
                     f"missing {sorted(set(targets) - set(flat))[:5]}, "
                     f"unknown {sorted(set(flat) - set(targets))[:5]}")
  return flat


def restore_targets(cfg: ModelConfig, mesh: Optional[Mesh] = None) -> dict:
  """{name: ShapeDtypeStruct with sharding} of every variable of a `cfg` model; on `mesh` by the
  logical-axis table, else on the first local device."""
  _, state = nnx.split(build.abstract(cfg))
  if mesh is not None:
    shard_state = sharding.state_shardings(state, mesh)
    shards = {params_lib._name(p): v.get_value() for p, v in nnx.to_flat_state(shard_state)}
  else:
    shards = None
  device = SingleDeviceSharding(jax.local_devices()[0])
  out = {}
  for p, v in nnx.to_flat_state(state):
    name = params_lib._name(p)
    val = v.get_value()
    out[name] = jax.ShapeDtypeStruct(val.shape, val.dtype,
                                     sharding=shards[name] if shards else device)
  return out


def state_from_flat(template: nnx.State, flat: Mapping[str, Any]) -> nnx.State:
  """A copy of the nnx.State `template` with each variable's value taken from `flat`."""
  items = []
  for path, var in nnx.to_flat_state(template):
    items.append((path, var.replace(flat[params_lib._name(path)])))
  return nnx.from_flat_state(items)


def load_params_flat(path: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, {name: numpy array}) of a checkpoint, read onto the host."""
  cfg = load_config(path)
  flat = _restore_flat(path, restore_targets(cfg))
  return cfg, {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}


def load_model(path: str, mesh: Optional[Mesh] = None) -> MoEDecoder:
  """The model of a checkpoint; with `mesh`, every array is restored directly sharded on it."""
  cfg = load_config(path)
  flat = _restore_flat(path, restore_targets(cfg, mesh))
  graphdef, template = nnx.split(build.abstract(cfg))
  return nnx.merge(graphdef, state_from_flat(template, flat))
