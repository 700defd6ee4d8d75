"""Tensor-name mapping between Hugging Face MoE checkpoints and our flat parameter names.

Each of our parameters (a `params.flatten` name such as `layers/3/ffn/experts/gate`) is assembled
from one or more *pieces* of Hugging Face tensors. A piece says which HF tensor, which part of it
(an index, e.g. one expert of a fused tensor), where it lands in our parameter (the whole of it,
or one expert of a stacked `[E, ...]` array) and whether it is an `nn.Linear` weight, stored
`[out, in]` by torch and `[in, ..., out...]` by us (so it is transposed, then reshaped).

Two on-disk layouts of the routed experts exist:
  * classic, one tensor per expert (published checkpoints, and what transformers 5.24's
    `save_pretrained` writes by default):
      Mixtral   model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight  (gate, up, down)
                model.layers.N.block_sparse_moe.gate.weight                  (router)
      Qwen3-MoE model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
                model.layers.N.mlp.gate.weight
  * fused, transformers 5's in-memory layout (`save_pretrained(save_original_format=False)`):
      model.layers.N.mlp.experts.gate_up_proj [E, 2I, D] (gate rows first), .down_proj [E, D, I],
      model.layers.N.mlp.gate.weight.
Import reads both; export always writes the classic layout, which every engine reads.

The rest is shared by both architectures (HF name -> ours, HF shape -> our shape):
  model.embed_tokens.weight                  [V, D]     -> embed [V, D]
  lm_head.weight                             [V, D]     -> lm_head [D, V] (absent when tied)
  model.norm.weight                          [D]        -> final_norm/scale
  model.layers.N.input_layernorm.weight      [D]        -> layers/N/attn_norm/scale
  model.layers.N.post_attention_layernorm... [D]        -> layers/N/ffn_norm/scale
  model.layers.N.self_attn.q_proj.weight     [H*hd, D]  -> layers/N/attn/q [D, H, hd]
  model.layers.N.self_attn.{k,v}_proj.weight [kv*hd, D] -> layers/N/attn/{k,v} [D, kv, hd]
  model.layers.N.self_attn.o_proj.weight     [D, H*hd]  -> layers/N/attn/o [H, hd, D]
  model.layers.N.self_attn.{q,k}_norm.weight [hd]       -> layers/N/attn/{q,k}_norm/scale (Qwen3)
  router weight                              [E, D]     -> layers/N/ffn/router/weight [D, E]
  expert gate / up                           [I, D]     -> layers/N/ffn/experts/{gate,up}[e] [D, I]
  expert down                                [D, I]     -> layers/N/ffn/experts/down[e] [I, D]
  model.layers.N.mlp.{gate,up,down}_proj.weight (Qwen3 dense layers, `mlp_only_layers`)
                                                        -> layers/N/ffn/{gate,up,down}
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from moe.config import ModelConfig
from moe.hf.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class ArchSpec:
  """What distinguishes one Hugging Face architecture's checkpoints."""
  model_type: str
  moe_prefix: str  # module holding the router and experts in the classic layout
  expert_weights: tuple[str, str, str]  # per-expert (gate, up, down) names in the classic layout
  qk_norm: bool
  dense_layers: bool  # may the first layers be dense (`mlp_only_layers`)


ARCHITECTURES = {
    "MixtralForCausalLM": ArchSpec(model_type="mixtral", moe_prefix="block_sparse_moe",
                                   expert_weights=("w1", "w3", "w2"), qk_norm=False,
                                   dense_layers=False),
    "Qwen3MoeForCausalLM": ArchSpec(model_type="qwen3_moe", moe_prefix="mlp",
                                    expert_weights=("gate_proj", "up_proj", "down_proj"),
                                    qk_norm=True, dense_layers=True),
}

# Tensors some checkpoints carry that hold no learned weights (old transformers saved RoPE tables).
_IGNORABLE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def arch_spec(arch: str, where: str = "config.json") -> ArchSpec:
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"{where}: unknown architecture {arch!r}; supported: "
                          f"{sorted(ARCHITECTURES)}")
  return ARCHITECTURES[arch]


@dataclasses.dataclass(frozen=True)
class Piece:
  """One HF tensor (or part of one) that fills one of our parameters (or one expert of it).

  Attributes:
    hf_name: the Hugging Face tensor name.
    src: index into the HF tensor (None: all of it), e.g. `(e, slice(0, I))` for expert e's gate
      rows of a fused `gate_up_proj`.
    dst: expert index in our stacked [E, ...] parameter (None: the whole parameter).
    linear: an nn.Linear weight: the HF part is [out, in]; ours is its transpose, reshaped.
  """
  hf_name: str
  src: Optional[tuple] = None
  dst: Optional[int] = None
  linear: bool = True


