"""Flat views of model weights: `'/'`-joined parameter paths -> arrays.

The flat dict is the common currency between packages: the sampler swaps weights from it, weight
sync diffs it, checkpoints and Hugging Face conversion read and write it. Names look like
`layers/3/ffn/experts/gate`.
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
from flax import nnx


def _name(path) -> str:
  return "/".join(str(getattr(p, "key", p)) for p in path)


def flatten(model: nnx.Module, *, to_numpy: bool = True) -> dict:
  """All variables of `model` (parameters and router biases) as {name: array}."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    out[_name(path)] = np.asarray(jax.device_get(value)) if to_numpy else value
  return out


def load_flat(model: nnx.Module, flat: Mapping[str, object], *, strict: bool = True) -> None:
  """Writes `flat` into `model` in place, keeping each variable's dtype and sharding.

  Raises ValueError (before changing anything) for a missing or unknown name or a wrong shape.
  """
  state = nnx.state(model)
  items = list(nnx.to_flat_state(state))
  names = {_name(p) for p, _ in items}
  if strict:
    missing = sorted(names - set(flat))
    unknown = sorted(set(flat) - names)
    if missing or unknown:
      raise ValueError(f"weights do not match the model: missing {missing[:5]}"
                       f"{'...' if len(missing) > 5 else ''}, unknown {unknown[:5]}"
                       f"{'...' if len(unknown) > 5 else ''}")
  for path, var in items:
    name = _name(path)
    if name in flat and tuple(np.shape(flat[name])) != tuple(var.get_value().shape):
      raise ValueError(f"{name}: shape {tuple(np.shape(flat[name]))} does not match the model's "
                       f"{tuple(var.get_value().shape)}")
  for path, var in items:
    name = _name(path)
    if name not in flat:
      continue
    old = var.get_value()
    new = jax.numpy.asarray(flat[name], dtype=old.dtype)
    sh = getattr(old, "sharding", None)
    if sh is not None:
      new = jax.device_put(new, sh)
    var.set_value(new)
  nnx.update(model, state)
