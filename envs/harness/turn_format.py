"""How the agent loop writes an episode as text: the project's template, or a model's chat template.

The loop keeps each context as token ids: it encodes the text it writes (the opening, the
environment's messages, the headers that open the model's turns) once and appends the model's
own ids exactly as sampled, never decoding and re-encoding them. A turn format says what that
harness text is:

  `ProjectTurns` (`PROJECT`, the default): the project's ChatML template of `toolcall`, which the
    project's own models (no chat template) are pre-trained on.
  `ChatTurns`: a model's own chat template (a Hugging Face checkpoint's Jinja template), so a
    chat model sees its agent episode as the conversation it was trained on: a system message
    (the tools), a user message (the task), the model's turns as assistant messages, each tool
    result as a `tool` message, the summary request as one more `tool` message, and the model's
    end-of-turn token (e.g. Qwen's `<|im_end|>`) ending each of its turns as a stop token, so
    that it is the model's own token, trained with the rest of its turn.

Inside an assistant turn the tool-call syntax stays the project's (`toolcall.CALL_OPEN` /
`CALL_CLOSE` around a JSON object), whichever the format: it is the Hermes / Qwen syntax chat
models with tools write, and `toolcall.parse` reads it.

Why `ChatTurns` renders pieces rather than the whole conversation: re-rendering the conversation
each turn and re-tokenising it would put into the context text the model did not write (a
template may normalise a turn: strip it, drop its reasoning) and ids the sampler did not sample.
Instead the pieces between the model's turns come from renders of short conversations in which
the assistant's content is a marker (the approach RL frameworks for agents take): the text after
the marker up to the next message is the turn's close, what follows is the next messages, and
the generation prompt is what `add_generation_prompt` adds. This is exact for a template that is
prefix-stable -- rendering a conversation with one more message only appends to it, and the
model's contents are written as given -- which `ChatTurns` checks when it is built by playing
out two probe episodes (plain tool-call turns, and turns opening with a `<think>` reasoning
block), piece by piece, against full renders of the same conversations: every prompt the loop
would send must be the template's rendering, with the generation prompt, of the conversation so
far. A template that is not (one that drops earlier turns' reasoning, or renders a message
differently once another follows it) or that cannot render the episode at all (no `tool` role)
is refused with `ChatTemplateUnfit` naming the template, where the texts part and why.

Each turn's prompt is then the template's rendering of the conversation so far; the whole
context equals the rendering of the whole conversation (`add_generation_prompt=False`) except
where a template writes its *last* assistant turn differently from earlier ones (Qwen3's writes
an empty `<think>` block into a last turn that has none), which no prompt the model saw holds.

Which format a model's episodes are written in is decided in one place, `chat_turns(tokenizer,
eos_token_ids)`: `ChatTurns` of the tokenizer's chat template when it has one, else None (the
project's). RL (in-process and the multi-process controller), evaluation and the pre-training
transcripts all take it from there (runs through `agent_loop.chat_for`), so a model sees one
format from its first transcript to its last evaluation. A `ChatTurns` pickles (with the template's source, compiled again where it is
unpickled), so a `LoopConfig` holding one can travel to another process.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping, Protocol, Sequence

from envs.harness import toolcall


class TurnFormat(Protocol):
  """What the agent loop asks of a turn format (see the module docstring).

  Attributes:
    end_of_turn: the text that ends a model turn (in the summary too, which is cut out).
    end_is_token: the model ends its turns with `end_of_turn` as one token, asked for as a stop
      token id; False: turns stop at `turn_stop` strings.
    turn_stop / summary_stop: stop strings of a tool-calling turn and of the summary.
    uses_start_ids: contexts start with the policy's `start_ids()` (its BOS); a chat template
      writes what a context starts with itself.
  """
  end_of_turn: str
  end_is_token: bool
  turn_stop: tuple[str, ...]
  summary_stop: tuple[str, ...]
  uses_start_ids: bool

  def opening(self, system: str, user: str) -> str:
    """A context's first text: the system and user messages, then the model's turn opened."""
    ...

  def closing(self, ended: bool) -> str:
    """Text that closes a model turn: the rest of the close when the model wrote its end of
    turn (`ended`), all of it when it did not (it ran out of tokens)."""
    ...

  def observations(self, observations: Sequence[str]) -> str:
    """The environment's messages after a closed turn, one per tool result."""
    ...

  def header(self, observations: Sequence[str]) -> str:
    """Text that opens the model's next turn after `observations`."""
    ...

  def summary_request(self, observations: Sequence[str], request: str) -> str:
    """`observations` (none: the request alone) with the summary request after them, then the
    model's turn opened."""
    ...


