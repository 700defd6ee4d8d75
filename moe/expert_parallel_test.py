"""Expert parallelism by all-to-all (moe/expert_parallel.py) on 8 CPU devices.

One MoE block of tiny.gin's shape (hidden 128, expert width 128, 8 experts, top-2) on 192 tokens,
sharded over meshes (data, fsdp, expert, tensor) with 2, 4 and 8 expert shards, against the same
block on one device.

Tolerance policy (fp32): the sharded program computes the same sums in other groupings: a
device's matmuls see other buffer shapes (XLA:CPU blocks the contraction differently), a split
tensor axis adds the mlp dim's partial sums across devices, and parameter gradients add per-device
partial sums over tokens. Each reassociated sum of m terms is off by at most ~m u |terms|
(u = 2^-24 ~ 6e-8); the longest sums here are a gradient's over 192 tokens x 2 choices and a
forward's over 128 mlp columns, so differences are bounded well below 1e-4 of the array's
largest entry. We assert 2e-5 of it (max |a - b| <= 2e-5 max |b|): the bound's typical size
(sqrt(m) u ~ 1e-6) with margin, and far below any real error (a dropped or misrouted assignment
moves outputs by O(1) of their scale). Routing must be identical: the router runs outside the
exchange on the same tokens.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moe import expert_parallel, experts, moe_block, sharding  # noqa: E402
from moe.config import ModelConfig  # noqa: E402

REL_TOL = 2e-5
# tiny.gin's MoE layer: hidden 128, expert width 128, 8 experts, top-2 softmax router.
CFG = ModelConfig(hidden_size=128, moe_intermediate_size=128, num_experts=8,
                  num_experts_per_tok=2, init_std=0.2)
B, T, D, E = 4, 48, 128, 8  # 192 tokens: 24 per device when split 8 ways
X = jax.random.normal(jax.random.key(1), (B, T, D))
W = jax.random.normal(jax.random.key(2), (B, T, D))  # the loss's fixed cotangent


def _block(cfg):
  return nnx.split(moe_block.MoEBlock(cfg, rngs=nnx.Rngs(0)))


def _train_fn(graphdef):
  """(y, routing, grads of a scalar loss wrt all parameters): one training step's block work."""
  def f(state, x, w):
    def loss(state):
      y, idx, aux = nnx.merge(graphdef, state)(x)
      return jnp.sum(y * w) + aux["load_balance_loss"] + aux["router_z_loss"], (y, idx)
    (_, (y, idx)), grads = jax.value_and_grad(loss, has_aux=True)(state)
    return y, idx, grads
  return f


def _replay_fn(graphdef):
  def f(state, x, routing):
    y, idx, _ = nnx.merge(graphdef, state)(x, routing)
    return y, idx
  return f


@functools.lru_cache(maxsize=None)
def _sharded(shape, capacity_factor=None, dispatch="all_to_all"):
  """(graphdef, mesh, sharded state, sharded x) of the block on a mesh of `shape`."""
  cfg = CFG.replace(capacity_factor=capacity_factor, expert_dispatch=dispatch)
  graphdef, state = _block(cfg)
  mesh = sharding.make_mesh(shape)
  with jax.set_mesh(mesh):
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    x = jax.device_put(X, NamedSharding(mesh, sharding.batch_spec(3)))
  return graphdef, mesh, state, x


@functools.lru_cache(maxsize=None)
def _train(shape, capacity_factor=None, dispatch="all_to_all"):
  """The compiled training-step program (`_train_fn`) on a mesh of `shape`."""
  graphdef, mesh, state, x = _sharded(shape, capacity_factor, dispatch)
  with jax.set_mesh(mesh):
    return jax.jit(_train_fn(graphdef)).lower(state, x, x).compile()


