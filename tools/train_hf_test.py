"""Bring your own checkpoint, end to end: `//tools:train --hf_checkpoint=DIR` on a checkpoint saved
by transformers (a tiny Qwen3-MoE with a BPE tokenizer, a Qwen3-style chat template and a chat
model's EOS list, <|im_end|> and <|endoftext|>) and a task file, RL for two steps, the export
served by //tools:serve and answered through the official openai client's chat API, and loaded
back by transformers.

What it proves: RL trained (episodes trained, the policy version moved, rewards varied within
groups so the gradient was not zero, `experiment.testing.assert_trained`), the export holds the
trained weights (bit for bit those of run_dir/final_model, and not the imported ones), its
tokenizer gives transformers' ids, its chat template renders as the source's, its
generation_config.json keeps the EOS list, and transformers' logits on the export match ours.

The tasks are `experiment.testing.even_code_tasks` written as a task file (the route a user's
own tasks take, ExperimentConfig.task_file): their hidden tests check a property of the text that
a random model's attempts have about half the time, so groups get different rewards and GRPO has
a signal. The built-in suite would give this random model reward 0 everywhere.

Tolerance policy: moe/hf/parity_test.py's (fp32 on both sides, max |logit difference| <= 2e-5,
ten times the gap measured there); exported weights are compared exactly. Never loosen them.
"""

import json
import os
import sys

import numpy as np
import openai
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from envs.tasks import task_format
from experiment import testing as experiment_testing
from moe import checkpoint as moe_checkpoint
from moe import hf
from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from moe.hf import testutil
from tools import configs
from tools import main as main_lib
from tools import testing
from tools import train as train_lib

