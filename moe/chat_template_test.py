"""moe.chat_template against transformers' apply_chat_template: the rendered text and the ids it
encodes to, for Qwen3-style and other templates saved by transformers, where checkpoints keep
templates (chat_template.jinja, tokenizer_config.json), and the errors."""

import json
import os
import sys

import pytest
import transformers

from moe import chat_template
from moe import tokenizer
from moe.hf import testutil

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "fix the bug"}],
    "system and user": [{"role": "system", "content": "You write Python."},
                        {"role": "user", "content": "def add(a, b):\n    return"}],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "print('hello world')"},
        {"role": "assistant", "content": "<think>\nit prints\n</think>\n\nIt prints it."},
        {"role": "user", "content": "naïve café: ∑ 🙂"},
    ],
    # Reasoning after the last user turn is shown; under transformers' alias "reasoning" too.
    "reasoning after the query": [
        {"role": "user", "content": "add?"},
        {"role": "assistant", "content": "a + b", "reasoning": "they want the sum"},
    ],
    "tool result": [
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": "<tool_call>run</tool_call>"},
        {"role": "tool", "content": "1 failed"},
    ],
    # Keys whose value is None are dropped before rendering (here 'content' read by the template).
    "null fields": [{"role": "user", "content": "hi", "name": None},
                    {"role": "assistant", "content": None, "reasoning_content": "thinking"}],
}


def _ids(out):
  """apply_chat_template(tokenize=True)'s ids, whether it returns them or a BatchEncoding."""
  return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  """A Qwen3-style tokenizer and chat template saved by transformers 5 (tokenizer.json,
  tokenizer_config.json, chat_template.jinja), and transformers' tokenizer loaded back."""
  d = str(tmp_path_factory.mktemp("qwen_tok"))
  testutil.bpe_tokenizer().save_pretrained(d)
  assert os.path.isfile(os.path.join(d, chat_template.TEMPLATE_FILE))
  return d, transformers.AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(qwen_dir, name, add_generation_prompt):
  d, ref = qwen_dir
  tok = tokenizer.for_model(d, len(ref))
  messages = CONVERSATIONS[name]
  text = tok.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
  want = ref.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=add_generation_prompt)
  assert text == want
  # The ids: our tokenizer's encoding of the text is transformers' tokenized chat, and the turn
  # markers are single special tokens in it.
  assert tok.encode(text) == _ids(ref.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=add_generation_prompt))
  assert tok.encode(text).count(ref.convert_tokens_to_ids("<|im_start|>")) == text.count(
      "<|im_start|>") > 0
  assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Runs the tests <fast> & 'quiet' 🙂",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
# Tool calls with arguments as an object (transformers' documented form) and as the JSON string
# OpenAI's API sends; two tool results in a row.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "fix road.py"},
    {"role": "assistant", "content": "Running them.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "run_tests", "arguments": {"path": "road.py"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "run_tests", "arguments": '{"path": "naïve.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "1 failed"},
    {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
]


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_tools_and_tool_calls_render_as_transformers_does(qwen_dir, tools):
  d, ref = qwen_dir
  tok = tokenizer.for_model(d, len(ref))
  text = tok.chat_template.render(TOOL_CONVERSATION, tools=tools)
  want = ref.apply_chat_template(TOOL_CONVERSATION, tools=tools, tokenize=False,
                                 add_generation_prompt=True)
  assert text == want
  assert tok.encode(text) == _ids(ref.apply_chat_template(
      TOOL_CONVERSATION, tools=tools, tokenize=True, add_generation_prompt=True))
  assert ('{"name": "run_tests", "arguments": {"path": "road.py"}}' in text and
          '{"name": "run_tests", "arguments": {"path": "naïve.py"}}' in text)
  assert ("<tools>" in text) == (tools is not None)
  if tools:  # listed as JSON, nothing escaped
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
  with pytest.raises(chat_template.ChatTemplateError, match="list of JSON schemas"):
    tok.chat_template.render(TOOL_CONVERSATION, tools=["run_tests"])


def test_template_variables_reach_the_template(qwen_dir):
  d, ref = qwen_dir
  tok = tokenizer.for_model(d, len(ref))
  messages = CONVERSATIONS["system and user"]
  text = tok.chat_template.render(messages, enable_thinking=False)
  assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
  assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  # The messages are not changed by rendering.
  assert CONVERSATIONS["reasoning after the query"][1] == {
      "role": "assistant", "content": "a + b", "reasoning": "they want the sum"}