@functools.lru_cache(maxsize=None)
def _replay(shape, capacity_factor=None):
  graphdef, mesh, state, x = _sharded(shape, capacity_factor)
  routing = jax.ShapeDtypeStruct((B, T, CFG.num_experts_per_tok), jnp.int32, sharding=x.sharding)
  with jax.set_mesh(mesh):
    return jax.jit(_replay_fn(graphdef)).lower(state, x, routing).compile()


@functools.lru_cache(maxsize=None)
def _reference():
  graphdef, state = _block(CFG)
  return jax.jit(_train_fn(graphdef))(state, X, W)


def _close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  scale = float(np.abs(want).max())
  assert scale > 0, what
  err = float(np.abs(got - want).max())
  assert err <= REL_TOL * scale, f"{what}: max |diff| {err:.3g} > {REL_TOL} x {scale:.3g}"


# data/fsdp/expert/tensor: 2, 4, 8 expert shards, with fsdp, and one with the tensor axis too.
# capacity_factor None is dropless (the "padded" exchange on the CPU); 8.0 gives per-expert
# capacities of all the device's tokens (the "capacity" exchange, nothing can drop).
@pytest.mark.parametrize("shape,cf", [((1, 1, 2, 1), None), ((1, 1, 4, 1), None),
                                      ((1, 1, 8, 1), None), ((1, 2, 4, 1), None),
                                      ((1, 4, 2, 1), None), ((1, 1, 4, 2), None),
                                      ((1, 1, 8, 1), 8.0), ((1, 2, 4, 1), 8.0)])
def test_sharded_block_matches_single_device(shape, cf):
  """Forward output, routing and every parameter's gradient equal the single-device block's;
  a forward replaying the recorded routing reproduces the recorded output."""
  want_y, want_idx, want_grads = _reference()
  _, mesh, state, x = _sharded(shape, cf)
  with jax.set_mesh(mesh):
    y, idx, grads = _train(shape, cf)(state, x, jax.device_put(W, x.sharding))
    y_replay, idx_replay = _replay(shape, cf)(state, x, jax.device_put(idx, x.sharding))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  _close(y, want_y, "output")
  flat_want = dict(nnx.to_flat_state(want_grads))
  flat_got = dict(nnx.to_flat_state(grads))
  assert flat_got.keys() == flat_want.keys()
  for k in flat_want:
    _close(flat_got[k].get_value(), flat_want[k].get_value(), f"gradient {k}")
  np.testing.assert_array_equal(np.asarray(idx_replay), np.asarray(idx))
  _close(y_replay, y, "replayed output")


def _experts_and_routing(cfg):
  graphdef, state = _block(cfg)
  block = nnx.merge(graphdef, state)
  xf = X.reshape(B * T, D)
  idx, gates, _ = block.router(xf)
  ws = (block.experts.gate.get_value(), block.experts.up.get_value(),
        block.experts.down.get_value())
  return xf, idx, gates, ws


def test_capacity_drops_as_dispatch_on_each_device():
  """With a tight capacity factor, each device drops exactly what `dispatch_experts` run on its
  own tokens with the same per-expert capacity drops (dropped assignments contribute zero), and
  drops did happen."""
  cf, shape = 0.5, (1, 1, 4, 1)
  xf, idx, gates, ws = _experts_and_routing(CFG)
  n_local = B * T // 4
  cap = experts.capacity_for(n_local, 2, E, cf)
  want = jnp.concatenate([
      experts.dispatch_experts(xf[s:s + n_local], idx[s:s + n_local], gates[s:s + n_local], *ws,
                               dtype=jnp.float32, capacity=cap)
      for s in range(0, B * T, n_local)])
  dropless = experts.dispatch_experts(xf, idx, gates, *ws, dtype=jnp.float32, capacity=B * T)
  mesh = sharding.make_mesh(shape)
  with jax.set_mesh(mesh):
    specs = [sharding.logical_to_spec(a) for a in (("exp", "embed", "mlp"),) * 2
             + (("exp", "mlp", "embed"),)]
    ws_sharded = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(ws, specs)]
    got = jax.jit(functools.partial(expert_parallel.routed_experts, exchange="capacity",
                                    capacity_factor=cf))(xf, idx, gates, *ws_sharded)
  _close(got, want, "capacity output")
  dropped_rows = np.abs(np.asarray(want) - np.asarray(dropless)).max(axis=1) > 1e-3
  assert dropped_rows.sum() >= 8, "the capacity factor should have dropped assignments"


