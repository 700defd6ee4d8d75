"""The MoE decoder: embeddings, decoder layers (attention + dense or MoE feed-forward), LM head.

`MoEDecoder.__call__` returns a `ModelOutput` whose `routing` field records, for every MoE layer
and token, the experts used ([moe_layers, B, T, k], a compact integer dtype). Passing that array
back as `routing=` replays exactly those experts (router replay), which is how the learner makes
its forward agree with the sampler's.

The model runs whole sequences only (training, scoring, the reference forward in tests). Token by
token decoding is the sampler's: `rollout.forward` on its slot KV cache (`rollout.kv_cache`),
tested against this model's full forward.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from moe import layers
from moe.attention import Attention
from moe.config import ModelConfig
from moe.moe_block import MoEBlock


@flax.struct.dataclass
class ModelOutput:
  """logits [B, T, V] float32; routing [moe_layers, B, T, k]; aux losses."""
  logits: jax.Array
  routing: jax.Array
  aux: Any = None


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h)) with a dense or MoE ffn."""

  def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
    pd = cfg.jnp_param_dtype
    self.is_moe = moe
    self.attn_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.ffn_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    if moe:
      self.ffn = MoEBlock(cfg, rngs=rngs)
    else:
      self.ffn = layers.MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, std=cfg.init_std,
                            param_dtype=pd, dtype=cfg.jnp_dtype)

  def __call__(self, x, positions, segment_ids, routing, token_mask):
    a = self.attn(self.attn_norm(x), positions, segment_ids)
    h = x + a.astype(x.dtype)
    if self.is_moe:
      f, idx, aux = self.ffn(self.ffn_norm(h), routing, token_mask)
    else:
      f, idx, aux = self.ffn(self.ffn_norm(h)), None, None
    return h + f.astype(h.dtype), idx, aux


class MoEDecoder(nnx.Module):
  """Decoder-only MoE transformer."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    pd = cfg.jnp_param_dtype
    self.embed = layers.param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                              std=cfg.init_std, dtype=pd)
    self.layers = nnx.List([DecoderLayer(cfg, moe=i >= cfg.first_k_dense, rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.final_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = layers.param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  std=cfg.init_std, dtype=pd)

  def __call__(self, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
               segment_ids: Optional[jax.Array] = None, routing: Optional[jax.Array] = None,
               token_mask: Optional[jax.Array] = None) -> ModelOutput:
    """Runs the model.

    Args:
      tokens: int [B, T] token ids.
      positions: int [B, T]; defaults to 0..T-1 in every row. Packed rows pass positions that
        restart at each segment.
      segment_ids: int [B, T] packing segments (attention stays within a segment).
      routing: optional [moe_layers, B, T, k] expert indices to replay.
      token_mask: optional [B, T] 1 for real tokens; weights the router's auxiliary losses.

    Returns:
      ModelOutput(logits float32 [B, T, V], routing [moe_layers, B, T, k], aux) where aux
      holds summed `load_balance_loss`, `router_z_loss` and `expert_counts` [moe_layers, E].
    """
    cfg = self.config
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if routing is not None:
      want = (cfg.num_moe_layers, b, t, cfg.num_experts_per_tok)
      if tuple(routing.shape) != want:
        raise ValueError(f"routing has shape {tuple(routing.shape)}, expected {want} "
                         "([moe_layers, batch, length, k])")
    x = jnp.take(self.embed.get_value(), tokens, axis=0).astype(cfg.jnp_dtype)
    chosen, auxes = [], []
    for i, layer in enumerate(self.layers):
      moe_i = i - cfg.first_k_dense
      layer_routing = None if routing is None or moe_i < 0 else routing[moe_i]
      x, idx, aux = layer(x, positions, segment_ids, layer_routing, token_mask)
      if idx is not None:
        chosen.append(idx.astype(cfg.routing_dtype))
        auxes.append(aux)
    h = self.final_norm(x)
    head = self.embed.get_value().T if self.lm_head is None else self.lm_head.get_value()
    hdt = jnp.float32 if cfg.fp32_lm_head else cfg.jnp_dtype
    logits = jnp.dot(h.astype(hdt), head.astype(hdt),
                     preferred_element_type=jnp.float32).astype(jnp.float32)
    if chosen:
      routing_out = jnp.stack(chosen)
      aux = {
          "load_balance_loss": sum(a["load_balance_loss"] for a in auxes),
          "router_z_loss": sum(a["router_z_loss"] for a in auxes),
          "expert_counts": jnp.stack([a["expert_counts"] for a in auxes]),
      }
    else:
      routing_out = jnp.zeros((0, b, t, cfg.num_experts_per_tok), cfg.routing_dtype)
      aux = {"load_balance_loss": jnp.zeros(()), "router_z_loss": jnp.zeros(()),
             "expert_counts": jnp.zeros((0, cfg.num_experts))}
    return ModelOutput(logits=logits, routing=routing_out, aux=aux)

  def aux_loss(self, out: ModelOutput) -> jax.Array:
    """Weighted router losses to add to the training objective."""
    cfg = self.config
    return (cfg.load_balance_loss_weight * out.aux["load_balance_loss"]
            + cfg.router_z_loss_weight * out.aux["router_z_loss"])
