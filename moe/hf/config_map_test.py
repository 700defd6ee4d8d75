"""config.json <-> ModelConfig: published configs, transformers 5 spellings, refusals."""

import sys

import pytest

from moe import hf
from moe.config import ModelConfig

# config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B as published (transformers 4).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def _v5(d):
  """The transformers 5 spelling: rope_parameters, dtype, num_local_experts."""
  d = dict(d)
  d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), "rope_type": "default"}
  d["dtype"] = d.pop("torch_dtype")
  if "num_experts" in d:
    d["num_local_experts"] = d.pop("num_experts")
  return d


def test_published_mixtral():
  cfg = hf.config_from_hf(MIXTRAL_8X7B)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.resolved_head_dim) == (32000, 4096, 32, 32, 8, 128)
  assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (14336, 8, 2)
  assert cfg.norm_topk_prob and not cfg.qk_norm and cfg.first_k_dense == 0
  assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-5 and cfg.param_dtype == "bfloat16"
  assert cfg.max_seq_len == 32768 and not cfg.tie_word_embeddings
  assert hf.config_from_hf(_v5(MIXTRAL_8X7B)) == cfg


def test_published_qwen3():
  cfg = hf.config_from_hf(QWEN3_30B_A3B)
  assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.resolved_head_dim) == (2048, 48, 32, 4, 128)
  assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (768, 128, 8)
  assert cfg.norm_topk_prob and cfg.qk_norm and cfg.first_k_dense == 0
  assert cfg.head_dim == 128  # explicit: differs from hidden_size // num_heads (64)
  assert hf.config_from_hf(_v5(QWEN3_30B_A3B)) == cfg


@pytest.mark.parametrize("arch,base", [("MixtralForCausalLM", MIXTRAL_8X7B),
                                       ("Qwen3MoeForCausalLM", QWEN3_30B_A3B)])
def test_to_hf_and_back(arch, base):
  cfg = hf.config_from_hf(base)
  out = hf.config_to_hf(cfg, arch)
  assert out["architectures"] == [arch]
  assert out["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
  assert hf.config_from_hf(out) == cfg


def test_qwen3_dense_layer_patterns():
  base = dict(QWEN3_30B_A3B, num_hidden_layers=4)
  assert hf.config_from_hf(dict(base, mlp_only_layers=[0, 1])).first_k_dense == 2
  two = dict(base, num_hidden_layers=2, decoder_sparse_step=2)  # layer 0 dense, layer 1 MoE
  assert hf.config_from_hf(two).first_k_dense == 1
  cfg = hf.config_from_hf(dict(base, mlp_only_layers=[0]))
  assert hf.config_to_hf(cfg, "Qwen3MoeForCausalLM")["mlp_only_layers"] == [0]
  for bad in (dict(base, mlp_only_layers=[1]), dict(base, decoder_sparse_step=2)):
    with pytest.raises(hf.CheckpointError, match="not a prefix"):
      hf.config_from_hf(bad)


@pytest.mark.parametrize("change,msg", [
    (dict(architectures=["LlamaForCausalLM"]), "unknown architecture"),
    (dict(architectures=None, model_type="llama"), "unknown model_type"),
    (dict(model_type="qwen3_moe"), "does not match"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_theta=None, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
     "rope_type"),
    (dict(sliding_window=4096), "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_attention_heads=None), "num_attention_heads"),
    (dict(num_key_value_heads=5), "multiple of num_kv_heads"),
])
def test_refusals(change, msg):
  bad = {k: v for k, v in dict(MIXTRAL_8X7B, **change).items() if v is not None}
  with pytest.raises(hf.CheckpointError, match=msg):
    hf.config_from_hf(bad)


def test_qwen3_refusals():
  for change, msg in [(dict(attention_bias=True), "attention_bias"),
                      (dict(use_sliding_window=True), "use_sliding_window")]:
    with pytest.raises(hf.CheckpointError, match=msg):
      hf.config_from_hf(dict(QWEN3_30B_A3B, **change))
  # A window that is switched off does not matter.
  assert hf.config_from_hf(dict(QWEN3_30B_A3B, sliding_window=4096)).qk_norm


def test_to_hf_refusals():
  for cfg, arch, msg in [
      (ModelConfig(router_type="sigmoid"), "MixtralForCausalLM", "router_type"),
      (ModelConfig(routed_scaling_factor=2.5), "MixtralForCausalLM", "routed_scaling_factor"),
      (ModelConfig(norm_topk_prob=False), "MixtralForCausalLM", "renormalises"),
      (ModelConfig(qk_norm=True), "MixtralForCausalLM", "qk_norm"),
      (ModelConfig(), "DeepseekV3ForCausalLM", "unknown architecture"),
  ]:
    with pytest.raises(hf.CheckpointError, match=msg):
      hf.config_to_hf(cfg, arch)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
