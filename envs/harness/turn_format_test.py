"""Agent episodes in a model's chat template: token-exact across turns, and what transformers'
`apply_chat_template` renders for the same conversation.

The model side is a scripted policy over the tokenizer of a Qwen-style checkpoint (a tiny BPE with
`<|im_start|>` / `<|im_end|>` special tokens, saved by transformers); the chat template is read
from the saved directory as the project reads a checkpoint's (`moe.tokenizer.for_model`), and
transformers renders the same template as the reference. Two templates: the tests' Qwen3-style
one (`moe.hf.testutil`) and one that behaves as Qwen3's own does where it matters here (tool
results merged into one user turn, the last assistant turn written with a `<think>` block).
"""

import dataclasses
import json
import pickle
import sys

import pytest

from envs.harness import agent_loop
from envs.harness import policy as policy_lib
from envs.harness import toolcall
from envs.harness import turn_format
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_swe
from moe import tokenizer as tokenizer_lib
from moe.hf import testutil

END = "<|im_end|>"

# Qwen3's behaviour in the places the harness depends on: consecutive tool messages share one user
# turn, assistant turns after the last real user query keep their reasoning, the last assistant
# turn is written with a <think> block even when it has none, and `enable_thinking=false` puts an
# empty one into the generation prompt.
QWEN3_LIKE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# DeepSeek-R1's way with history: every assistant turn is written without its reasoning.
DROPS_REASONING = testutil.QWEN3_STYLE_TEMPLATE.replace(
    "{%- if loop.index0 > ns.last_query and reasoning %}", "{%- if false %}")
NO_TOOL_ROLE = testutil.QWEN3_STYLE_TEMPLATE.replace("message.role == 'tool'",
                                                     "message.role == 'function'")


