"""Expert parallelism by all-to-all: each token goes only to the expert shards it was routed to.

Layout, inside one `shard_map` over the whole mesh (axis names come from moe/sharding.py's table:
`batch` -> (data, fsdp), `exp` -> expert, `mlp` -> tensor):
  * tokens [N, D] and their routing (indices and gates [N, k], computed before the shard_map by
    the replicated router, so identical whatever the mesh) are split over the batch axes AND the
    expert axis: a device holds n = N / (|data| |fsdp| |expert|) tokens, replicated over tensor;
  * expert shard s holds experts [s E_l, (s + 1) E_l), E_l = E / |expert|, their mlp dim split
    over tensor.

One MoE layer, on every device:
  1. each of its n k assignments (token, choice) is addressed to the shard holding its expert,
     idx // E_l;
  2. an all-to-all over the expert axis sends every assignment's token row there (`exchange`);
  3. the shard runs its E_l experts on the rows it received (moe.experts' implementations);
  4. the inverse all-to-all brings each row's output back to the device that sent it;
  5. each token's k outputs are combined with its gates in a fixed order (`experts.combine`),
     then summed over tensor: the partial sums of the split mlp dim (tensor parallelism; tokens
     are never replicated over the expert axis and nothing is all-reduced over it).
  A device moves its assignments' rows twice (padded to the buffers below) instead of
  all-reducing its whole batch shard [N / (|data| |fsdp|), D] over |expert| |tensor| devices,
  and its buffers shrink as the expert axis grows.

Three forms of the exchange; `choose_exchange` picks by capacity factor and backend:
  * "capacity" (a capacity factor cf is set; every backend): the GShard / DeepSpeed layout.
    Each device fills a buffer [E, C, D] of per-expert capacity C = `experts.capacity_for(n, k,
    E, cf)` (about n k cf / E), expert-major, so destination shard s's part is the contiguous
    [E_l, C, D] of its experts: a per-destination-shard buffer of E_l C rows. One
    `jax.lax.all_to_all` (fixed shapes) delivers it; the receiver lays the |expert| parts side by
    side as [E_l, |expert| C, D] and runs the experts' batched matmuls (`experts.expert_ffn`)
    without sorting again. Rows moved and computed: about n k cf per device.
    Drops: an assignment whose rank among the device's assignments to the same expert, in
    (token, k) order, is C or more is not sent; it contributes zero to its token's output and
    gets no gradient, exactly like `experts.dispatch_experts` run on the device's n tokens alone
    (a test checks this). The token keeps its other assignments and the shared experts. Nothing
    counts drops; they depend on how tokens fall on devices, so they can differ from a
    single-device run with the same cf, which ranks over its whole batch.
  * "padded" (dropless, cf None, where XLA has no ragged all-to-all: the CPU): per destination
    shard C = n min(k, E_l) rows, the worst case (every local token sending all the copies it
    can to one shard), so nothing can drop; rows travel with their expert id and the receiver
    runs a dropless local implementation (`dropless_local_experts`: grouped or dispatch on the
    CPU). The price of never dropping with fixed shapes: buffers of |expert| n min(k, E_l) rows,
    |expert| min(k, E_l) / (k cf) times the capacity form's; for tiny.gin at 2 and 4 expert
    shards more bytes and memory than the psum baseline, less at 8 (BENCHMARKS.md, "Expert
    parallelism dispatch").
  * "ragged" (dropless on GPU/TPU): `jax.lax.ragged_all_to_all` sends exactly the assigned rows,
    sorted by destination, after an all_gather of the [|expert|] send counts; the receiver runs
    the local experts (ragged_dot on GPU/TPU) on them. Bytes moved are the real assignments; the
    receive buffer still has a static size, the padded form's worst case (as MaxText's), so
    memory is the padded form's and communication is not. XLA:CPU does not implement the op
    ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"): on the CPU this
    form lowers but does not compile, and tests run it with an emulation.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe import experts as experts_lib
from moe import sharding

EXCHANGES = ("capacity", "padded", "ragged")
# Platforms (jax.default_backend()) whose XLA implements ragged-all-to-all.
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")

# The collective of the ragged form; a module attribute so that CPU tests can put an emulation
# in its place (XLA:CPU has no ragged-all-to-all).
ragged_all_to_all = jax.lax.ragged_all_to_all

# local_experts(x [R, D], idx [R, k], gates [R, k], w_gate, w_up, w_down, expert_offset) -> [R, D]
LocalExperts = Callable[..., jax.Array]


def choose_exchange(platform: str, capacity_factor: Optional[float]) -> str:
  """The exchange for a layer: "capacity" with a capacity factor; dropless (None), "ragged"
  where XLA implements ragged-all-to-all (`platform` is jax.default_backend(): GPU, TPU) and
  "padded" elsewhere (XLA:CPU)."""
  if capacity_factor is not None:
    return "capacity"
  return "ragged" if platform in RAGGED_PLATFORMS else "padded"


def padded_capacity(num_local_tokens: int, k: int, num_experts: int, num_shards: int) -> int:
  """Rows per destination shard of the dropless padded exchange: every one of a device's tokens
  sending all the copies it can (min(k, E_l)) to one shard."""
  return num_local_tokens * min(k, num_experts // num_shards)


def dropless_local_experts(expert_impl: str, dtype) -> LocalExperts:
  """The local experts a shard runs on the rows a dropless exchange brought it: dropless too.

  Any number of the rows may be one expert's, and a capacity here would drop rows the sender
  paid to move. "ragged" runs `ragged_experts`, "grouped" `grouped_experts`; "dispatch"
  runs `dispatch_experts` with a buffer as long as the rows received, and "auto" on the CPU the
  cheaper of that and grouped (`experts.dropless_cpu_impl`), as for a dropless layer without
  expert parallelism.
  """
  impl = experts_lib.resolve_impl(expert_impl)

  def run(x, idx, gates, wg, wu, wd, offset):
    rows, e_local = x.shape[0], wg.shape[0]
    if impl == "ragged":
      return experts_lib.ragged_experts(x, idx, gates, wg, wu, wd, dtype=dtype,
                                        expert_offset=offset)
    use = impl
    if impl == "dispatch" and expert_impl == "auto":
      use = experts_lib.dropless_cpu_impl(rows, idx.shape[1], e_local)
    if use == "grouped":
      return experts_lib.grouped_experts(x, idx, gates, wg, wu, wd, dtype=dtype,
                                         block=experts_lib.GROUPED_BLOCK, expert_offset=offset)
    return experts_lib.dispatch_experts(x, idx, gates, wg, wu, wd, dtype=dtype, capacity=rows,
                                        expert_offset=offset)

  return run


def _destinations(idx: jax.Array, e_local: int, num_shards: int) -> tuple[jax.Array, jax.Array]:
  """(flat expert ids [A], each assignment's destination shard; num_shards for padding rows)."""
  flat = idx.reshape(-1).astype(jnp.int32)
  return flat, jnp.where(flat >= 0, flat // e_local, num_shards)


def _by_capacity(x, idx, gates, wg, wu, wd, *, axes, num_shards, capacity, dtype):
  n, k = idx.shape
  e_local, d = wg.shape[0], x.shape[-1]
  num_experts = e_local * num_shards
  keys, valid, _, rank = experts_lib.rank_by_expert(idx, 0, num_experts)  # idx -1: not valid
  keep = valid & (rank < capacity)
  rows = num_experts * capacity
  slot = jnp.where(keep, keys * capacity + rank, rows)  # expert-major; out of range: not sent
  src = x[jnp.arange(n * k) // k].astype(dtype)
  send = jnp.zeros((rows, d), dtype).at[slot].set(src, mode="drop")
  recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)  # block s: shard s's rows, my experts
  buf = recv.reshape(num_shards, e_local, capacity, d).swapaxes(0, 1)
  y = experts_lib.expert_ffn(buf.reshape(e_local, num_shards * capacity, d), wg, wu, wd,
                             dtype=dtype)
  y = y.reshape(e_local, num_shards, capacity, d).swapaxes(0, 1).reshape(rows, d)
  back = jax.lax.all_to_all(y, axes, 0, 0, tiled=True)
  y_assign = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)
  return experts_lib.combine(y_assign, gates, keep, dtype)


def _padded(x, idx, gates, wg, wu, wd, *, axes, num_shards, capacity, local_experts, dtype):
  n, k = idx.shape
  e_local, d = wg.shape[0], x.shape[-1]
  flat, dest = _destinations(idx, e_local, num_shards)
  # Rank of each assignment among this device's assignments to the same shard, (token, k) order.
  _, _, _, rank = experts_lib.rank_by_expert(dest, 0, num_shards)
  keep = (dest < num_shards) & (rank < capacity)  # rank < capacity always: the worst case
  rows = num_shards * capacity
  slot = jnp.where(keep, dest * capacity + rank, rows)
  src = x[jnp.arange(n * k) // k].astype(dtype)
  send_x = jnp.zeros((rows, d), dtype).at[slot].set(src, mode="drop")
  send_e = jnp.full((rows,), -1, jnp.int32).at[slot].set(flat, mode="drop")  # -1: empty row
  recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True)  # block s: what shard s sent
  recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True)
  offset = jax.lax.axis_index(axes) * e_local
  y_recv = local_experts(recv_x, recv_e[:, None], jnp.ones((rows, 1), jnp.float32), wg, wu, wd,
                         offset)  # empty rows (id -1) are no local expert's: zeros
  y_back = jax.lax.all_to_all(y_recv, axes, 0, 0, tiled=True)
  y_assign = jnp.take(y_back, slot, axis=0, mode="fill", fill_value=0)
  return experts_lib.combine(y_assign, gates, keep, dtype)


