"""Where an engine's arrays live: the default device, one chosen device, or a mesh.

What:
  * `Placement(cfg, mesh=..., device=...)`: an engine's placement. It puts the packed weights
    (`put_params`), gives the sharding of the KV cache and the prefix-cache store
    (`cache_sharding`), and is the context the device programs are traced and run in
    (`context`: `jax.set_mesh` on a mesh of several devices).
  * `check_mesh(mesh, cfg)`: what a sampler mesh must be (clear errors otherwise).
  * `active_mesh()` and `constrain(x, logical)`: for the device programs, the mesh they are
    traced under (None on one device) and a sharding constraint by logical axis names that is a
    no-op without one, so `rollout.forward` is one code path for both.

Sharding (a mesh of moe.sharding's axes (data, fsdp, expert, tensor)): the packed weights' dims
carry logical names (`PACKED_AXES`) and moe.sharding's one table, LOGICAL_RULES, maps them to
mesh axes, exactly as it does for the model's parameters: heads, kv heads, intermediate columns
and the vocabulary over `tensor`, experts over `expert`; norms and the router replicated. The
fused matrices are packed in tensor groups (`rollout.packed_weights`), so a device's shard holds
whole heads with their kv heads and matching gate and up columns. Attention then runs per
tensor shard on its own heads (XLA's partitioner sums the output projection across the shards),
and the routed experts run through moe's expert parallelism (`rollout.forward`, all-to-all over
`expert`).

The KV cache is sharded on kv heads over `tensor` and replicated over `expert`. Why: it is the
largest activation memory (slots x positions x layers), and a tensor shard's attention reads
only its own kv heads, so splitting the cache that way costs no communication and divides its
memory by the tensor size; kept replicated, each device would hold every head and attention
would first slice them. Attention is not split over experts (every expert shard computes the
attention of every slot on its tensor shard of heads), so over `expert` the cache is replicated
like the residual stream. The prefix-cache store has the cache's layout and the same sharding.

`data` and `fsdp` must be 1: a sampler's data parallelism is replicas (`rollout.replicas`),
independent engines with their own slots and scheduler, not a batch split inside one engine.

Logits are gathered whole before sampling (`rollout.forward._head`), so sampling is replicated
and the same arithmetic as on one device.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from moe import sharding as moe_sharding
from moe.config import ModelConfig
from rollout import packed_weights

# Logical axis names of each packed weight (`rollout.packed_weights`), by its name in a layer or
# at the top level; LOGICAL_RULES maps them to mesh axes.
PACKED_AXES = {
    "embed": ("vocab", "embed"),
    "head": ("embed", "vocab"),
    "final_norm": (None,),
    "attn_norm": (None,),
    "ffn_norm": (None,),
    "q_norm": (None,),
    "k_norm": (None,),
    "wqkv": ("embed", "heads", None),  # [D, G, ...]: the tensor groups over `tensor`
    "wo": ("heads", "embed"),  # rows: heads in order, whole heads per tensor shard
    "router_w": ("embed", "exp_router"),  # replicated: every token needs every expert's logit
    "router_b": ("exp_router",),
    "experts_gu": ("exp", "embed", "mlp", None),
    "experts_d": ("exp", "mlp", "embed"),
    "mlp_gu": ("embed", "mlp", None),
    "mlp_d": ("mlp", "embed"),
    "shared_gu": ("embed", "mlp", None),
    "shared_d": ("mlp", "embed"),
}
# Slot cache keys [B, KV, hd, S] / values [B, KV, S, hd] and the prefix store's blocks: sharded
# on kv heads (see the module docstring); slots are never split.
CACHE_AXES = (None, "kv_heads", None, None)


def check_mesh(mesh: Mesh, cfg: ModelConfig) -> None:
  """Raises ValueError unless `mesh` can hold a sampler of `cfg` (see the module docstring)."""
  if tuple(mesh.axis_names) != moe_sharding.MESH_AXES:
    raise ValueError(f"a sampler mesh has the axes {moe_sharding.MESH_AXES} "
                     f"(moe.sharding.make_mesh), got {tuple(mesh.axis_names)}")
  split = {a: mesh.shape[a] for a in ("data", "fsdp") if mesh.shape[a] != 1}
  if split:
    raise ValueError(f"a sampler mesh splits only expert and tensor (data parallelism is by "
                     f"replicas, rollout.replicas); got {split}")
  ep = mesh.shape["expert"]
  if ep > 1 and cfg.num_experts % ep:
    raise ValueError(f"an expert axis of {ep} must divide num_experts ({cfg.num_experts})")
  if ep > 1 and cfg.num_layers <= cfg.first_k_dense:
    raise ValueError("an expert axis needs a model with MoE layers")
  packed_weights.check_groups(cfg, mesh.shape["tensor"])


def active_mesh():
  """The mesh the code being traced runs on (`Placement.context`), or None on one device."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh.size == 1 else mesh


def constrain(x, logical: Sequence[Optional[str]]):
  """`x` constrained to the sharding of its logical axes on the active mesh; `x` itself when
  there is none (one device)."""
  mesh = active_mesh()
  if mesh is None:
    return x
  spec = moe_sharding.logical_to_spec(tuple(logical), mesh=mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, spec)


class Placement:
  """An engine's placement (see the module docstring).

  Args:
    cfg: the served model's config.
    mesh: a mesh of moe.sharding's axes (`moe.sharding.make_mesh`); one of one device is the
      same as `device`.
    device: one device (a replica's, `rollout.replicas`).
    Neither: the default device, with jax's default (uncommitted) placement, as before meshes.
  """

  def __init__(self, cfg: ModelConfig, *, mesh: Optional[Mesh] = None, device=None):
    if mesh is not None and device is not None:
      raise ValueError("give a mesh or a device, not both")
    if mesh is not None:
      check_mesh(mesh, cfg)
      if mesh.size == 1:
        device, mesh = mesh.devices.flat[0], None
    self.mesh = mesh
    self.device = device
    self.groups = mesh.shape["tensor"] if mesh is not None else 1

  @property
  def devices(self) -> list:
    """The devices the engine runs on (the default device when none was chosen)."""
    if self.mesh is not None:
      return list(self.mesh.devices.flat)
    return [self.device if self.device is not None else jax.devices()[0]]

  def describe(self) -> str:
    if self.mesh is None:
      return str(self.devices[0])
    shape = {a: n for a, n in self.mesh.shape.items() if n > 1}
    return f"mesh {shape} over {len(self.devices)} devices"

  def _sharding(self, logical, shape):
    if self.mesh is not None:
      return NamedSharding(self.mesh, moe_sharding.logical_to_spec(logical, mesh=self.mesh,
                                                                   shape=shape))
    if self.device is not None:
      return SingleDeviceSharding(self.device)
    return None

  def param_shardings(self, host_tree) -> dict:
    """The sharding of each packed weight (None leaves: default placement)."""
    def one(path, x):
      name = path[-1].key
      return self._sharding(PACKED_AXES[name], x.shape)
    return jax.tree_util.tree_map_with_path(one, host_tree)

  def put_params(self, host_tree) -> dict:
    """Packed host weights (`packed_weights.pack_host`) on the engine's devices; on a mesh each
    device receives only its shards."""
    if self.mesh is None and self.device is None:
      return jax.tree.map(jnp.asarray, host_tree)
    return jax.device_put(host_tree, self.param_shardings(host_tree))

  def cache_sharding(self, shape):
    """The sharding of a slot-cache or prefix-store array of `shape` (None: default)."""
    return self._sharding(CACHE_AXES, shape)

  def context(self):
    """The context the device programs are traced and run in: the mesh when there is one."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
