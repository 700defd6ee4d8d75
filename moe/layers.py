"""Small building blocks: parameter helper, RMSNorm, embeddings, RoPE, the dense SwiGLU MLP."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str | None], *,
          std: float, dtype) -> nnx.Param:
  """A normal-initialised parameter annotated with its logical axes (see moe/sharding.py)."""
  value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32 (as Mixtral/Qwen/DeepSeek do)."""

  def __init__(self, dim: int, *, eps: float, param_dtype, logical_axis: str = "embed"):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(logical_axis,))

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.eps)
    return (self.scale.get_value().astype(jnp.float32) * y).astype(dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split (GPT-NeoX / Hugging Face `rotate_half`) layout.

  Args:
    x: [B, T, H, D].
    positions: [B, T] integer positions.
    theta: RoPE base.
  """
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, std: float,
               param_dtype, dtype):
    self.dtype = dtype
    self.gate = param(rngs, (hidden, intermediate), ("embed", "mlp"), std=std, dtype=param_dtype)
    self.up = param(rngs, (hidden, intermediate), ("embed", "mlp"), std=std, dtype=param_dtype)
    self.down = param(rngs, (intermediate, hidden), ("mlp", "embed"), std=std, dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    g = x @ self.gate.get_value().astype(self.dtype)
    u = x @ self.up.get_value().astype(self.dtype)
    return (jax.nn.silu(g) * u) @ self.down.get_value().astype(self.dtype)
