"""Attention's causal chunks (ModelConfig.attention_query_chunk) against a whole-square reference in
numpy, and the gradients of chunked and one-chunk attention against each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import attention
from moe import layers
from moe.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                  intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                  num_experts_per_tok=2, max_seq_len=64)


def _inputs(b=2, t=45, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(b, t, CFG.hidden_size)).astype(np.float32)
  # Packed rows: segments of uneven lengths, positions restarting in each.
  seg = np.stack([np.repeat([1, 2, 3], [10, 20, t - 30]), np.repeat([1, 2], [31, t - 31])])
  pos = np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)[1:]]) for r in seg])
  return x, pos.astype(np.int32), seg.astype(np.int32)


def _reference(attn, x, pos, seg):
  """The whole [T, T] square in numpy: causal, same segment only."""
  wq, wk, wv, wo = (np.asarray(getattr(attn, n).get_value()) for n in ("q", "k", "v", "o"))
  q = np.einsum("btd,dhk->bthk", x, wq)
  k = np.einsum("btd,dhk->bthk", x, wk)
  v = np.einsum("btd,dhk->bthk", x, wv)
  q = np.asarray(layers.rope(jnp.asarray(q), jnp.asarray(pos), attn.rope_theta))
  k = np.asarray(layers.rope(jnp.asarray(k), jnp.asarray(pos), attn.rope_theta))
  g = attn.num_heads // attn.num_kv_heads
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  t = x.shape[1]
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(attn.head_dim)
  causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
  mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  out = np.einsum("bhts,bshd->bthd", w, v)
  return np.einsum("bthk,hkd->btd", out, wo)


@pytest.mark.parametrize("chunk", [0, 8, 16, 45, 128])
def test_chunked_attention_equals_the_whole_square(chunk):
  attn = attention.Attention(CFG.replace(attention_query_chunk=chunk), rngs=nnx.Rngs(0))
  x, pos, seg = _inputs()
  got = np.asarray(attn(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg)))
  np.testing.assert_allclose(got, _reference(attn, x, pos, seg), rtol=1e-4, atol=1e-5)


def test_chunked_gradients_equal_one_chunk():
  x, pos, seg = _inputs(seed=1)
  cot = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)

  def grads(chunk):
    graphdef, params = nnx.split(attention.Attention(CFG.replace(attention_query_chunk=chunk),
                                                     rngs=nnx.Rngs(1)))

    def loss(params, x):
      y = nnx.merge(graphdef, params)(x, jnp.asarray(pos), jnp.asarray(seg))
      return jnp.sum(y * cot)
    return jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))

  whole, chunked = grads(0), grads(8)  # 0: one chunk, the whole square
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
  assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(whole))


def test_a_negative_chunk_is_refused():
  with pytest.raises(ValueError, match="attention_query_chunk"):
    CFG.replace(attention_query_chunk=-1)