class ProjectTurns:
  """The project's template (`toolcall`): ChatML, tool results in a user turn of
  `<tool_response>` blocks, the summary request as a user turn. Turns stop at `</tool_call>` or
  `<|im_end|>` as strings (the project's tokenizers write them as text or as tokens that decode
  to it); a turn stopped at `</tool_call>` is closed with `<|im_end|>` by the harness."""

  end_of_turn = toolcall.IM_END
  end_is_token = False
  turn_stop = toolcall.STOP
  summary_stop = (toolcall.IM_END,)
  uses_start_ids = True

  def opening(self, system: str, user: str) -> str:
    return (toolcall.render_message("system", system) + toolcall.render_message("user", user) +
            toolcall.ASSISTANT_HEADER)

  def closing(self, ended: bool) -> str:
    return "" if ended else toolcall.IM_END + "\n"

  def observations(self, observations: Sequence[str]) -> str:
    return toolcall.render_responses(list(observations), generation_prompt=False)

  def header(self, observations: Sequence[str]) -> str:
    del observations
    return toolcall.ASSISTANT_HEADER

  def summary_request(self, observations: Sequence[str], request: str) -> str:
    before = self.observations(observations) if observations else ""
    return before + toolcall.render_message("user", request) + toolcall.ASSISTANT_HEADER


PROJECT = ProjectTurns()


class ChatTemplateUnfit(ValueError):
  """A chat template the agent loop cannot write episodes in exactly (see the module
  docstring); the message names the template and says why."""


# The assistant content of the piece renders: found in the rendered text to split it.
_MARK = "MODEL-TURN-7d1f3a"
_BASE = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"},
         {"role": "assistant", "content": _MARK})


def _call(name: str, **arguments) -> str:
  return (f"{toolcall.CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n"
          f"{toolcall.CALL_CLOSE}")


# Probe episodes: (assistant content, the tool results that answer it) per turn; the last turn
# of each is answered by the summary request and then the summary.
_PLAIN = ((_call("run_tests"), ("FAILED test_mean", "1 failed")),
          ("I will read it.\n" + _call("read_file", path="a.py"), ("def mean(xs): ...",)),
          ("Fixed mean; tests left to run.", ()))
_THINK = "<think>\n{}\n</think>\n\n"
_REASONING = ((_THINK.format("The tests will say what fails.") + _call("run_tests"),
               ("FAILED test_mean", "1 failed")),
              (_THINK.format("mean divides with //.") + _call("read_file", path="a.py"),
               ("def mean(xs): ...",)),
              (_THINK.format("Summarise.") + "Fixed mean; tests left to run.", ()))
_PROBE_SYSTEM = "You are a coding agent. Tools: run_tests, read_file."
_PROBE_TASK = "Fix mean in a.py."
_PROBE_REQUEST = "The context is full. Summarise your progress."


def _render(render: Callable[..., str], name: str, messages: Sequence[Mapping],
            gen: bool) -> str:
  try:
    return render(list(messages), add_generation_prompt=gen)
  except Exception as e:  # noqa: BLE001 -- a template's own error, whatever its type
    roles = [m["role"] for m in messages]
    raise ChatTemplateUnfit(f"{name} cannot render the agent's conversation (roles {roles}): "
                            f"{type(e).__name__}: {e}") from e


