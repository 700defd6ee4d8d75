"""The main job from a Hugging Face checkpoint: continual pre-training of the imported weights with
the checkpoint's own tokenizer (no BOS, a chat model's EOS list), held-out evaluation before and
after, and the export in the checkpoint's dtype and context.

The source is saved by transformers in bfloat16 (as published checkpoints are): the run trains in
float32 and the export is bfloat16 again, its config.json the source's but for the weights.
tools/train_hf_test.py covers RL, serving and transformers' view of an export end to end.
"""

import json
import os
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from experiment import hf_checkpoint
from experiment import run as run_lib
from experiment import testing as experiment_testing
from experiment.config import EvalConfig, ExperimentConfig, PretrainConfig, RLConfig
from moe import checkpoint as moe_checkpoint
from moe import hf
from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from moe.config import ModelConfig
from moe.hf import testutil
from pipeline.config import PipelineConfig


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """(directory, EOS ids) of a bfloat16 Qwen3-MoE chat checkpoint saved by transformers."""
  d = str(tmp_path_factory.mktemp("qwen3_bf16"))
  tok = testutil.bpe_tokenizer()
  cfg = testutil.qwen3_config(vocab_size=len(tok) + 16, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=None)
  testutil.save(testutil.make_model(cfg, seed=2, dtype=torch.bfloat16), d)
  tok.save_pretrained(d)
  eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
  transformers.GenerationConfig(eos_token_id=eos).save_pretrained(d)
  assert hf.load_config(d).param_dtype == "bfloat16"
  return d, eos


def test_with_checkpoint_model_is_the_checkpoints_in_float32_with_the_runs_context(source):
  d, _ = source
  cfg = hf_checkpoint.with_checkpoint_model(
      ExperimentConfig(model=ModelConfig(max_seq_len=160), hf_checkpoint=d))
  assert cfg.model == hf.load_config(d).replace(max_seq_len=160, param_dtype="float32",
                                                dtype="float32")
  with pytest.raises(ValueError, match="at most one of pretrained_model and hf_checkpoint"):
    ExperimentConfig(model=ModelConfig(), hf_checkpoint=d, pretrained_model=d)
  with pytest.raises(ValueError, match="hf_export needs hf_checkpoint"):
    ExperimentConfig(model=ModelConfig(), hf_export="/tmp/x")


def test_pretrain_and_evaluate_from_the_checkpoint_then_export_it(source, tmp_path):
  d, eos = source
  tasks = experiment_testing.even_code_tasks(n_train=4, n_test=2)
  cfg = ExperimentConfig(
      model=ModelConfig(max_seq_len=64), hf_checkpoint=d, hf_export=str(tmp_path / "out"),
      pretrain=PretrainConfig(steps=2, batch_rows=2, seq_len=32, corpus_snippets=10,
                              corpus_repeats=1, warmup_steps=1),
      rl=RLConfig(steps=0, pipeline=PipelineConfig(seq_len=64)),
      eval=EvalConfig(samples=2, max_tokens=8, k_list=(1,)), sandbox_pool=2)
  lines = []
  summary = run_lib.run(cfg, str(tmp_path / "run"), progress=False, echo=lines.append,
                        tasks=tasks)
  run_dir = str(tmp_path / "run")
  assert any(l.startswith(f"Hugging Face checkpoint: {d} (Qwen3MoeForCausalLM") and
             f"EOS ids {eos}" in l for l in lines), lines
  # Continual pre-training: two steps of the imported weights, on documents without BOS.
  assert len(experiment_testing.read_metrics(run_dir)["pretrain"]) == 2
  about = json.load(open(os.path.join(run_dir, "corpus.json")))
  assert about["tokenizer"]["kind"] == "checkpoint", about["tokenizer"]
  imported = hf.load_pretrained(d, dtype="float32")
  _, pretrained = moe_checkpoint.load_params_flat(os.path.join(run_dir, "pretrained_model"))
  assert any(not np.array_equal(v, pretrained[k])
             for k, v in moe_params.flatten(imported).items())
  # Evaluated before and after (no RL: the same model), prompts without BOS.
  assert summary["before"]["samples"] == summary["after"]["samples"] == 4
  # The project checkpoints carry the tokenizer with its roles; the export is the final model in
  # the source's dtype and context with its EOS list.
  final_dir = os.path.join(run_dir, "final_model")
  tok = tokenizer_lib.for_model(final_dir, imported.config.vocab_size)
  assert (tok.bos_id, tok.eos_id) == (None, eos[1]) and tok.chat_template is not None
  out = str(tmp_path / "out")
  assert summary["hf_export"] == out
  config = json.loads(open(os.path.join(out, "config.json")).read())
  source_config = json.loads(open(os.path.join(d, "config.json")).read())
  assert config["dtype"] == "bfloat16" and config["max_position_embeddings"] == (
      source_config["max_position_embeddings"])
  assert hf.eos_token_ids(out) == tuple(eos)
  with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  exported = hf.load_pretrained(out, dtype="float32")
  _, final = moe_checkpoint.load_params_flat(final_dir)
  for name, value in moe_params.flatten(exported).items():
    # bfloat16 keeps 8 significant bits: the export is the final model rounded to them.
    np.testing.assert_allclose(value, final[name], rtol=2 ** -8, atol=0, err_msg=name)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