# --- the ragged exchange ---------------------------------------------------------------------


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's documented semantics from all_gather and gathers (fixed shapes),
  for XLA:CPU, which has no ragged-all-to-all. recv_sizes is implied by the senders' sizes."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [sources, rows, ...]
  starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # source s's slice for me
  sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  dests = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # ... lands here in my output
  r = jnp.arange(output.shape[0])
  result = output
  for s in range(ops.shape[0]):
    inside = (r >= dests[s]) & (r < dests[s] + sizes[s])
    rows = jnp.clip(starts[s] + r - dests[s], 0, operand.shape[0] - 1)
    inside = inside.reshape((-1,) + (1,) * (operand.ndim - 1))
    result = jnp.where(inside, ops[s][rows], result)
  return result


def test_emulation_follows_the_documented_example():
  """The example of jax.lax.ragged_all_to_all's docstring, on an axis of size 2."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

  def f(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                      output_offsets, recv_sizes, axis_name="x")

  args = [np.array(a, np.int32) for a in (
      [1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]
  got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))(*args)
  np.testing.assert_array_equal(np.asarray(got), [1, 3, 0, 0, 2, 2, 4, 0])


def _routed_fn(exchange):
  def f(xf, idx, gates, wg, wu, wd):
    def loss(args):
      return jnp.sum(expert_parallel.routed_experts(
          args[0], idx, gates, *args[1:], exchange=exchange,
          local_experts=expert_parallel.dropless_local_experts("auto", jnp.float32)) ** 2)
    return jax.value_and_grad(loss)((xf, wg, wu, wd))
  return f


def _sharded_inputs(mesh):
  xf, idx, gates, ws = _experts_and_routing(CFG)
  specs = [sharding.logical_to_spec(a) for a in (("exp", "embed", "mlp"),) * 2
           + (("exp", "mlp", "embed"),)]
  ws = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(ws, specs)]
  tok = NamedSharding(mesh, sharding.batch_spec(2))
  return [jax.device_put(a, tok) for a in (xf, idx, gates)] + ws


def test_ragged_exchange_matches_padded_with_an_emulated_collective(monkeypatch):
  """The ragged form's offsets and sizes, run with `emulated_ragged_all_to_all` in place of the
  collective XLA:CPU lacks: loss and gradients (tokens and weights) equal the padded form's."""
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with jax.set_mesh(mesh):
    args = _sharded_inputs(mesh)
    want_loss, want_grads = jax.jit(_routed_fn("padded"))(*args)
    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
    loss, grads = jax.jit(_routed_fn("ragged"))(*args)
  _close(loss, want_loss, "loss")
  for g, w in zip(grads, want_grads):
    _close(g, w, "gradient")


def test_ragged_exchange_is_chosen_off_the_cpu_and_lowers():
  """Dropless layers pick the ragged exchange on GPU/TPU, the padded one on the CPU, and the
  capacity layout whenever a capacity factor is set. The ragged program (forward and backward)
  lowers here to StableHLO with the ragged_all_to_all custom call; XLA:CPU cannot compile it
  (its ThunkEmitter has no `ragged-all-to-all`), so its numbers are checked with the emulation
  above and its code generation only on GPU/TPU."""
  assert expert_parallel.choose_exchange("gpu", None) == "ragged"
  assert expert_parallel.choose_exchange("tpu", None) == "ragged"
  assert expert_parallel.choose_exchange("cpu", None) == "padded"
  assert expert_parallel.choose_exchange("gpu", 1.25) == "capacity"
  assert expert_parallel.choose_exchange("cpu", 1.25) == "capacity"
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with jax.set_mesh(mesh):
    text = jax.jit(_routed_fn("ragged")).lower(*_sharded_inputs(mesh)).as_text()
  # Two exchanges out (rows, expert ids) and one back; the backward adds the transposes.
  assert text.count("stablehlo.custom_call @ragged_all_to_all") >= 4, text[:2000]