def _after_mark(render: Callable[..., str], name: str, messages: Sequence[Mapping],
                gen: bool) -> str:
  """The rendering of (system, user, assistant turn) + `messages` after the turn's content."""
  text = _render(render, name, _BASE + tuple(messages), gen)
  at = text.find(_MARK)
  if at < 0:
    raise ChatTemplateUnfit(f"{name} does not write an assistant turn's content as given")
  return text[at + len(_MARK):]


def assistant_close(render: Callable[..., str], name: str = "chat template") -> str:
  """What the template `render` (as `ChatTurns` takes it) writes after an assistant turn's
  content (Qwen's `<|im_end|>` and a newline): its first token is the one the model ends its
  turn with, for a caller choosing `ChatTurns`' end tokens. Raises ChatTemplateUnfit as
  `ChatTurns` does."""
  return _after_mark(render, name, [], False)


class ChatTurns:
  """Agent turns in a model's chat template (see the module docstring).

  Args:
    render: the template: `render(messages, add_generation_prompt=bool) -> str` for OpenAI-style
      message dicts, as transformers' `apply_chat_template(..., tokenize=False)` renders them
      (e.g. `moe.chat_template.ChatTemplate.render`, which the caller passes in: envs does not
      import the model's packages).
    end_tokens: the texts of the tokens that can end the model's turn (its EOS tokens, e.g.
      Qwen3's `<|im_end|>` and `<|endoftext|>`); the one the template closes an assistant turn
      with is the end of turn, and each turn stops at it as a token.
    name: the template's name in messages (e.g. the path it was read from).

  Attributes:
    close: what the template writes after an assistant turn's content (Qwen's `<|im_end|>` and
      a newline).
    end_of_turn: the start of `close` the model writes itself (`<|im_end|>`).

  Raises:
    ChatTemplateUnfit: the template cannot render an episode (an error it raises), does not
      close an assistant turn with one of `end_tokens`, or is not prefix-stable on the probe
      episodes; the message names the template and shows where the texts part.
  """

  end_is_token = True
  turn_stop = ()
  summary_stop = ()
  uses_start_ids = False

  def __init__(self, render: Callable[..., str], *, end_tokens: Sequence[str],
               name: str = "chat template"):
    self.render = render
    self.name = name
    self.close = assistant_close(render, name)
    if not self.close:
      raise ChatTemplateUnfit(f"{name} writes nothing after an assistant turn's content, so no "
                              "token ends the model's turn")
    ends = sorted((t for t in end_tokens if t and self.close.startswith(t)), key=len)
    if not ends:
      raise ChatTemplateUnfit(
          f"{name} closes an assistant turn with {self.close!r}, which starts with none of the "
          f"model's end tokens {list(end_tokens)!r}, so its turns cannot stop where the template "
          "ends them")
    self.end_of_turn = ends[-1]
    for probe in (_PLAIN, _REASONING):
      self._check(probe)

  def _render(self, messages: Sequence[Mapping], gen: bool) -> str:
    return _render(self.render, self.name, messages, gen)

  def _after_close(self, messages: Sequence[Mapping], gen: bool) -> str:
    text = _after_mark(self.render, self.name, messages, gen)
    if not text.startswith(self.close):
      raise ChatTemplateUnfit(
          f"{self.name} closes an assistant turn with {self.close!r} when it is the last "
          f"message but with {text[:len(self.close) + 20]!r} when {messages[0]['role']} "
          "messages follow it: not prefix-stable")
    return text[len(self.close):]

  @staticmethod
  def _tool(contents: Sequence[str]) -> list[dict]:
    return [{"role": "tool", "content": c} for c in contents]

  def opening(self, system: str, user: str) -> str:
    return self._render([{"role": "system", "content": system},
                         {"role": "user", "content": user}], True)

  def closing(self, ended: bool) -> str:
    return self.close[len(self.end_of_turn):] if ended else self.close

  def observations(self, observations: Sequence[str]) -> str:
    return self._after_close(self._tool(observations), False)

  def header(self, observations: Sequence[str]) -> str:
    before = self.observations(observations)
    after = self._after_close(self._tool(observations), True)
    if not after.startswith(before):
      raise ChatTemplateUnfit(f"{self.name}: its generation prompt rewrites the tool messages "
                              "before it: not prefix-stable")
    return after[len(before):]

  def summary_request(self, observations: Sequence[str], request: str) -> str:
    return self._after_close(self._tool([*observations, request]), True)

  def _check(self, turns) -> None:
    """Plays out a probe episode with this format's pieces, as the agent loop writes it, and
    compares each prompt with the template's rendering of the conversation so far."""
    messages = [{"role": "system", "content": _PROBE_SYSTEM},
                {"role": "user", "content": _PROBE_TASK}]
    text = self.opening(_PROBE_SYSTEM, _PROBE_TASK)
    for i, (content, results) in enumerate(turns):
      want = self._render(messages, True)
      if text != want:
        at = next((j for j, (a, b) in enumerate(zip(text, want)) if a != b),
                  min(len(text), len(want)))
        raise ChatTemplateUnfit(
            f"{self.name} is not prefix-stable: the prompt of turn {i + 1} of a probe episode, "
            f"written piece by piece, differs from the template's rendering of the same "
            f"conversation at character {at}: {text[max(0, at - 40):at + 40]!r} vs "
            f"{want[max(0, at - 40):at + 40]!r} (a template that rewrites earlier turns, e.g. "
            "drops their reasoning, cannot keep the model's tokens as it wrote them)")
      text += content + self.end_of_turn + self.closing(True)
      messages.append({"role": "assistant", "content": content})
      last = i == len(turns) - 1
      if i == len(turns) - 2:  # the context is full: the summary request follows the results
        text += self.summary_request(results, _PROBE_REQUEST)
        messages += self._tool([*results, _PROBE_REQUEST])
      elif not last:
        text += self.observations(results) + self.header(results)
        messages += self._tool(results)


