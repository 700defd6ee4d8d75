"""Single-turn tasks for a chat model: the prompt in a user message, the code read from its reply.

A base model continues a task's prompt (`single_turn.CompletionStyle`: the signature and
docstring are the start of the file, the model writes the body). A chat model was trained on
conversations instead, so `ChatStyle` asks it: the prompt becomes one user message (`user_message`:
a short instruction, then the prompt in a ```python fence, as the chat-model HumanEval evaluations
-- evalplus, bigcode's instruct harness -- put it), rendered by the caller's `render_ids` with the
model's own chat template and generation prompt (templates are the model's business, which envs
does not import). The answer runs to the model's end of turn (its EOS ids, which the sampler
stops at): no stop strings, since a completion's ("\\ndef", "\\n#", a blank line) would cut the
code of a chat answer.

The graded solution.py is built from the answer (`solution_file`):

  code        `extract_code`: the first ```python (or ```py) fenced block, else the first plain
              ``` block, else the whole answer. A reasoning block (`<think>...</think>`, as Qwen3
              writes) is dropped first, so code drafted while thinking is not taken for the
              answer; a fence left open (the answer ran out of tokens) runs to the end.
  full def    code that defines the task's entry point at top level: solution.py is the prompt,
              then the code's imports, functions, classes and assignments (`definitions`: what
              evalplus's sanitiser keeps, without its reachability pruning), so example calls,
              prints, asserts and `if __name__ == "__main__":` blocks of the answer are not run
              with the test. The prompt stays in front so that its imports and helpers (some
              HumanEval tests call a helper the prompt defines) are there; the answer's
              definition replaces the prompt's docstring-only one.
  body only   anything else is a function body: appended to the prompt as a completion is,
              indented by four spaces when it starts at column 0 (chat answers often drop the
              indentation a body has inside its function).

Either way the check program (for HumanEval, the official `check(entry_point)`) runs on a file
that defines the entry point, so a full definition and a body are both graded on their merits.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Callable, Optional, Sequence

from envs.harness import policy as policy_lib
from envs.tasks import task_format

INSTRUCTION = ("Complete the following Python function. Reply with the complete function, "
               "signature included, in one ```python code block.")
# An opening fence at the start of a line and its info string ("python", "py", "" ...).
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*$", re.MULTILINE)
_CLOSE_RE = re.compile(r"^[ \t]*```[ \t]*$", re.MULTILINE)
_PYTHON_TAGS = ("python", "py", "python3")
_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
         ast.Assign, ast.AnnAssign)


def user_message(task: task_format.Task, instruction: str = INSTRUCTION) -> str:
  """The user turn that asks for `task`: the instruction, then the prompt in a ```python fence."""
  return f"{instruction}\n\n```python\n{task.prompt.strip()}\n```"


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
  """[(info string lowercased, body)] of the fenced blocks in `text`, in order; a fence never
  closed runs to the end of the text."""
  out, pos = [], 0
  while True:
    m = _FENCE_RE.search(text, pos)
    if m is None:
      return out
    start = m.end() + 1 if m.end() < len(text) else m.end()  # past the fence line's newline
    close = _CLOSE_RE.search(text, start)
    end = close.start() if close else len(text)
    out.append((m.group(1).lower(), text[start:end]))
    if close is None:
      return out
    pos = close.end()


def extract_code(answer: str) -> str:
  """The code of a chat answer (see the module docstring): after any `</think>`, the first
  Python fenced block, else the first untagged one, else the whole text."""
  if "</think>" in answer:
    answer = answer.rsplit("</think>", 1)[1]
  blocks = _fenced_blocks(answer)
  for tag, body in blocks:
    if tag in _PYTHON_TAGS:
      return body
  for tag, body in blocks:
    if not tag:
      return body
  return answer


def _defines(code: str, name: str) -> Optional[ast.Module]:
  """The parsed `code` if it defines function `name` at top level; None if it does not or does
  not parse."""
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError):
    return None
  if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
         for n in tree.body):
    return tree
  return None


def definitions(code: str, tree: ast.Module) -> str:
  """`code` reduced to its top-level imports, functions, classes and assignments (decorators
  kept), each in its original text and order."""
  lines = code.splitlines(keepends=True)
  kept = []
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module == "__future__":
      continue  # only legal at the top of a file, and the prompt comes first
    if isinstance(node, _KEPT):
      first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
      kept.append("".join(lines[first - 1:node.end_lineno]).rstrip() + "\n")
  return "\n".join(kept)


def _as_body(code: str) -> str:
  """`code` as the rest of the prompt's function: indented by four spaces when its first line
  with text starts at column 0, else as written."""
  first = next((line for line in code.splitlines() if line.strip()), "")
  if first[:1] in (" ", "\t"):
    return code
  return "".join("    " + line if line.strip() else line
                 for line in code.splitlines(keepends=True))


def solution_file(task: task_format.Task, answer: str) -> str:
  """solution.py for a chat `answer` to `task` (see the module docstring): the prompt plus the
  answer's definitions when the code defines `task.entry_point`, else plus the code as a body."""
  code = extract_code(answer)
  prompt = task.prompt if task.prompt.endswith("\n") else task.prompt + "\n"
  flush = textwrap.dedent(code)  # a whole answer indented (e.g. under a list item)
  tree = _defines(flush, task.entry_point) if task.entry_point else None
  if tree is not None:
    return prompt + "\n\n" + definitions(flush, tree)
  if task.entry_point and re.search(rf"^(async[ \t]+)?def[ \t]+{re.escape(task.entry_point)}\b",
                                    flush, re.MULTILINE):
    # A definition that does not parse: graded as written, so the test reports its error.
    return prompt + "\n\n" + flush
  return prompt + _as_body(code)


class ChatStyle:
  """The chat single-turn style (`single_turn.CompletionStyle`'s methods; module docstring).

  Args:
    render_ids: messages (OpenAI-style dicts) -> the prompt ids of the conversation with the
      assistant's turn opened: the model's chat template with its generation prompt, encoded by
      its tokenizer (what transformers' `apply_chat_template(..., add_generation_prompt=True)`
      gives). The template writes any BOS itself, so `policy.start_ids()` is not added.
    instruction: the request that precedes the prompt in the user message.
  """

  def __init__(self, render_ids: Callable[[Sequence[dict]], list[int]], *,
               instruction: str = INSTRUCTION):
    self.render_ids = render_ids
    self.instruction = instruction

  def messages(self, task: task_format.Task) -> list[dict]:
    return [{"role": "user", "content": user_message(task, self.instruction)}]

  def prompt_ids(self, task: task_format.Task, policy: policy_lib.Policy) -> list[int]:
    del policy  # the template holds every token of the prompt
    return list(self.render_ids(self.messages(task)))

  def stop(self, task: task_format.Task) -> tuple[str, ...]:
    del task  # the answer ends at the model's end of turn (EOS ids)
    return ()

  def solution(self, task: task_format.Task, completion_text: str) -> str:
    return solution_file(task, completion_text)