# --- the compiled program --------------------------------------------------------------------


def _replica_groups(line, num_devices):
  """The device groups of one collective in XLA's HLO text (explicit, iota or mesh form)."""
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if m:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    shape, dims = ([int(v) for v in g.split(",")] for g in m.groups()[:2])
    ids = np.arange(num_devices).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(2))]
    ids = np.arange(num_devices).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in over]
    return ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[i] for i in over]))).tolist()
  raise AssertionError(f"no replica groups understood in: {line[:300]}")


def _all_reduces(text, mesh_shape):
  """[(operand shapes, expert coordinates spanned by some group?)] of every all-reduce."""
  coords = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
  expert_of = {int(d): int(np.argwhere(coords == d)[0][2]) for d in coords.flat}
  out = []
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) all-reduce(?:-start)?\(", line)
    if not m:
      continue
    shapes = [tuple(int(v) for v in dims.split(",") if v)
              for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))]
    groups = _replica_groups(line, coords.size)
    spans = any(len({expert_of[d] for d in g}) > 1 for g in groups)
    out.append((shapes, spans))
  return out


# The router runs outside the exchange; XLA splits its work over the tokens' devices, so its
# reductions over tokens (expert counts [E], the router weight's gradient [D, E]) are
# all-reduced over the expert axis too. Those are router-sized, never [tokens, D].
ROUTER_SIZED = {(), (E,), (D, E), (E, D)}


@pytest.mark.parametrize("shape", [(1, 1, 4, 1), (1, 2, 4, 1), (1, 1, 4, 2)])
def test_program_exchanges_tokens_and_all_reduces_none_over_experts(shape):
  """The training step's compiled program has all-to-alls, and every all-reduce whose device
  groups span two expert shards carries only router-sized operands: no token activations are
  reduced over the expert axis (tensor and fsdp reductions are within their own groups). The
  psum baseline, by contrast, all-reduces [tokens, D] over the expert axis (the detector works)."""
  text = _train(shape).as_text()
  assert re.search(r"all-to-all(-start)?\(", text)
  for shapes, spans in _all_reduces(text, shape):
    if spans:
      assert set(shapes) <= ROUTER_SIZED, shapes
  baseline = _train(shape, dispatch="psum").as_text()
  n_batch = B * T // (shape[0] * shape[1])
  assert any(spans and (n_batch, D) in shapes for shapes, spans in _all_reduces(baseline, shape))


@pytest.mark.parametrize("cf", [None, 1.25])
def test_activation_memory_falls_with_expert_shards(cf):
  """Per-device temporary memory of the training step (XLA's memory_analysis) falls from 2 to 4
  to 8 expert shards for the same 192 tokens, and is below the psum baseline's at 8."""
  temp = {e: _train((1, 1, e, 1), cf).memory_analysis().temp_size_in_bytes for e in (2, 4, 8)}
  baseline = _train((1, 1, 8, 1), cf, "psum").memory_analysis().temp_size_in_bytes
  assert temp[2] > temp[4] > temp[8], temp
  assert temp[8] < baseline, (temp, baseline)


def test_token_count_not_divisible_by_devices():
  """A single row (e.g. one decode step) is padded with rows routed nowhere: same output."""
  graphdef, state = _block(CFG)
  x = X[:1, :5]
  want = _replay_fn(graphdef)(state, x, None)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with jax.set_mesh(mesh):
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    got = jax.jit(_replay_fn(graphdef))(state, x, None)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  _close(got[0], want[0], "output")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