def chat_turns(tokenizer, eos_token_ids: Sequence[int] = ()) -> ChatTurns | None:
  """The turns of agent episodes for the model whose tokenizer is `tokenizer`: `ChatTurns` of
  its chat template (a chat model's episodes as the conversations it was trained on), or None
  when it has none (the project's template then: `PROJECT`, the model pre-trained on it).

  The model's turns end at the token the template closes an assistant turn with, found among
  its end tokens: `eos_token_ids` (a checkpoint's EOS list: Qwen3's names `<|im_end|>`), the
  tokenizer's EOS, and the first token of the template's close when the tokenizer holds it as a
  special token (a base checkpoint ships its family's chat template but names only
  `<|endoftext|>` as EOS). The harness asks the sampler to stop there.

  Args:
    tokenizer: the model's tokenizer (e.g. `moe.tokenizer.for_model`'s): `chat_template` (an
      object with `render(messages, add_generation_prompt=)` and `origin`, or None), `encode`,
      `decode(ids, skip_special=)` and `eos_id`.
    eos_token_ids: the checkpoint's EOS list (generation_config.json's), if it has one.

  Raises:
    ChatTemplateUnfit (a ValueError): a template the loop cannot write episodes in exactly (not
      prefix-stable, no tool messages, or no end token closes a turn).
  """
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    return None
  first = tokenizer.encode(assistant_close(template.render, template.origin))[:1]
  special = [t for t in first if tokenizer.decode([t]) == ""]  # dropped as special: a tag
  ends = [t for t in dict.fromkeys([*eos_token_ids, tokenizer.eos_id, *special]) if t is not None]
  return ChatTurns(template.render, name=template.origin,
                   end_tokens=[tokenizer.decode([t], skip_special=False) for t in ends])