def _ragged(x, idx, gates, wg, wu, wd, *, axes, num_shards, rows, local_experts, dtype):
  n, k = idx.shape
  e_local, d = wg.shape[0], x.shape[-1]
  flat, dest = _destinations(idx, e_local, num_shards)
  order = jnp.argsort(dest, stable=True)  # grouped by destination, padding rows last
  send_sizes = jnp.bincount(dest, length=num_shards + 1)[:num_shards].astype(jnp.int32)
  input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
  me = jax.lax.axis_index(axes)
  counts = jax.lax.all_gather(send_sizes, axes)  # [source, destination]
  before = (jnp.cumsum(counts, axis=0) - counts).astype(jnp.int32)  # rows of lower sources
  recv_sizes = counts[:, me]
  output_offsets = before[me]  # where my rows land on each destination
  recv_offsets = before[:, me]  # where each source's rows sit in my buffer
  return_offsets = jax.lax.all_gather(input_offsets, axes)[:, me]  # ... and in the source's
  xs = x[order // k].astype(dtype)
  recv_x = ragged_all_to_all(xs, jnp.zeros((rows, d), dtype), input_offsets, send_sizes,
                             output_offsets, recv_sizes, axis_name=axes)
  recv_e = ragged_all_to_all(flat[order], jnp.full((rows,), -1, jnp.int32), input_offsets,
                             send_sizes, output_offsets, recv_sizes, axis_name=axes)
  y_recv = local_experts(recv_x, recv_e[:, None], jnp.ones((rows, 1), jnp.float32), wg, wu, wd,
                         me * e_local)  # rows past the received ones (id -1): zeros
  y_sorted = ragged_all_to_all(y_recv, jnp.zeros((n * k, d), dtype), recv_offsets, recv_sizes,
                               return_offsets, send_sizes, axis_name=axes)
  y_assign = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
  return experts_lib.combine(y_assign, gates, dest < num_shards, dtype)


def routed_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, *, exchange: str,
                   capacity_factor: Optional[float] = None,
                   local_experts: Optional[LocalExperts] = None, dtype=jnp.float32) -> jax.Array:
  """Routed experts, expert-parallel over the active mesh (`jax.set_mesh`).

  Args:
    x: [N, D] tokens, sharded over the batch axes or replicated.
    idx, gates: [N, k] routing (global expert ids, gate weights), computed outside.
    w_gate, w_up, w_down: all E experts' weights ([E, D, I], [E, D, I], [E, I, D]), split
      over the expert axis (and mlp over tensor) by the logical-axis table.
    exchange: "capacity", "padded" or "ragged" (`choose_exchange`).
    capacity_factor: the "capacity" exchange's per-expert capacity (`experts.capacity_for`);
      must be None for the dropless forms.
    local_experts: what the dropless forms run on the rows a shard received
      (`dropless_local_experts`).
    dtype: compute dtype; rows travel in it.

  Returns:
    [N, D] in `dtype`, sharded like x's batch. N need not divide over the devices: it is padded
    with rows routed nowhere (they take buffer rows in the padded forms, never output).
  """
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
  if (exchange == "capacity") != (capacity_factor is not None):
    raise ValueError(f"the {exchange!r} exchange takes capacity_factor "
                     f"{'> 0' if exchange == 'capacity' else 'None'}, got {capacity_factor}")
  if exchange != "capacity" and local_experts is None:
    raise ValueError(f"the {exchange!r} exchange needs local_experts")
  mesh = jax.sharding.get_abstract_mesh()
  expert_axes = sharding.mesh_axes("exp")
  tensor_axes = tuple(a for a in sharding.mesh_axes("mlp") if mesh.shape.get(a, 1) > 1)
  # Tensor axes of size one are named in the token spec rather than summed over: splitting over
  # them splits nothing, and a psum over them would leave a trivial all-reduce in the program.
  unit_axes = tuple(a for a in sharding.mesh_axes("mlp") if mesh.shape.get(a, 0) == 1)
  token_axes = tuple(dict.fromkeys(sharding.mesh_axes("batch") + expert_axes + unit_axes))
  num_shards = sharding.axes_size(mesh, expert_axes)
  num_experts = w_gate.shape[0]
  if num_experts % num_shards:
    raise ValueError(f"{num_experts} experts do not split over {num_shards} expert shards")
  n, k = idx.shape
  token_shards = sharding.axes_size(mesh, token_axes)
  pad = -n % token_shards
  if pad:  # e.g. one decode row: rows routed nowhere fill the last devices
    x = jnp.pad(x, ((0, pad), (0, 0)))
    idx = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=-1)
    gates = jnp.pad(gates, ((0, pad), (0, 0)))
  n_local = (n + pad) // token_shards

  def shard_fn(x, idx, gates, wg, wu, wd):
    kw = dict(axes=expert_axes, num_shards=num_shards, dtype=dtype)
    if exchange == "capacity":
      cap = experts_lib.capacity_for(n_local, k, num_experts, capacity_factor)
      y = _by_capacity(x, idx, gates, wg, wu, wd, capacity=cap, **kw)
    elif exchange == "padded":
      cap = padded_capacity(n_local, k, num_experts, num_shards)
      y = _padded(x, idx, gates, wg, wu, wd, capacity=cap, local_experts=local_experts, **kw)
    else:
      rows = num_shards * padded_capacity(n_local, k, num_experts, num_shards)
      y = _ragged(x, idx, gates, wg, wu, wd, rows=rows, local_experts=local_experts, **kw)
    # Tensor parallelism: each tensor shard summed its part of the mlp dim.
    return jax.lax.psum(y, tensor_axes) if tensor_axes else y

  tok = P(token_axes, None)  # tokens: split over batch and expert axes, replicated over tensor
  gate_up = sharding.logical_to_spec(("exp", None, "mlp"))  # embed gathered (replicated)
  down = sharding.logical_to_spec(("exp", "mlp", None))  # likewise
  y = jax.shard_map(shard_fn, in_specs=(tok, tok, tok, gate_up, gate_up, down),
                    out_specs=tok)(x, idx, gates, w_gate, w_up, w_down)
  return y[:n] if pad else y


