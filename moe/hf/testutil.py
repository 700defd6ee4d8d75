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


# Text for the tiny tokenizers below: code, prose and a chat tag, so merges are learned.
TOKENIZER_TEXTS = ("def add(a, b):\n    return a + b\n", "print('hello world')\n",
                   "<|im_start|>user\nfix the bug<|im_end|>\n", "naïve café: ∑ 🙂\n") * 8


# A chat template in the style of Qwen3's (written for these tests, not copied): a leading system
# turn (listing the `tools` as JSON when there are some), <|im_start|>/<|im_end|> turns, an
# assistant's `tool_calls` as <tool_call> blocks (arguments given as a string or an object), tool
# results as user turns, reasoning shown only for the assistant turns after the last user query,
# `namespace` state, `raise_exception` on a bad conversation, and the generation prompt (with an
# empty think block for enable_thinking=false).
QWEN3_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call functions. Their signatures:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages[::-1] %}
    {%- if ns.last_query < 0 and message.role == 'user' %}
        {%- set ns.last_query = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must come first') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def bpe_tokenizer(texts=TOKENIZER_TEXTS, vocab_size: int = 320,
                  chat_template: str = QWEN3_STYLE_TEMPLATE):
  """A tiny byte-level BPE trained with `tokenizers` on `texts`, wrapped as transformers'
  `PreTrainedTokenizerFast` the way a Qwen-style checkpoint ships one: `<|endoftext|>` is the EOS
  and pad token, `<|im_start|>` / `<|im_end|>` are special added tokens, there is no BOS, and
  `chat_template` (default `QWEN3_STYLE_TEMPLATE`) is its chat template.
  `save_pretrained(dir)` writes tokenizer.json, tokenizer_config.json and chat_template.jinja."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(texts), trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                              pad_token="<|endoftext|>")
  fast.chat_template = chat_template
  return fast


def save_with_tokenizer(path, *, seed: int = 0, extra_ids: int = 16, **config) -> str:
  """A real-style checkpoint in `path`: a tiny seeded Qwen3-MoE (`qwen3_config`, `config`
  overriding its fields, e.g. max_position_embeddings) and `bpe_tokenizer()`, both saved by
  transformers (config.json, generation_config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json, chat_template.jinja). The model has `extra_ids` ids past the
  tokenizer's (an embedding padded past its tokenizer, as Qwen's) and the tokenizer's EOS / pad;
  returns `path`."""
  tok = bpe_tokenizer()
  cfg = qwen3_config(**{"vocab_size": len(tok) + extra_ids, "eos_token_id": tok.eos_token_id,
                        "pad_token_id": tok.pad_token_id, "bos_token_id": None, **config})
  save(make_model(cfg, seed=seed), path)
  tok.save_pretrained(str(path))
  return str(path)