# Exercises the special-token variables, jinja2's whitespace control, `tojson` (transformers'
# does not escape HTML), `dict`, loop controls and the `{% generation %}` tag.
OTHER_TEMPLATE = (
    "{{ bos_token }}{% set d = dict(sep=' | ') %}"
    "{% for m in messages %}\n"
    "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
    "  [{{ m.role | upper }}]{{ d.sep }}{{ m.content }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}\n"
    "{% endfor %}"
    "{{ messages | tojson }}\n"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_special_tokens_and_filters_match_transformers(tmp_path):
  fast = testutil.bpe_tokenizer(chat_template=OTHER_TEMPLATE)
  fast.bos_token = "<|im_start|>"
  fast.save_pretrained(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  tok = tokenizer.for_model(str(tmp_path), len(ref))
  assert tok.chat_template.special_tokens == {"bos_token": "<|im_start|>",
                                              "eos_token": "<|endoftext|>",
                                              "pad_token": "<|endoftext|>"}
  messages = [{"role": "user", "content": "a < b && c > 'd'"}, {"role": "skip", "content": "x"},
              {"role": "assistant", "content": "ok"}]
  for gen in (True, False):
    text = tok.chat_template.render(messages, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
  # trim_blocks / lstrip_blocks at work, nothing HTML-escaped, the skipped turn left out.
  assert text == ("<|im_start|>  [USER] | a < b && c > 'd'  [ASSISTANT] | ok<|endoftext|>"
                  + json.dumps(messages) + "\n")


def _bare_tokenizer_dir(path, config_extra):
  """tokenizer.json and tokenizer_config.json only (no chat_template.jinja), `config_extra`
  merged into the config: how checkpoints saved before transformers 4.43 keep templates."""
  testutil.bpe_tokenizer().save_pretrained(str(path))
  os.remove(path / chat_template.TEMPLATE_FILE)
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  cfg.update(config_extra)
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return str(path)


@pytest.mark.parametrize("form", ["string", "named list"])
def test_older_checkpoints_keep_the_template_in_tokenizer_config(tmp_path, form):
  template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
  value = (template if form == "string" else
           [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": template}])
  d = _bare_tokenizer_dir(tmp_path, {"chat_template": value})
  ref = transformers.AutoTokenizer.from_pretrained(d)
  tok = tokenizer.for_model(d, len(ref))
  messages = CONVERSATIONS["system and user"]
  assert tok.chat_template.render(messages) == ref.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert tok.chat_template.source == template


def test_the_template_file_wins_over_the_config_key(tmp_path):
  d = _bare_tokenizer_dir(tmp_path, {"chat_template": "FROM CONFIG"})
  (tmp_path / chat_template.TEMPLATE_FILE).write_text("FROM FILE{{ messages[0].content }}")
  ref = transformers.AutoTokenizer.from_pretrained(d)
  text = tokenizer.for_model(d, len(ref)).chat_template.render([{"role": "user", "content": "!"}])
  assert text == "FROM FILE!" == ref.apply_chat_template([{"role": "user", "content": "!"}],
                                                         tokenize=False)


def test_no_template_is_none(tmp_path):
  d = _bare_tokenizer_dir(tmp_path, {})
  assert tokenizer.for_model(d, 400).chat_template is None
  assert tokenizer.ByteTokenizer().chat_template is None
  assert chat_template.load(None) is None
  # Only named templates, none of them "default": nothing a chat endpoint could pick.
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert chat_template.load(d, {**cfg, "chat_template": [{"name": "x", "template": "y"}]}) is None


def test_a_template_that_refuses_the_conversation_says_why(qwen_dir):
  d, ref = qwen_dir
  tok = tokenizer.for_model(d, len(ref))
  late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
  with pytest.raises(chat_template.ChatTemplateError, match="system message must come first"):
    tok.chat_template.render(late_system)
  with pytest.raises(Exception, match="system message must come first"):  # transformers agrees
    ref.apply_chat_template(late_system, tokenize=False)
  with pytest.raises(chat_template.ChatTemplateError, match="unknown role: critic"):
    tok.chat_template.render([{"role": "critic", "content": "a"}])
  # A message without the content the template concatenates: an error, not a crash.
  with pytest.raises(chat_template.ChatTemplateError, match="failed on the conversation"):
    tok.chat_template.render([{"role": "user"}])
  for bad in ([], "hello", [["user", "hi"]]):
    with pytest.raises(chat_template.ChatTemplateError):
      tok.chat_template.render(bad)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutating the caller's data
])
def test_the_sandbox_holds(source):
  t = chat_template.ChatTemplate(source)
  with pytest.raises(chat_template.ChatTemplateError):
    t.render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_a_tokenizer_error(tmp_path):
  testutil.bpe_tokenizer(chat_template="{% for m in messages %}").save_pretrained(str(tmp_path))
  with pytest.raises(tokenizer.TokenizerError, match=r"chat_template.jinja does not compile"):
    tokenizer.for_model(str(tmp_path), 400)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