def call(name, **args):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def think(text):
  return f"<think>\n{text}\n</think>\n\n"


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{template name: (the project's tokenizer of the saved checkpoint, transformers' one)}."""
  out = {}
  for name, source in (("qwen3_style", testutil.QWEN3_STYLE_TEMPLATE),
                       ("qwen3_like", QWEN3_LIKE)):
    d = tmp_path_factory.mktemp(name)
    ref = testutil.bpe_tokenizer(chat_template=source)
    ref.save_pretrained(str(d))
    out[name] = (tokenizer_lib.for_model(str(d), len(ref)), ref)
  return out


def chat_turns(tok, **kw):
  return turn_format.ChatTurns(tok.chat_template.render, end_tokens=["<|endoftext|>", END],
                               name=tok.chat_template.origin, **kw)


class RecordingPolicy(policy_lib.ScriptedPolicy):
  """A scripted policy that records each request: (prompt ids, completion ids, keywords)."""

  def __init__(self, responses, tokenizer):
    super().__init__(responses, tokenizer)
    self.sent = []

  def complete(self, prompt_ids, **kw):
    out = super().complete(prompt_ids, **kw)
    self.sent.append((list(prompt_ids), list(out[0].token_ids), kw))
    return out


def _task():
  return suite_swe.generate()[0]


def _check_exact(tr, pol, tok, end_id):
  """(a) and (c): each segment is its requests' prompts and completions, turn by turn; the loss
  mask covers exactly the completions, each ending with the end-of-turn token."""
  at = 0
  for seg in tr.segments:
    mine = []
    while at < len(pol.sent) and pol.sent[at][0] == seg.token_ids[:len(pol.sent[at][0])]:
      mine.append(pol.sent[at])
      at += 1
    assert mine, "a segment with no request"
    spans = []
    for k, (prompt, comp, kw) in enumerate(mine):
      assert kw["stop"] == () and kw["stop_token_ids"] == [end_id]
      assert seg.token_ids[len(prompt):len(prompt) + len(comp)] == comp
      assert comp[-1] == end_id  # the model's own end of turn
      if k + 1 < len(mine):  # the next prompt extends this one by the completion and more
        assert mine[k + 1][0][:len(prompt) + len(comp)] == prompt + comp
      spans.append((len(prompt), len(prompt) + len(comp)))
    last_prompt, last_comp, _ = mine[-1]
    # After the last turn only harness text: the rest of the close and any last tool results.
    assert seg.token_ids[:len(last_prompt) + len(last_comp)] == last_prompt + last_comp
    want_mask = [any(a <= j < b for a, b in spans) for j in range(len(seg))]
    assert seg.model_mask == want_mask
    assert all((lp == -0.5) == m for lp, m in zip(seg.logprobs, seg.model_mask))
  assert at == len(pol.sent)


def _render(ref, messages, gen):
  return ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _check_renders(segment, pol_sent, messages, tok, ref):
  """(b): every prompt of the segment is transformers' rendering, with the generation prompt,
  of the conversation before that assistant turn, and the whole segment the rendering of the
  whole conversation."""
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  assert len(turns) == len(pol_sent)
  for i, (prompt, _, _) in zip(turns, pol_sent):
    assert tok.decode(prompt, skip_special=False) == _render(ref, messages[:i], True)
  assert tok.decode(segment.token_ids, skip_special=False) == _render(ref, messages, False)


@pytest.mark.parametrize("template", ["qwen3_style", "qwen3_like"])
def test_an_episode_is_the_chat_templates_conversation(pool, checkpoints, template):
  tok, ref = checkpoints[template]
  task = _task()
  fixed = task.metadata["gold_files"]["calc/ops.py"]
  contents = [
      think("Read the code first.") + call("read_file", path="calc/ops.py"),
      "Two checks.\n" + call("run_tests") + "\n" + call("list_files"),
      call("edit_file", path="calc/ops.py", old="    return sum(xs) // len(xs)\n",
           new=fixed.split("def mean(xs):\n")[1]),
      think("The fix is in.") + "Done.\n" + call("submit"),
  ]
  pol = RecordingPolicy([c + END for c in contents], tok)
  chat = chat_turns(tok)
  cfg = agent_loop.LoopConfig(chat=chat, observation_max_chars=800)
  tr = agent_loop.run_episode(task, pol, pool=pool, config=cfg)
  assert tr.status == "ok" and tr.finish_reason == "submitted" and tr.reward == 1.0, tr
  assert chat.end_of_turn == END
  end_id = tok.encode(END)
  assert len(end_id) == 1
  _check_exact(tr, pol, tok, end_id[0])
  (seg,) = tr.segments
  # The opening is the template's prompt as transformers tokenises it (no BOS of the policy's).
  system = toolcall.system_prompt(None)
  opening = [{"role": "system", "content": system}, {"role": "user", "content": task.instructions}]
  want = ref.apply_chat_template(opening, tokenize=True, add_generation_prompt=True)
  want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
  assert pol.sent[0][0] == want
  # The conversation: the model's turns as it wrote them, each tool result a tool message.
  assert all(len(r.observation) < 1000 for r in tr.tool_calls)  # records keep 1000 characters
  messages = list(opening)
  for turn, content in enumerate(contents, start=1):
    messages.append({"role": "assistant", "content": content})
    if turn < len(contents):
      messages += [{"role": "tool", "content": r.observation} for r in tr.tool_calls
                   if r.turn == turn]
  assert [r.turn for r in tr.tool_calls] == [1, 2, 2, 3, 4]
  _check_renders(seg, pol.sent, messages, tok, ref)
  # The mask: the model's contents and their end of turn, nothing else.
  model = [t for t, m in zip(seg.token_ids, seg.model_mask) if m]
  assert tok.decode(model, skip_special=False) == "".join(c + END for c in contents)


@pytest.mark.parametrize("template", ["qwen3_style", "qwen3_like"])
def test_self_summarisation_in_the_chat_template(pool, checkpoints, template):
  tok, ref = checkpoints[template]
  task = _task()
  request = "Context full. Summarise for yourself."
  summary = think("Summarise.") + "Summary: mean in calc/ops.py floors with //."
  read = think("Look again.") + call("read_file", path="calc/ops.py")
  submit = think("Done.") + call("submit")

  def respond(prompt, i):
    if request in prompt[-200:]:
      return summary + END
    if "Summary: mean" in prompt:
      return submit + END
    return read + END

  pol = RecordingPolicy(respond, tok)
  base = agent_loop.LoopConfig(chat=chat_turns(tok), max_tokens_per_turn=120,
                               summary_max_tokens=100, summary_request=request,
                               observation_max_chars=300, max_turns=12)
  opening = len(tok.encode(agent_loop.initial_prompt(task.instructions, base)))
  # Room for the opening and a turn with its results (about 270 tokens) before the room a turn
  # needs, not for two: the second turn's results are followed by the summary request.
  cfg = dataclasses.replace(base, max_context_tokens=opening + 400 +
                            agent_loop.room_for_a_turn(tok.encode, base))
  tr = agent_loop.run_episode(task, pol, pool=pool, config=cfg)
  assert tr.status == "ok" and tr.finish_reason == "submitted", tr
  assert len(tr.segments) == 2 and tr.segments[0].ended_by_summary
  assert all(len(s) <= cfg.max_context_tokens for s in tr.segments)
  _check_exact(tr, pol, tok, tok.encode(END)[0])
  system = toolcall.system_prompt(None)
  reads = [r for r in tr.tool_calls if r.name == "read_file"]
  assert len(reads) == 2 and all(len(r.observation) < 1000 for r in reads)
  first = [{"role": "system", "content": system}, {"role": "user", "content": task.instructions}]
  for r in reads:
    first += [{"role": "assistant", "content": read}, {"role": "tool", "content": r.observation}]
  # The summary request is one more tool message after the last results (a user message would
  # make Qwen3's template drop the reasoning of every turn before it).
  first += [{"role": "tool", "content": request}, {"role": "assistant", "content": summary}]
  n_first = len(reads) + 1
  _check_renders(tr.segments[0], pol.sent[:n_first], first, tok, ref)
  # The fresh context: the instructions with the summary (its text as the model wrote it).
  written = tok.decode(pol.sent[n_first - 1][1]).strip()
  second = [{"role": "system", "content": system},
            {"role": "user", "content": f"{task.instructions}\n\nSummary of your progress so "
                                        f"far:\n{written}"},
            {"role": "assistant", "content": submit}]
  _check_renders(tr.segments[1], pol.sent[n_first:], second, tok, ref)


def test_project_template_is_the_default():
  """Without a chat template the loop writes the project's template (toolcall) and contexts
  start with the policy's BOS."""
  cfg = agent_loop.LoopConfig(tools=("read_file", "submit"))
  assert cfg.turns is turn_format.PROJECT
  assert agent_loop.initial_prompt("Go.", cfg) == toolcall.initial_prompt("Go.",
                                                                          ("read_file", "submit"))
  fmt = turn_format.PROJECT
  assert fmt.uses_start_ids and fmt.turn_stop == toolcall.STOP
  assert fmt.summary_request(["out"], "Sum.") == (
      toolcall.render_responses(["out"], generation_prompt=False) +
      toolcall.render_message("user", "Sum.") + toolcall.ASSISTANT_HEADER)


