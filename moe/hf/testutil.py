"""Tiny random Hugging Face checkpoints and reference forwards for the parity tests.

Test-only (imports torch and transformers). Every model is built from a config the test defines,
seeded with `torch.manual_seed`, and saved locally: nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 128


def mixtral_config(**kw) -> transformers.MixtralConfig:
  base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=128, rope_theta=1e6,
              initializer_range=0.1, rms_norm_eps=1e-5)
  base.update(kw)
  return transformers.MixtralConfig(**base)


def qwen3_config(**kw) -> transformers.Qwen3MoeConfig:
  """Qwen3-MoE with qk-norm, head_dim != hidden/heads, 8 experts, first layer dense."""
  base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=1,
              norm_topk_prob=False, max_position_embeddings=128, initializer_range=0.1,
              rms_norm_eps=1e-6)
  base.update(kw)
  return transformers.Qwen3MoeConfig(**base)


def make_model(config, seed: int = 0, dtype=torch.float32):
  """A seeded random transformers model in eval mode (eager attention, for a plain reference)."""
  torch.manual_seed(seed)
  config._attn_implementation = "eager"
  cls = (transformers.MixtralForCausalLM if isinstance(config, transformers.MixtralConfig)
         else transformers.Qwen3MoeForCausalLM)
  model = cls(config).to(dtype).eval()
  # Norm weights initialise to one; perturb them so a swapped or dropped norm cannot pass.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.1 * torch.randn_like(p))
  return model


def save(model, path, **kw) -> str:
  model.save_pretrained(path, **kw)
  return str(path)


def load(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def tokens(batch: int = 2, length: int = 9, seed: int = 0) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def forward(model, toks: np.ndarray):
  """(logits float32 [B, T, V], top-k experts [moe_layers, B, T, k] sorted ascending)."""
  b, t = toks.shape
  with torch.no_grad():
    out = model(torch.tensor(toks, dtype=torch.long), output_router_logits=True)
  k = model.config.num_experts_per_tok
  topk = [torch.topk(r.float(), k, dim=-1).indices.numpy().reshape(b, t, k)
          for r in out.router_logits]
  return out.logits.float().numpy(), np.sort(np.stack(topk), axis=-1)