LOGIT_ATOL = 2e-5  # moe/hf/parity_test.py's policy (see the module docstring)
SOURCE_CONTEXT = 128  # the checkpoint's max_position_embeddings (testutil.qwen3_config)
TEXTS = ("def add(a, b):\n    return a + b\n", "naïve café ∑ 🙂 never seen",
         "<|im_start|>user\nfix the bug<|im_end|>\n<|endoftext|>")
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"}]
# Two RL steps of 2 prompts x 4 attempts of at most 8 tokens, on a model and batch this small.
BINDINGS = ["--gin.ModelConfig.max_seq_len=64", "--gin.RLConfig.steps=2",
            "--gin.RLConfig.sampler_slots=8", "--gin.OptimizerConfig.learning_rate=1e-3",
            "--gin.PipelineConfig.prompts_per_step=2", "--gin.PipelineConfig.attempts=4",
            "--gin.PipelineConfig.max_new_tokens=8", "--gin.PipelineConfig.seq_len=64",
            "--gin.PipelineConfig.batch_rows=8", "--gin.PipelineConfig.grade_workers=2",
            "--gin.PipelineConfig.filter_zero_variance_groups=False",
            "--gin.ExperimentConfig.sandbox_pool=2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """(checkpoint directory, transformers' tokenizer of it, its EOS ids): saved by transformers,
  with a chat model's generation_config.json listing <|im_end|> before <|endoftext|>."""
  d = testutil.save_with_tokenizer(tmp_path_factory.mktemp("qwen3_chat"), seed=1)
  ref = transformers.AutoTokenizer.from_pretrained(d)
  eos = [ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id]
  transformers.GenerationConfig(eos_token_id=eos, pad_token_id=ref.eos_token_id).save_pretrained(d)
  assert json.loads(open(os.path.join(d, "config.json")).read())["max_position_embeddings"] == (
      SOURCE_CONTEXT)
  return d, ref, eos


def _chat_ids(tok, messages) -> list:
  out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_train_from_a_transformers_checkpoint_then_serve_and_load_the_export(source, tmp_path):
  src, ref, eos = source
  tasks = experiment_testing.even_code_tasks(n_train=4, n_test=0)
  task_file = str(tmp_path / "tasks.jsonl")
  task_format.dump_jsonl(tasks, task_file)
  run_dir = tmp_path / "run"
  argv = [f"--hf_checkpoint={src}", "--gin_file=tools/configs/experiments/hf_rl.gin",
          f"--task_file={task_file}", f"--run_dir={run_dir}", "--no_progress"] + BINDINGS
  assert train_lib.main(argv) == 0

  # -- RL trained: every step's episodes, rewards that varied, weights that moved ----------------
  _, files, bindings = main_lib.parse_args(argv)
  cfg = configs.load_experiment(files, bindings)
  assert cfg.model.vocab_size == ref.vocab_size + 16 and cfg.model.max_seq_len == 64
  experiment_testing.assert_trained(str(run_dir), cfg)
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["rl"]["episodes_trained"] == 2 * 8 and summary["rl"]["policy_version"] == 2
  assert summary["train_tasks"] == 4 and summary["hf_export"] == str(run_dir / "hf_export")
  rl_steps = experiment_testing.read_metrics(str(run_dir))["rl"]
  assert sum(r["signal_groups"] for r in rl_steps) > 0, rl_steps

  # -- the export: trained weights, the source's context, tokenizer, template and EOS list -------
  out = str(run_dir / "hf_export")
  assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
          "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(out))
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert config["max_position_embeddings"] == SOURCE_CONTEXT and config["dtype"] == "float32"
  assert config["eos_token_id"] == eos
  assert hf.eos_token_ids(out) == tuple(eos)
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == eos
  before, after = load_file(os.path.join(src, "model.safetensors")), load_file(
      os.path.join(out, "model.safetensors"))
  assert before.keys() == after.keys()
  changed = [k for k in before if not np.array_equal(before[k], after[k])]
  assert changed and all(np.isfinite(v).all() for v in after.values()), "RL changed no weight"
  _, final = moe_checkpoint.load_params_flat(str(run_dir / "final_model"))
  exported = moe_params.flatten(hf.load_pretrained(out))
  assert exported.keys() == final.keys()
  for name, value in final.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)

  # -- transformers loads it: the same ids, the same template, our logits ----------------------
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  ours = tokenizer_lib.for_model(out, config["vocab_size"])
  for text in TEXTS:
    want = ref.encode(text, add_special_tokens=False)
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text) == want, text
  assert _chat_ids(theirs, CHAT) == _chat_ids(ref, CHAT)
  assert ours.encode(ours.chat_template.render(CHAT)) == _chat_ids(ref, CHAT)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  toks = np.asarray([ours.encode(TEXTS[0]), ours.encode(TEXTS[0])[::-1]], np.int32)
  want_logits, _ = testutil.forward(model, toks)
  got = np.asarray(moe_checkpoint.load_model(str(run_dir / "final_model"))(toks).logits)
  assert np.abs(want_logits).max() > 0.5  # not a comparison of near-zero numbers
  np.testing.assert_allclose(got, want_logits, rtol=0, atol=LOGIT_ATOL)

  # -- //tools:serve serves it: the openai client's chat API, answered greedily -----------------
  server = testing.Binary("serve", [f"--hf_checkpoint={out}", "--port=0", "--admin_port=-1",
                                    "--max_slots=2", "--max_len=64", "--decode_steps=4",
                                    *testing.serve_flags(tmp_path)], tmp_path)
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{testing.serve_port(server.line)}/v1",
                           api_key="unused", max_retries=0, timeout=testing.WAIT_S)
    assert [m.id for m in client.models.list().data] == ["hf_export"]
    r = client.chat.completions.create(model="hf_export", messages=CHAT, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
  finally:
    server.close()
  choice = r.choices[0]
  prompt = _chat_ids(ref, CHAT)
  ids = choice.model_extra["token_ids"]
  assert choice.model_extra["prompt_token_ids"] == prompt and len(ids) == 8
  assert choice.message.role == "assistant" and choice.finish_reason == "length"
  assert choice.message.content == ref.decode(ids, skip_special_tokens=True)
  assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 8
  # Greedy under transformers too: each served token is the most likely one after the prompt
  # and the tokens before it (up to the logit tolerance, for near ties).
  with torch.no_grad():
    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float().numpy()
  picked = logits[np.arange(len(ids)), ids]
  assert (picked >= logits.max(axis=-1) - LOGIT_ATOL).all(), (ids, logits.argmax(-1))


def test_a_checkpoint_that_does_not_exist_or_fit_fails_before_any_work(source, tmp_path, capsys):
  src, _, _ = source
  base = ["--gin_file=tools/configs/experiments/hf_rl.gin", f"--run_dir={tmp_path}/r"]
  assert train_lib.main(base + [f"--hf_checkpoint={tmp_path}/missing"]) == 2
  assert "hf_checkpoint" in capsys.readouterr().err
  not_hf = tmp_path / "not_hf"
  not_hf.mkdir()
  (not_hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
  os.symlink(os.path.join(src, "model.safetensors"), not_hf / "model.safetensors")
  assert train_lib.main(base + [f"--hf_checkpoint={not_hf}"]) == 2
  assert "unknown model_type 'llama'" in capsys.readouterr().err
  assert train_lib.main(base + [f"--hf_checkpoint={src}", f"--task_file={tmp_path}/no.jsonl"]) == 2
  assert "task_file" in capsys.readouterr().err
  assert not (tmp_path / "r").exists()  # nothing started


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
