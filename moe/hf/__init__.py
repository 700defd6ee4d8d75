"""Hugging Face checkpoints: import and export Mixtral and Qwen3-MoE safetensors checkpoints.

  from moe import hf
  model = hf.load_pretrained("/path/to/checkpoint")        # config.json + safetensors shards
  out = model(tokens)                                        # logits [B,T,V], routing [L,B,T,k]
  hf.save_pretrained(model, "/path/to/out")                  # transformers can load this
  hf.save_pretrained(model, out, tokenizer=tok)              # + tokenizer, generation_config.json
  hf.eos_token_ids("/path/to/checkpoint")                    # every id that ends generation
  hf.load_config("/path/to/checkpoint")                      # its ModelConfig, no weights read

See names.py for the tensor-name mapping and README.md for the layouts and policies.
"""

from moe.hf.config_map import architecture_of, config_from_hf, config_to_hf
from moe.hf.errors import CheckpointError
from moe.hf.load import load_config, load_pretrained
from moe.hf.names import ARCHITECTURES
from moe.hf.save import save_pretrained
from moe.hf.special_tokens import eos_token_ids

__all__ = ["ARCHITECTURES", "CheckpointError", "architecture_of", "config_from_hf",
           "config_to_hf", "eos_token_ids", "load_config", "load_pretrained", "save_pretrained"]