def test_pieces_of_a_qwen3_like_template(checkpoints):
  """Tool results share one user turn, and the summary request joins them."""
  tok, _ = checkpoints["qwen3_like"]
  chat = chat_turns(tok)
  assert chat.close == END + "\n" and chat.end_of_turn == END
  assert chat.closing(True) == "\n" and chat.closing(False) == END + "\n"
  assert chat.observations(["a", "b"]) == (
      "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
      "</tool_response><|im_end|>\n")
  assert chat.header(["a"]) == "<|im_start|>assistant\n"
  assert chat.summary_request(["a"], "Sum.") == (
      "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nSum.\n"
      "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_loop_config_in_a_chat_template_pickles(checkpoints):
  """A LoopConfig holding a chat model's turns (`turn_format.chat_turns` of its tokenizer) goes
  to another process (a fleet job's payload) and writes the same pieces there: the template's
  source travels and is compiled again."""
  tok, _ = checkpoints["qwen3_like"]
  chat = turn_format.chat_turns(tok)
  loop = agent_loop.LoopConfig(chat=chat, tools=("run_tests", "submit"))
  back = pickle.loads(pickle.dumps(loop))
  assert back.chat is not chat and back.chat.name == chat.name and back.tools == loop.tools
  assert agent_loop.initial_prompt("Go.", back) == agent_loop.initial_prompt("Go.", loop)
  for fmt in (chat, back.chat):
    assert (fmt.close, fmt.end_of_turn) == (END + "\n", END)
  assert back.chat.summary_request(["a"], "Sum.") == chat.summary_request(["a"], "Sum.")
  assert back.chat.observations(["a", "b"]) == chat.observations(["a", "b"])


@pytest.mark.parametrize("source,render_kw,end_tokens,message", [
    (DROPS_REASONING, {}, [END], "is not prefix-stable: the prompt of turn 2"),
    (QWEN3_LIKE, {"enable_thinking": False}, [END], "is not prefix-stable"),
    (NO_TOOL_ROLE, {}, [END], "cannot render the agent's conversation"),
    (testutil.QWEN3_STYLE_TEMPLATE, {}, ["<|endoftext|>"], "starts with none of the model's"),
])
def test_unfit_templates_are_refused(source, render_kw, end_tokens, message):
  """(d): a template that rewrites earlier turns (drops their reasoning, or writes the empty
  think block of `enable_thinking=false` only into the generation prompt), one without tool
  messages, or one whose close is no end token of the model is refused, by name."""
  from moe import chat_template  # pylint: disable=g-import-not-at-top
  tpl = chat_template.ChatTemplate(source, origin="/ckpt/chat_template.jinja")

  def render(messages, add_generation_prompt):
    return tpl.render(messages, add_generation_prompt=add_generation_prompt, **render_kw)

  with pytest.raises(turn_format.ChatTemplateUnfit, match=message) as e:
    turn_format.ChatTurns(render, end_tokens=end_tokens, name=tpl.origin)
  assert "/ckpt/chat_template.jinja" in str(e.value)


def test_an_end_of_turn_of_several_tokens_is_refused_before_the_episode(pool):
  """A policy whose tokenizer spells the end of turn in several tokens cannot stop at it."""
  from moe import chat_template  # pylint: disable=g-import-not-at-top
  tpl = chat_template.ChatTemplate(testutil.QWEN3_STYLE_TEMPLATE)
  chat = turn_format.ChatTurns(tpl.render, end_tokens=[END])
  pol = policy_lib.ScriptedPolicy([call("submit")], tokenizer_lib.ByteTokenizer())
  with pytest.raises(ValueError, match="is 10 tokens of the policy's tokenizer"):
    agent_loop.run_episode(_task(), pol, pool=pool, config=agent_loop.LoopConfig(chat=chat))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