@dataclasses.dataclass(frozen=True)
class Layout:
  """pieces: our name -> pieces that fill it; hf_shapes: every expected HF tensor's shape."""
  pieces: dict
  hf_shapes: dict
  ignorable: frozenset

  def is_ignorable(self, hf_name: str) -> bool:
    return hf_name in self.ignorable or bool(_IGNORABLE.match(hf_name))


def is_fused(hf_names) -> bool:
  """Whether a checkpoint stores experts fused (`mlp.experts.gate_up_proj`)."""
  return any(n.endswith(".mlp.experts.gate_up_proj") for n in hf_names)


def layout(cfg: ModelConfig, arch: str, *, fused: bool = False) -> Layout:
  """The name and shape mapping of a model with config `cfg` in architecture `arch`."""
  spec = arch_spec(arch)
  d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  e_n, mi = cfg.num_experts, cfg.moe_intermediate_size
  pieces: dict[str, tuple] = {}
  shapes: dict[str, tuple] = {}

  def add(ours, hf_name, hf_shape, *, linear=True):
    pieces[ours] = (Piece(hf_name, linear=linear),)
    shapes[hf_name] = tuple(hf_shape)

  add("embed", "model.embed_tokens.weight", (cfg.vocab_size, d), linear=False)
  add("final_norm/scale", "model.norm.weight", (d,), linear=False)
  ignorable = set()
  if cfg.tie_word_embeddings:
    ignorable.add("lm_head.weight")
  else:
    add("lm_head", "lm_head.weight", (cfg.vocab_size, d))
  for i in range(cfg.num_layers):
    ours, hf = f"layers/{i}", f"model.layers.{i}"
    add(f"{ours}/attn_norm/scale", f"{hf}.input_layernorm.weight", (d,), linear=False)
    add(f"{ours}/ffn_norm/scale", f"{hf}.post_attention_layernorm.weight", (d,), linear=False)
    add(f"{ours}/attn/q", f"{hf}.self_attn.q_proj.weight", (h * hd, d))
    add(f"{ours}/attn/k", f"{hf}.self_attn.k_proj.weight", (kv * hd, d))
    add(f"{ours}/attn/v", f"{hf}.self_attn.v_proj.weight", (kv * hd, d))
    add(f"{ours}/attn/o", f"{hf}.self_attn.o_proj.weight", (d, h * hd))
    if cfg.qk_norm:
      add(f"{ours}/attn/q_norm/scale", f"{hf}.self_attn.q_norm.weight", (hd,), linear=False)
      add(f"{ours}/attn/k_norm/scale", f"{hf}.self_attn.k_norm.weight", (hd,), linear=False)
    if i < cfg.first_k_dense:
      di = cfg.intermediate_size
      add(f"{ours}/ffn/gate", f"{hf}.mlp.gate_proj.weight", (di, d))
      add(f"{ours}/ffn/up", f"{hf}.mlp.up_proj.weight", (di, d))
      add(f"{ours}/ffn/down", f"{hf}.mlp.down_proj.weight", (d, di))
      continue
    if fused:
      add(f"{ours}/ffn/router/weight", f"{hf}.mlp.gate.weight", (e_n, d))
      gate_up, down = f"{hf}.mlp.experts.gate_up_proj", f"{hf}.mlp.experts.down_proj"
      shapes[gate_up], shapes[down] = (e_n, 2 * mi, d), (e_n, d, mi)
      pieces[f"{ours}/ffn/experts/gate"] = tuple(
          Piece(gate_up, src=(e, slice(0, mi)), dst=e) for e in range(e_n))
      pieces[f"{ours}/ffn/experts/up"] = tuple(
          Piece(gate_up, src=(e, slice(mi, 2 * mi)), dst=e) for e in range(e_n))
      pieces[f"{ours}/ffn/experts/down"] = tuple(
          Piece(down, src=(e,), dst=e) for e in range(e_n))
    else:
      moe = f"{hf}.{spec.moe_prefix}"
      add(f"{ours}/ffn/router/weight", f"{moe}.gate.weight", (e_n, d))
      for which, w in zip(("gate", "up", "down"), spec.expert_weights):
        hf_shape = (d, mi) if which == "down" else (mi, d)
        names = [f"{moe}.experts.{e}.{w}.weight" for e in range(e_n)]
        pieces[f"{ours}/ffn/experts/{which}"] = tuple(
            Piece(n, dst=e) for e, n in enumerate(names))
        shapes.update({n: hf_shape for n in names})
  return Layout(pieces=pieces, hf_shapes=shapes, ignorable=frozenset(ignorable))
