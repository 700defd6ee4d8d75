"""The routed-expert paths compute the same function: grouped (padded blocks) against dropless
dispatch, forward and gradients, under balanced and skewed routing and on an expert shard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe import experts

D, I, E, K = 16, 24, 4, 2


def _inputs(n, seed=0, skew=False):
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (n, D))
  if skew:  # every token picks experts 2 and 3: two groups, two empty experts
    idx = jnp.tile(jnp.array([[2, 3]], jnp.int32), (n, 1))
  else:
    idx = jnp.argsort(jax.random.uniform(ks[1], (n, E)), axis=-1)[:, :K].astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(ks[2], (n, K)), axis=-1)
  w = [jax.random.normal(ks[3], (E, D, I)) * 0.3, jax.random.normal(ks[4], (E, D, I)) * 0.3,
       jax.random.normal(ks[5], (E, I, D)) * 0.3]
  return x, idx, gates, w


def _dispatch(x, idx, gates, wg, wu, wd, offset=0):
  return experts.dispatch_experts(x, idx, gates, wg, wu, wd, dtype=jnp.float32,
                                  capacity=x.shape[0], expert_offset=offset)


def _grouped(block):
  def f(x, idx, gates, wg, wu, wd, offset=0):
    return experts.grouped_experts(x, idx, gates, wg, wu, wd, dtype=jnp.float32, block=block,
                                   expert_offset=offset)
  return f


@pytest.mark.parametrize("n,block,skew", [(37, 8, False), (37, 8, True), (64, 16, False),
                                          (5, 128, False), (1, 4, True)])
def test_grouped_equals_dropless_dispatch(n, block, skew):
  x, idx, gates, (wg, wu, wd) = _inputs(n, seed=n, skew=skew)
  want = _dispatch(x, idx, gates, wg, wu, wd)
  got = _grouped(block)(x, idx, gates, wg, wu, wd)
  assert float(jnp.abs(want).max()) > 0.1  # a real output, not zeros on both sides
  np.testing.assert_allclose(got, want, atol=1e-5)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a, idx=idx)))

  def wrap(fn):
    return lambda x, gates, wg, wu, wd, idx: fn(x, idx, gates, wg, wu, wd)

  g_want = jax.grad(loss(wrap(_dispatch)), argnums=(0, 1, 2, 3, 4))(x, gates, wg, wu, wd)
  g_got = jax.grad(loss(wrap(_grouped(block))), argnums=(0, 1, 2, 3, 4))(x, gates, wg, wu, wd)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-4)
  if skew:  # experts nobody picked get no gradient
    assert float(jnp.abs(g_got[2][:2]).max()) == 0.0


def test_grouped_on_an_expert_shard_computes_only_its_experts():
  x, idx, gates, (wg, wu, wd) = _inputs(29, seed=3)
  full = _dispatch(x, idx, gates, wg, wu, wd)
  parts = [_grouped(8)(x, idx, gates, wg[o:o + 2], wu[o:o + 2], wd[o:o + 2], offset=o)
           for o in (0, 2)]
  for o, part in zip((0, 2), parts):
    np.testing.assert_allclose(part, _dispatch(x, idx, gates, wg[o:o + 2], wu[o:o + 2],
                                               wd[o:o + 2], offset=o), atol=1e-5)
  np.testing.assert_allclose(parts[0] + parts[1], full, atol=1e-5)
  assert float(jnp.abs(parts[0] - full).max()) > 1e-3  # each shard alone is not the whole


def test_grouped_is_deterministic_under_jit():
  x, idx, gates, w = _inputs(200, seed=7)
  f = jax.jit(_grouped(32))
  a, b = f(x, idx, gates, *w), f(x, idx, gates, *w)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_count_covers_the_worst_routing():
  # Every expert with one row past a whole block: the most blocks any routing needs.
  for a, e, block in [(8 * 5 + 4, 4, 8), (7, 4, 8), (128, 8, 16), (1, 1, 4)]:
    worst = max(sum(-(-c // block) for c in counts) for counts in _splits(a, e))
    assert experts.grouped_blocks(a, e, block) >= worst


def _splits(a, e):
  """A few extreme ways to split `a` assignments over `e` experts."""
  yield [a] + [0] * (e - 1)
  base, rest = divmod(a, e)
  yield [base + (i < rest) for i in range(e)]
  ones = [1] * min(e - 1, a)
  yield ones + [a - len(ones)] + [0] * (e - 1 - len(ones))


def test_dropless_cpu_impl_picks_the_smaller_buffer():
  assert experts.dropless_cpu_impl(16, 2, 8) == "dispatch"  # decoding a few rows
  assert experts.dropless_cpu_impl(4096, 2, 8) == "grouped"  # a training batch
  # The boundary: grouped rows against experts * tokens.
  n = 512
  rows = experts.grouped_blocks(n * 2, 8, experts.GROUPED_BLOCK) * experts.GROUPED_BLOCK
  assert (experts.dropless_cpu_impl(n, 2, 8) == "grouped") == (rows < 8 * n)
