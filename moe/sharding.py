"""Logical axis names, the one table that maps them to mesh axes, and mesh helpers.

Layers annotate every parameter with logical axis names (`embed`, `heads`, `mlp`, `exp`, ...).
`LOGICAL_RULES` maps each logical name to mesh axes of the named mesh (`data`, `fsdp`, `expert`,
`tensor`). Swapping the table re-shards the model without touching a layer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("exp_router", None),  # the router's expert dim stays replicated: every token needs all logits
    ("layers", None),
)

# Mesh axes over which the batch of activations is split; tokens are replicated across the others.
BATCH_AXES = ("data", "fsdp")


def make_mesh(shape: Sequence[int] = (1, 1, 1, 1), devices=None) -> Mesh:
  """A mesh with axes (data, fsdp, expert, tensor) of the given shape."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
  devices = list(devices if devices is not None else jax.devices())
  need = int(np.prod(shape))
  if need > len(devices):
    raise ValueError(f"mesh shape {shape} needs {need} devices, have {len(devices)}")
  return Mesh(np.asarray(devices[:need]).reshape(shape), MESH_AXES)


def mesh_axes(logical: str, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> tuple[str, ...]:
  """The mesh axes a logical axis maps to in `rules` (empty when it is replicated).

  Code that names mesh axes itself (collectives inside `shard_map`) asks the table, e.g.
  `mesh_axes("exp")` is the expert axis the routed experts are split over.
  """
  table = dict(rules)
  if logical not in table:
    raise KeyError(f"logical axis {logical!r} has no rule; known: {sorted(table)}")
  target = table[logical]
  return (target,) if isinstance(target, str) else tuple(target or ())


def axes_size(mesh: Any, axes: Sequence[str]) -> int:
  """Product of the sizes of `axes` on `mesh` (1 for an empty mesh or axes it lacks)."""
  if mesh is None or mesh.empty:
    return 1
  return int(np.prod([mesh.shape.get(a, 1) for a in axes]))


def logical_to_spec(logical: Optional[Sequence[Optional[str]]],
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
                    mesh: Optional[Mesh] = None,
                    shape: Optional[Sequence[int]] = None) -> P:
  """PartitionSpec for a tuple of logical axis names.

  A mesh axis is used at most once per array; if `mesh` and `shape` are given, a mesh axis that
  does not divide the dimension is dropped (that dimension stays replicated over it).
  """
  if logical is None:
    return P()
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(logical):
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept = []
    for ax in axes:
      if ax in used:
        continue
      if mesh is not None and shape is not None:
        size = mesh.shape[ax]
        if shape[i] % (size * int(np.prod([mesh.shape[a] for a in kept]))) != 0:
          continue
      kept.append(ax)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def _logical_axes_of(v: nnx.Variable):
  return v.get_metadata().get("logical_axes")


def state_specs(state: Any, mesh: Optional[Mesh] = None,
                rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """PartitionSpecs for an nnx.State, from each variable's `logical_axes` metadata."""
  def spec(v):
    if isinstance(v, nnx.Variable):
      shape = getattr(v.get_value(), "shape", None)
      return v.replace(logical_to_spec(_logical_axes_of(v), rules, mesh, shape))
    return P()
  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """NamedShardings for an nnx.State on `mesh`."""
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def batch_spec(ndim: int) -> P:
  """Activations/token arrays: batch split over BATCH_AXES, everything else replicated."""
  return P(BATCH_AXES, *([None] * (ndim - 1)))


def bytes_per_device(abstract_state: Any, mesh: Mesh,
                     rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> int:
  """Largest per-device parameter bytes of an abstract (eval_shape) state on `mesh`."""
  specs = state_specs(abstract_state, mesh, rules)
  total = 0
  leaves = jax.tree.leaves(abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for v, s in zip(leaves, spec_leaves):
    val = v.get_value() if isinstance(v, nnx.Variable) else v
    spec = s.get_value() if isinstance(s, nnx.Variable) else s
    n = int(np.prod(val.shape)) * np.dtype(val.dtype).itemsize
    for ax in spec:
      for a in ((ax,) if isinstance(ax, str) else (ax or ())):
        n //= mesh.shape[a]
    total += n
  return total