def psum_experts(x: jax.Array, idx: jax.Array, gates: jax.Array, w_gate: jax.Array,
                 w_up: jax.Array, w_down: jax.Array, *, local_experts: LocalExperts) -> jax.Array:
  """The baseline without an exchange: every expert shard sees all tokens of its batch shard.

  Each shard computes its experts' contributions (`local_experts` with the shard's offset,
  assignments to other shards give zero) and one psum over (expert, tensor) adds them up, so
  communication and activation memory grow with the expert axis. Kept as a benchmark baseline
  (`ModelConfig.expert_dispatch = "psum"`), and what runs when the expert axis has size one,
  where it is plain tensor parallelism (a psum over tensor).
  """
  mesh = jax.sharding.get_abstract_mesh()
  expert_axes = sharding.mesh_axes("exp")
  reduce_axes = tuple(a for a in expert_axes + sharding.mesh_axes("mlp") if a in mesh.shape)
  batch = sharding.mesh_axes("batch")
  if x.shape[0] % sharding.axes_size(mesh, batch):
    batch = None  # too few tokens to split (e.g. a single decode row): replicate them

  def shard_fn(x, idx, gates, wg, wu, wd):
    offset = jax.lax.axis_index(expert_axes) * wg.shape[0]
    return jax.lax.psum(local_experts(x, idx, gates, wg, wu, wd, offset), reduce_axes)

  tok = P(batch, None)  # tokens: split over batch axes, replicated over expert and tensor
  gate_up = sharding.logical_to_spec(("exp", None, "mlp"))  # embed gathered (replicated)
  down = sharding.logical_to_spec(("exp", "mlp", None))  # likewise
  return jax.shard_map(shard_fn, in_specs=(tok, tok, tok, gate_up, gate_up, down),
                       out_specs=tok)(x, idx, gates, w_gate, w_up, w_down)
