"""Agent-mode evaluation of a model with a chat template: its episodes are written in the template.

A Qwen-style checkpoint's tokenizer (a tiny BPE saved by transformers with a Qwen3-style chat
template; its EOS list, as a Qwen3 chat checkpoint's generation_config.json has it, names
`<|endoftext|>` and `<|im_end|>`) and a scripted sampler that solves a repository task: the
evaluation hands the harness the template (`envs.harness.turn_format.chat_turns`), so the sampler
is sent transformers' rendering of the conversation and asked to stop at `<|im_end|>`.
"""

import copy
import json
import sys

import pytest

from envs.harness import toolcall
from envs.harness import turn_format
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_swe
from evaluation import evaluate as evaluate_lib
from moe import chat_template
from moe import tokenizer as tokenizer_lib
from moe.hf import testutil


def call(name, **args):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(the project's tokenizer of the saved tokenizer files, transformers' tokenizer)."""
  d = tmp_path_factory.mktemp("qwen3_chat")
  ref = testutil.bpe_tokenizer()
  ref.save_pretrained(str(d))
  return tokenizer_lib.for_model(str(d), len(ref) + 16), ref


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def _scripted(tok, texts):
  """A generate callable answering with `texts` in turn (ids cut after a stop id, as a sampler
  stops there); records each call."""
  calls = []

  class Comp:
    def __init__(self, ids):
      self.token_ids, self.logprobs = ids, [-0.5] * len(ids)
      self.routing = self.policy_versions = None

  def generate(prompt_token_ids, *, n, max_tokens, temperature, stop_token_ids, seed):
    calls.append({"prompt": list(prompt_token_ids), "stop_token_ids": list(stop_token_ids)})
    ids = tok.encode(texts[min(len(calls), len(texts)) - 1])
    at = next((j + 1 for j, t in enumerate(ids) if t in stop_token_ids), len(ids))
    return [Comp(ids[:min(at, max_tokens)]) for _ in range(n)]

  generate.calls = calls
  return generate


def test_an_agent_evaluation_speaks_the_models_chat_template(checkpoint, pool, tmp_path):
  tok, ref = checkpoint
  task = suite_swe.generate()[0]
  fixed = task.metadata["gold_files"]["calc/ops.py"]
  gen = _scripted(tok, [
      call("edit_file", path="calc/ops.py", old="    return sum(xs) // len(xs)\n",
           new=fixed.split("def mean(xs):\n")[1]) + "<|im_end|>",
      call("submit") + "<|im_end|>"])
  end, eos = tok.encode("<|im_end|>"), tok.eos_id
  report = evaluate_lib.evaluate(gen, [task], n=1, k_list=(1,), max_tokens=512, pool=pool,
                                 tokenizer=tok, add_bos=False, mode="agent",
                                 eos_token_ids=(eos, *end), out_path=str(tmp_path / "r.jsonl"))
  assert report.pass_at_k[1] == 1.0, report.results[0].samples
  first = gen.calls[0]
  messages = [{"role": "system", "content": toolcall.system_prompt(None)},
              {"role": "user", "content": task.instructions}]
  want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  assert first["prompt"] == (list(want["input_ids"]) if hasattr(want, "keys") else list(want))
  assert end[0] in first["stop_token_ids"]
  # The second turn follows the first as the template writes a tool result.
  second = tok.decode(gen.calls[1]["prompt"], skip_special=False)
  assert second.startswith(tok.decode(first["prompt"], skip_special=False))
  assert "<|im_end|>\n<|im_start|>user\n<tool_response>\n" in second
  assert second.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_end_of_turn_is_the_special_token_that_closes_a_turn(checkpoint):
  """The checkpoint's EOS list names <|im_end|>; without it (a base checkpoint names only
  <|endoftext|>) the special token the template closes a turn with is found all the same; a
  template whose close starts with plain text has no token to stop at and is refused."""
  tok, _ = checkpoint
  for eos in (tok.encode("<|im_end|>"), ()):
    chat = turn_format.chat_turns(tok, eos)
    assert chat.end_of_turn == "<|im_end|>" and chat.name.endswith("chat_template.jinja")
  plain = copy.copy(tok)
  plain.chat_template = chat_template.ChatTemplate(
      "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + ('END\\n' if "
      "m.role == 'assistant' else '<|im_end|>\\n') }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
      origin="plain.jinja")
  assert turn_format.assistant_close(plain.chat_template.render) == "END\n"
  with pytest.raises(turn_format.ChatTemplateUnfit, match="plain.jinja closes an assistant turn"):
    turn_format.chat_turns(plain)
  assert turn_format.chat_turns(tokenizer_lib.ByteTokenizer()) is None  # no template


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
