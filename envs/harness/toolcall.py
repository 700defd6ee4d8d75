"""The chat and tool-calling text format, and the parser for the model's tool calls.

Follows the Hermes / Qwen convention, rendered as ChatML, so instruction-tuned open models use
it without prompting tricks:

    <|im_start|>system
    ...tool list in <tools></tools>...<|im_end|>
    <|im_start|>user
    {instructions}<|im_end|>
    <|im_start|>assistant
    I will look at the files.
    <tool_call>
    {"name": "read_file", "arguments": {"path": "calc/ops.py"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    ...file contents...
    </tool_response><|im_end|>
    <|im_start|>assistant
    ...

A turn may hold several tool calls; each gets one <tool_response> in order. A call whose JSON
does not parse, lacks "name", has non-object "arguments", or names an unknown tool yields an
error response; the episode goes on.
"""

from __future__ import annotations

import dataclasses
import json
import re

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
STOP = (CALL_CLOSE, IM_END)
# Every tag the template writes: a tokenizer trained for it keeps each one a single token.
TEMPLATE_TOKENS = (IM_START, IM_END, CALL_OPEN, CALL_CLOSE, "<tool_response>", "</tool_response>",
                   "<tools>", "</tools>")

TOOL_SPECS = [
    {"name": "list_files", "description": "List files under a directory of the repository.",
     "parameters": {"path": "string, default '.'"}},
    {"name": "read_file", "description": "Read a text file.",
     "parameters": {"path": "string"}},
    {"name": "write_file", "description": "Create or overwrite a file.",
     "parameters": {"path": "string", "content": "string"}},
    {"name": "edit_file", "description": "Replace the one occurrence of `old` with `new`.",
     "parameters": {"path": "string", "old": "string", "new": "string"}},
    {"name": "run", "description": "Run a shell command in the repository (no network).",
     "parameters": {"command": "string"}},
    {"name": "run_tests", "description": "Run the visible tests (or the given test ids).",
     "parameters": {"tests": "list of test ids, optional"}},
    {"name": "submit", "description": "Finish the episode; your files are graded by hidden "
                                      "tests.", "parameters": {}},
]
TOOL_NAMES = tuple(t["name"] for t in TOOL_SPECS)

_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


@dataclasses.dataclass
class ToolCall:
  name: str
  arguments: dict


@dataclasses.dataclass
class ParsedTurn:
  calls: list[ToolCall]
  errors: list[str]  # one per malformed call, in order
  order: list[tuple[str, int]]  # ("call", i) or ("error", i) in the order they appeared


def _optional(description: str) -> bool:
  return "optional" in description or "default" in description


def _signature(spec: dict) -> str:
  """A tool as `name(arg,arg?)`; `?` marks an argument that has a default or is optional."""
  args = [k + ("?" if _optional(v) else "") for k, v in spec["parameters"].items()]
  return f"{spec['name']}({','.join(args)})"


def system_prompt(tool_names: tuple[str, ...] | list[str] | None = None) -> str:
  """The system prompt listing the tools.

  Args:
    tool_names: None lists every tool with its JSON spec and shows a call (for real models). A
      subset lists only those tools, one `name(args)` line each, and nothing else: small models
      with context windows of a few hundred tokens cannot afford more, and learn the call format
      from pre-training transcripts. The tool-call format is the same either way.
  """
  if tool_names is None:
    tools = "\n".join(json.dumps(t, separators=(",", ":")) for t in TOOL_SPECS)
    return (
        "You are a coding agent working in a repository. Call tools to inspect and change it.\n"
        f"Tools:\n<tools>\n{tools}\n</tools>\n"
        "To call a tool, write:\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": "
        "{\"path\": \"a.py\"}}\n</tool_call>\nCall submit when done.")
  names = list(tool_names)
  unknown = [n for n in names if n not in TOOL_NAMES]
  if unknown or not names or len(set(names)) != len(names):
    raise ValueError(f"tool_names must be distinct names among {', '.join(TOOL_NAMES)}; "
                     f"got {names!r}")
  by_name = {t["name"]: t for t in TOOL_SPECS}
  tools = "\n".join(_signature(by_name[n]) for n in names)
  return f"<tools>\n{tools}\n</tools>"


def render_message(role: str, content: str) -> str:
  return f"{IM_START}{role}\n{content}{IM_END}\n"


def initial_prompt(instructions: str,
                   tool_names: tuple[str, ...] | list[str] | None = None) -> str:
  """System prompt (see `system_prompt` for `tool_names`), instructions, assistant header."""
  return (render_message("system", system_prompt(tool_names)) +
          render_message("user", instructions) + f"{IM_START}assistant\n")


ASSISTANT_HEADER = f"{IM_START}assistant\n"
_NOT_A_TURN = r"(?:(?!" + re.escape(IM_START) + r").)"
# An assistant turn's content: up to its <|im_end|> (or the end of the text), never into the
# next message (a header left open is no turn).
_ASSISTANT_TURN_RE = re.compile(re.escape(ASSISTANT_HEADER) + f"({_NOT_A_TURN}*?" +
                                re.escape(IM_END) + f"|{_NOT_A_TURN}*$)", re.S)


def assistant_spans(text: str) -> list[tuple[str, bool]] | None:
  """`text` (a rendered conversation) as [(piece, is the model's)], pieces in order: each
  assistant turn's content through its closing <|im_end|> is the model's, the rest (headers,
  system, user and tool turns) is not. None when the text is no conversation."""
  if not text.startswith(IM_START):
    return None
  out, at = [], 0
  for m in _ASSISTANT_TURN_RE.finditer(text):
    out.append((text[at:m.start(1)], False))
    if m.group(1):
      out.append((m.group(1), True))
    at = m.end(1)
  if at < len(text):
    out.append((text[at:], False))
  return [p for p in out if p[0]]


def render_responses(observations: list[str], *, generation_prompt: bool = True) -> str:
  """Tool responses as the next user turn, then (generation_prompt) the assistant header."""
  body = "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in observations)
  return render_message("user", body) + (ASSISTANT_HEADER if generation_prompt else "")


def parse(text: str) -> ParsedTurn:
  """Finds the tool calls in one assistant turn."""
  calls, errors, order = [], [], []
  for m in _CALL_RE.finditer(text):
    body = m.group(1)
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
      order.append(("error", len(errors) - 1))
      continue
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string.
      try:
        args = json.loads(args)
      except json.JSONDecodeError:
        args = None
    if not isinstance(name, str):
      errors.append('tool call needs a "name" string')
    elif name not in TOOL_NAMES:
      errors.append(f"unknown tool {name!r}; tools are {', '.join(TOOL_NAMES)}")
    elif not isinstance(args, dict):
      errors.append(f'"arguments" of {name} must be an object')
    else:
      calls.append(ToolCall(name, args))
      order.append(("call", len(calls) - 1))
      continue
    order.append(("error", len(errors) - 1))
  tail = text[text.rfind(CALL_CLOSE) + len(CALL_CLOSE):] if CALL_CLOSE in text else text
  if CALL_OPEN in tail:
    errors.append(f"unterminated tool call: {CALL_OPEN} without {CALL_CLOSE}")
    order.append(("error", len(errors) - 1))
  return ParsedTurn(calls, errors, order)
