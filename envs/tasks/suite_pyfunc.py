"""Built-in suite 1: a few hundred tiny, templated Python function tasks, and a code corpus.

The tasks are deliberately trivial and formulaic ("return x plus 3", "count 'e' in s") with
one-line solutions, so a byte-level MoE of a few million parameters, pre-trained for minutes on
the CPU, can learn some of them. Each family has a parameter; about one parameter in six is held
out (split "test"), so held-out tasks test generalisation across a template the model has seen.

Single-turn format (what the tiny model is trained on): the prompt is a comment with the
instructions and the function signature, and the model writes the body, e.g.

    # return x plus 3
    def add_3(x):
        return x + 3

`pretraining_corpus` returns documents in exactly that format: train-split tasks with their
solutions plus other generated snippets. No held-out task's prompt or solution appears in it.
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any, Callable

from envs.tasks import task_format

SUITE = "pyfunc"
HELDOUT_FRACTION = 1 / 6


def _int_inputs(rng):
  return [(rng.randint(-20, 40),) for _ in range(6)]


def _str_inputs(rng):
  return [("".join(rng.choice("abcdefghij xyz") for _ in range(rng.randint(0, 9))),)
          for _ in range(6)]


def _list_inputs(rng):
  return [([rng.randint(-9, 20) for _ in range(rng.randint(1, 6))],) for _ in range(6)]


# (family, params, name template, args, description template, body template, inputs, reference)
_FAMILIES: list[tuple[str, list[Any], str, str, str, str, Callable, Callable]] = [
    ("add", list(range(1, 31)), "add_{p}", "x", "return x plus {p}", "return x + {p}",
     _int_inputs, lambda p: lambda x: x + p),
    ("sub", list(range(1, 21)), "sub_{p}", "x", "return x minus {p}", "return x - {p}",
     _int_inputs, lambda p: lambda x: x - p),
    ("mul", list(range(2, 21)), "mul_{p}", "x", "return x times {p}", "return x * {p}",
     _int_inputs, lambda p: lambda x: x * p),
    ("mod", list(range(2, 16)), "mod_{p}", "x", "return x modulo {p}", "return x % {p}",
     _int_inputs, lambda p: lambda x: x % p),
    ("isdiv", list(range(2, 16)), "is_div_{p}", "x", "return True if x is divisible by {p}",
     "return x % {p} == 0", _int_inputs, lambda p: lambda x: x % p == 0),
    ("gt", list(range(0, 21)), "gt_{p}", "x", "return True if x is greater than {p}",
     "return x > {p}", _int_inputs, lambda p: lambda x: x > p),
    ("pow", [2, 3, 4, 5], "pow_{p}", "x", "return x to the power {p}", "return x ** {p}",
     _int_inputs, lambda p: lambda x: x ** p),
    ("rep", list(range(2, 11)), "repeat_{p}", "s", "return s repeated {p} times",
     "return s * {p}", _str_inputs, lambda p: lambda s: s * p),
    ("count", list("abcdefghijxyz"), "count_{p}", "s", "return how many times '{p}' is in s",
     "return s.count('{p}')", _str_inputs, lambda p: lambda s: s.count(p)),
    ("has", list("abcdefghijxyz"), "has_{p}", "s", "return True if '{p}' is in s",
     "return '{p}' in s", _str_inputs, lambda p: lambda s: p in s),
    ("suffix", ["ab", "ok", "xy", "end", "go", "io", "py", "zz", "no", "up", "hi", "me"],
     "add_{p}_end", "s", "return s with '{p}' added at the end", "return s + '{p}'",
     _str_inputs, lambda p: lambda s: s + p),
    ("prefix", ["ab", "ok", "xy", "pre", "go", "io", "py", "zz", "no", "up", "hi", "me"],
     "add_{p}_start", "s", "return s with '{p}' added at the start", "return '{p}' + s",
     _str_inputs, lambda p: lambda s: p + s),
    ("nth", list(range(0, 6)), "item_{p}", "xs", "return item {p} of xs, or None if too short",
     "return xs[{p}] if len(xs) > {p} else None", _list_inputs,
     lambda p: lambda xs: xs[p] if len(xs) > p else None),
    ("take", list(range(1, 9)), "first_{p}", "xs", "return the first {p} items of xs",
     "return xs[:{p}]", _list_inputs, lambda p: lambda xs: xs[:p]),
    ("scale", list(range(2, 11)), "scale_{p}", "xs", "return xs with each item times {p}",
     "return [x * {p} for x in xs]", _list_inputs, lambda p: lambda xs: [x * p for x in xs]),
    ("cntgt", list(range(0, 11)), "count_gt_{p}", "xs",
     "return how many items of xs are greater than {p}",
     "return sum(1 for x in xs if x > {p})", _list_inputs,
     lambda p: lambda xs: sum(1 for x in xs if x > p)),
    ("keepgt", list(range(0, 11)), "keep_gt_{p}", "xs", "return the items of xs greater than {p}",
     "return [x for x in xs if x > {p}]", _list_inputs,
     lambda p: lambda xs: [x for x in xs if x > p]),
    ("addall", list(range(1, 11)), "add_all_{p}", "xs", "return xs with {p} added to each item",
     "return [x + {p} for x in xs]", _list_inputs, lambda p: lambda xs: [x + p for x in xs]),
]

# Parameter-free tasks: (name, args, description, body, inputs, reference).
_SINGLES = [
    ("reverse", "s", "return s reversed", "return s[::-1]", _str_inputs, lambda s: s[::-1]),
    ("upper", "s", "return s in upper case", "return s.upper()", _str_inputs, str.upper),
    ("length", "s", "return the length of s", "return len(s)", _str_inputs, len),
    ("first_char", "s", "return the first character of s, or '' if s is empty",
     "return s[:1]", _str_inputs, lambda s: s[:1]),
    ("last_char", "s", "return the last character of s, or '' if s is empty",
     "return s[-1:]", _str_inputs, lambda s: s[-1:]),
    ("max_list", "xs", "return the largest item of xs", "return max(xs)", _list_inputs, max),
    ("min_list", "xs", "return the smallest item of xs", "return min(xs)", _list_inputs, min),
    ("sum_list", "xs", "return the sum of xs", "return sum(xs)", _list_inputs, sum),
    ("len_list", "xs", "return the number of items in xs", "return len(xs)", _list_inputs, len),
    ("sort_list", "xs", "return xs sorted", "return sorted(xs)", _list_inputs, sorted),
    ("reverse_list", "xs", "return xs reversed", "return xs[::-1]", _list_inputs,
     lambda xs: xs[::-1]),
    ("double", "x", "return x doubled", "return x * 2", _int_inputs, lambda x: x * 2),
    ("square", "x", "return x squared", "return x * x", _int_inputs, lambda x: x * x),
    ("negate", "x", "return minus x", "return -x", _int_inputs, lambda x: -x),
    ("is_even", "x", "return True if x is even", "return x % 2 == 0", _int_inputs,
     lambda x: x % 2 == 0),
    ("absolute", "x", "return the absolute value of x", "return abs(x)", _int_inputs, abs),
]


def _is_heldout(family: str, param: Any) -> bool:
  h = hashlib.sha256(f"{family}:{param}".encode()).digest()
  return h[0] < 256 * HELDOUT_FRACTION


def format_prompt(description: str, name: str, args: str) -> str:
  """The single-turn prompt: instructions as a comment, then the signature."""
  return f"# {description}\ndef {name}({args}):\n"


def _test_file(name: str, cases: list[tuple[tuple, Any]]) -> str:
  lines = [f"from solution import {name}\n"]
  for i, (args, want) in enumerate(cases):
    call = ", ".join(repr(a) for a in args)
    lines.append(f"\ndef test_{i}():\n    assert {name}({call}) == {want!r}\n")
  return "".join(lines)


def _make_task(family, param, name, args, desc, body, inputs, ref, heldout) -> task_format.Task:
  rng = random.Random(f"{family}:{param}")
  cases = [(a, ref(*a)) for a in inputs(rng)]
  visible, hidden = cases[:1], cases[1:]
  prompt = format_prompt(desc, name, args)
  solution = f"    {body}\n"
  instructions = (f"Implement `{name}({args})` in solution.py: {desc}. "
                  "Run the visible tests, then submit.")
  files = {
      "solution.py": prompt + "    raise NotImplementedError\n",
      "test_visible.py": _test_file(name, visible),
  }
  return task_format.Task(
      task_id=f"pyfunc-{name}", instructions=instructions, files=files,
      hidden_tests={"test_hidden.py": _test_file(name, hidden)},
      visible_tests=("test_visible.py",), hidden_test_ids=("test_hidden.py",),
      grading="all_pass", split="test" if heldout else "train", suite=SUITE, prompt=prompt,
      entry_point=name, solution=solution,
      limits=task_format.Limits(timeout_s=5.0, memory_mb=256, max_turns=8, max_tokens=2048),
      metadata={"family": family, "param": param})


def generate() -> list[task_format.Task]:
  """All tasks of the suite, deterministic (several hundred; about 1/6 held out)."""
  out = []
  for family, params, name_t, args, desc_t, body_t, inputs, ref in _FAMILIES:
    for p in params:
      out.append(_make_task(family, p, name_t.format(p=p), args, desc_t.format(p=p),
                            body_t.format(p=p), inputs, ref(p), _is_heldout(family, p)))
  for name, args, desc, body, inputs, ref in _SINGLES:
    out.append(_make_task(name, None, name, args, desc, body, inputs, ref,
                          _is_heldout(name, None)))
  return out


def split(all_tasks: list[task_format.Task], which: str) -> list[task_format.Task]:
  return [t for t in all_tasks if t.split == which]


# Extra snippets for the corpus: same format, names and bodies no task uses.
def _snippets(rng: random.Random, n: int) -> list[str]:
  makers = [
      lambda a, b: (f"return x times {a} plus {b}", f"lin_{a}_{b}", "x",
                    f"return x * {a} + {b}"),
      lambda a, b: (f"return x plus y plus {a}", f"sum2_{a}", "x, y", f"return x + y + {a}"),
      lambda a, b: (f"return the smaller of x and {a}", f"cap_{a}", "x", f"return min(x, {a})"),
      lambda a, b: (f"return the larger of x and {a}", f"floor_{a}", "x",
                    f"return max(x, {a})"),
      lambda a, b: (f"return True if x is between {a} and {a + b}", f"between_{a}_{a + b}", "x",
                    f"return {a} <= x <= {a + b}"),
      lambda a, b: (f"return a list of {a} zeros", f"zeros_{a}", "", f"return [0] * {a}"),
      lambda a, b: (f"return the numbers from 0 to {a}", f"upto_{a}", "",
                    f"return list(range({a + 1}))"),
      lambda a, b: (f"return s without '{string.ascii_lowercase[a % 26]}'",
                    f"drop_{string.ascii_lowercase[a % 26]}", "s",
                    f"return s.replace('{string.ascii_lowercase[a % 26]}', '')"),
      lambda a, b: (f"return x if x is positive, else {a}", f"pos_or_{a}", "x",
                    f"return x if x > 0 else {a}"),
      lambda a, b: ("return the last item of xs", "last_item", "xs", "return xs[-1]"),
      lambda a, b: (f"return x divided by {a + 1}, rounded down", f"div_{a + 1}", "x",
                    f"return x // {a + 1}"),
  ]
  out = []
  for _ in range(n):
    desc, name, args, body = rng.choice(makers)(rng.randint(1, 30), rng.randint(1, 9))
    out.append(format_prompt(desc, name, args) + f"    {body}\n")
  return out


def pretraining_corpus(all_tasks: list[task_format.Task] | None = None, *, n_snippets: int = 2000,
                       repeats: int = 1, seed: int = 0) -> list[str]:
  """Documents for pre-training: train-split tasks (prompt + solution) and other snippets.

  Every document is in the single-turn format (see the module docstring); held-out tasks never
  appear, neither their prompt nor their solution. Shuffled deterministically by `seed`.
  """
  all_tasks = generate() if all_tasks is None else all_tasks
  heldout = [t for t in all_tasks if t.split != "train"]
  docs = [t.prompt + t.solution for t in all_tasks if t.split == "train"] * repeats
  rng = random.Random(seed)
  banned = {t.prompt for t in heldout}
  docs += [d for d in _snippets(rng, n_snippets) if not any(b in d for b in banned)]
  rng.shuffle(docs)
  return docs
