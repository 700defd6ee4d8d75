"""Built-in suite 3: tiny multi-file repository tasks where the tools matter.

Each task is a repository of two to four files (a module, a config or helper file, a visible
test) with one bug whose fix needs information the agent must fetch with a tool: the value a
visible test expects (shown by `run_tests`), the name of a helper defined in another file
(`read_file`), or the name of a module that exists (`list_files`). Hidden tests (the visible
test plus more cases) grade the final files (`envs.reward`, "all_pass").

The tasks are sized for a byte-level model with a context of a few hundred tokens: files of a
few lines, short names, one-line instructions. Templates:

  const    a constant in the config file is wrong; the failing test prints the value it expects
           (and the value it got, the constant's current value)
  helper   the module calls `util.name` with a misspelt name; the helper file has the real one
           beside a distractor
  op       a two-argument function uses the wrong operator; the test shows the arguments and
           the expected result
  imports  the module imports from a module that does not exist; `list_files` shows the one
           that defines the function (beside a distractor module)
  rename   the test imports a function the module defines under a misspelt name

Every task carries its oracle in `metadata` (see `_meta`): the edit that fixes it, the steps of
solutions with what each step's observation must show and what it teaches, and a wrong first
attempt where the template has a natural one, so a scripted policy (`envs.tasks.transcripts`)
can solve it and tests can check that the fix really needs what the tools show.

The held-out split is new combinations: a task is held out when its combination (file, function,
constant or helper names and values) hashes into the test share; no two tasks share a visible
test assertion or a fix, so no held-out repository, failing assertion or fix appears verbatim in the
train split, while every name and template does.
"""

from __future__ import annotations

import builtins
import hashlib
import keyword
import random
import sys
from typing import Callable

from envs.tasks import task_format

SUITE = "repo"
TEMPLATES = ("const", "helper", "op", "imports", "rename")
# The tools a solution needs; the agent loop's system prompt lists only these.
TOOLS = ("run_tests", "read_file", "edit_file", "list_files", "submit")
LIMITS = task_format.Limits(timeout_s=5.0, memory_mb=256, max_turns=8, max_tokens=1024,
                            wall_s=120.0)

_MODS = ("app", "core", "calc", "shop", "game", "bank", "geo", "stats", "cart", "farm", "pay",
         "zoo", "deck", "road", "mail", "club")
_CFGS = ("cfg", "conf", "consts", "params", "limits", "knobs")
_UTILS = ("util", "utils", "helpers", "lib", "tools", "common", "misc", "base")
_CONSTS = ("LIMIT", "MAX", "SIZE", "STEP", "BASE", "RATE", "COUNT", "DEPTH", "WIDTH", "SCALE",
           "BONUS", "FEE", "TAX", "CAP", "OFFSET", "GAIN", "TOP", "UNIT")
# const kinds: (function names, body with {K} for the constant, the function of (x, K), an
# input whose output is K, so the failing test shows the value the constant must take).
_CONST_KINDS = {
    "cap": (("cap", "clamp", "bound", "clip"), "min(x, {K})", min, 99),
    "scale": (("scale", "times", "grow", "mult"), "x * {K}", lambda x, k: x * k, 1),
    "shift": (("shift", "bump", "lift", "raise_by"), "x + {K}", lambda x, k: x + k, 0),
}
# Helpers: name -> (body in x, the function it computes).
_HELPERS: dict[str, tuple[str, Callable[[int], int]]] = {
    "double": ("2 * x", lambda x: 2 * x),
    "triple": ("3 * x", lambda x: 3 * x),
    "square": ("x * x", lambda x: x * x),
    "negate": ("-x", lambda x: -x),
    "increment": ("x + 1", lambda x: x + 1),
    "decrement": ("x - 1", lambda x: x - 1),
    "halve": ("x // 2", lambda x: x // 2),
    "cube": ("x ** 3", lambda x: x ** 3),
    "tenfold": ("10 * x", lambda x: 10 * x),
    "shrink": ("x // 3", lambda x: x // 3),
}
_FNS = ("run", "go", "calc", "apply", "work", "step", "compute", "proc", "solve", "eval_x",
        "handle", "make")
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_OP_FNS = ("combine", "mix", "merge", "join", "pair", "fuse", "blend", "link")
_TEST_SHARE = 0.3  # Of the name combinations, per template.


def _stable_hash(*parts) -> float:
  """A number in [0, 1) from the parts, the same in every process (unlike hash())."""
  digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2**64


def _typo(name: str, rng: random.Random, avoid) -> str:
  """`name` with one inner letter dropped (a misspelling the agent must map back)."""
  options = sorted({name[:i] + name[i + 1:] for i in range(1, len(name) - 1)} - set(avoid))
  return rng.choice(options)


_SYLLABLES = ("ba", "ko", "ri", "mu", "te", "zo", "la", "pi", "ne", "su", "da", "vo", "gi", "fa",
              "ru", "ho", "me", "ti", "no", "ka")
NAMES = ("standard", "random")


class _Names:
  """Where a template's file, function and constant names come from.

  "standard": the suite's fixed lists (every held-out task's names appear in train tasks).
  "random": a fresh made-up word for each (two or three syllables), so the only way to get a
  name right is to copy it from the instructions or a tool's output, never to recall it: an
  augmentation for pre-training transcripts, which teaches the model to copy names from its
  context rather than memorise the train tasks'. Standard mode draws exactly what
  `rng.choice` / `rng.sample` over the lists draw, so the suite itself does not change.
  """

  def __init__(self, mode: str):
    if mode not in NAMES:
      raise ValueError(f"names must be one of {NAMES}, got {mode!r}")
    self.random = mode == "random"

  def _word(self, rng: random.Random, upper: bool, avoid) -> str:
    while True:
      w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
      w = w.upper() if upper else w
      low = w.lower()
      # Never a name Python already means something by (a module named `time` shadows none:
      # `from time import f` finds the standard library's).
      if (w not in avoid and low not in _HELPERS and not keyword.iskeyword(low)
          and low not in sys.stdlib_module_names and not hasattr(builtins, low)):
        return w

  def pick(self, rng: random.Random, names, avoid=()) -> str:
    if not self.random:
      return rng.choice([n for n in names if n not in avoid] if avoid else names)
    return self._word(rng, names[0].isupper(), set(avoid))

  def sample(self, rng: random.Random, names, k: int, avoid=()) -> list:
    """k distinct names, none in `avoid`."""
    if not self.random:
      if set(avoid) & set(names):
        raise ValueError(f"standard names {sorted(set(avoid) & set(names))} cannot be avoided "
                         "without changing the suite's draws")
      return rng.sample(names, k)
    out: list = []
    while len(out) < k:
      out.append(self._word(rng, names[0].isupper(), set(out) | set(avoid)))
    return out


def _test_file(mod: str, fn: str, cases: list[tuple[str, int]], name: str) -> str:
  """A test function asserting each call's value; the message is the value it got."""
  body = "".join(f"    assert {c} == {want}, {c}\n" for c, want in cases)
  return f"from {mod} import {fn}\n\n\ndef test_{name}():\n{body}"


def _step(tool: str, args: dict, expect: str, fact: str) -> dict:
  """One tool call of an oracle solution.

  expect: text its observation must contain (what the next step relies on); fact: what the
  agent knows from it, in a few words (the stuff of a self-summary).
  """
  return {"tool": tool, "args": args, "expect": expect, "fact": fact}


def _meta(template: str, key: tuple, fix: dict, *, direct: list, tests_first: list,
          wrong_first: list | None, wrong: dict | None, shows: str) -> dict:
  """The oracle for one task.

  fix: the edit that solves it, edit_file's arguments {"path", "old", "new"}.
  direct, tests_first: the steps (`_step`) before the fix, without and with running the visible
    tests first.
  wrong_first, wrong: the steps before a wrong first edit, and that edit (its "old" is the
    fix's "old"; after it the visible tests fail, showing `wrong["shows"]`, which teaches
    `wrong["fact"]`, and the fix is applied from the wrong state); None where the template has
    no natural wrong attempt.
  shows: what the failing visible test shows that the fix needs.
  """
  return {"template": template, "key": list(key), "fix": fix, "direct": direct,
          "tests_first": tests_first, "wrong_first": wrong_first, "wrong": wrong,
          "shows": shows}


def _const(rng: random.Random, names: _Names):
  kind = rng.choice(sorted(_CONST_KINDS))
  fns, body, f, probe = _CONST_KINDS[kind]
  # Each name avoids those it must differ from: made-up names are drawn independently, and a
  # config module named like the module would overwrite it (the standard lists are disjoint,
  # so their draws are unchanged).
  mod = names.pick(rng, _MODS)
  cfg = names.pick(rng, _CFGS, avoid=(mod,))
  k, fn = names.pick(rng, _CONSTS), names.pick(rng, fns)
  other = names.pick(rng, _CONSTS, avoid=(k,))
  new = rng.randint(2, 60)
  old = rng.choice([v for v in range(2, 61) if v != new])
  other_v = rng.choice([v for v in range(2, 61) if v not in (new, old)])
  lines = [f"{k} = {old}\n", f"{other} = {other_v}\n"]
  rng.shuffle(lines)
  test = f"test_{mod}.py"
  files = {
      f"{cfg}.py": "".join(lines),
      f"{mod}.py": f"from {cfg} import {k}\n\n\ndef {fn}(x):\n    return {body.format(K=k)}\n",
      test: _test_file(mod, fn, [(f"{fn}({probe})", new)], fn),
  }
  more = [1, 200] if kind == "cap" else [3, 7]
  hidden = (f"import {cfg}\n" +
            _test_file(mod, fn, [(f"{fn}({x})", f(x, new)) for x in [probe] + more], fn) +
            f"\n\ndef test_{k.lower()}_value():\n    assert {cfg}.{k} == {new}\n")
  fix = {"path": f"{cfg}.py", "old": f"{k} = {old}", "new": f"{k} = {new}"}
  wrong_v = rng.choice([v for v in (old + 1, old - 1, probe) if v not in (new, old) and v > 0])
  read_cfg = _step("read_file", {"path": f"{cfg}.py"}, fix["old"], f"{cfg}.py has {k} = {old}")
  meta = _meta(
      "const", (cfg, k, fn, mod, old, new), fix,
      # The instructions name the config file, not the module or its test: list them first.
      direct=[_step("list_files", {}, test, f"the test is {test}"),
              _step("read_file", {"path": test}, f"assert {fn}({probe}) == {new}",
                    f"{test} wants {fn}({probe}) == {new}"), read_cfg],
      tests_first=[_step("run_tests", {}, f"== {new}, {fn}({probe})\n  AssertionError: {old}",
                         f"{fn}({probe}) is {old}, tests want {new}")],
      wrong_first=[read_cfg],
      wrong={"path": f"{cfg}.py", "old": fix["old"], "new": f"{k} = {wrong_v}",
             "shows": f"== {new}, {fn}({probe})\n  AssertionError: {wrong_v}",
             "fact": f"{k} = {wrong_v} fails, tests want {new}"},
      shows=f"== {new}")
  instructions = f"Set {k} in {cfg}.py to what the tests expect."
  return instructions, files, {f"test_{mod}_full.py": hidden}, [test], meta


def _helper(rng: random.Random, names: _Names):
  # The helper module must not be the module (one file would overwrite the other) nor share the
  # function's name (`def util` would shadow `import util`); see _const.
  mod = names.pick(rng, _MODS)
  util = names.pick(rng, _UTILS, avoid=(mod,))
  fn = names.pick(rng, _FNS, avoid=(util,))
  right, decoy = rng.sample(sorted(_HELPERS), 2)
  typo = _typo(right, rng, _HELPERS)
  r_f, d_f = _HELPERS[right][1], _HELPERS[decoy][1]
  x = next(v for v in rng.sample(range(2, 12), 10) if r_f(v) != d_f(v))
  defs = [f"def {h}(x):\n    return {_HELPERS[h][0]}\n" for h in (right, decoy)]
  rng.shuffle(defs)
  test = f"test_{mod}.py"
  files = {
      f"{util}.py": "\n\n".join(defs),
      f"{mod}.py": f"import {util}\n\n\ndef {fn}(x):\n    return {util}.{typo}(x)\n",
      test: _test_file(mod, fn, [(f"{fn}({x})", r_f(x))], fn),
  }
  more = [v for v in range(-3, 20) if r_f(v) != d_f(v) and v != x][:3]
  hidden = _test_file(mod, fn, [(f"{fn}({v})", r_f(v)) for v in [x] + more], fn)
  fix = {"path": f"{mod}.py", "old": typo, "new": right}
  err = f"AttributeError: module '{util}' has no attribute '{typo}'"
  read_util = _step("read_file", {"path": f"{util}.py"}, f"def {right}(x)",
                    f"{util}.py has {right} and {decoy}")
  meta = _meta(
      "helper", (util, typo, right, decoy, fn), fix, direct=[read_util],
      tests_first=[_step("run_tests", {}, err, f"{util} has no {typo}"), read_util],
      wrong_first=[read_util],
      wrong={"path": f"{mod}.py", "old": fix["old"], "new": decoy,
             "shows": f"== {r_f(x)}, {fn}({x})\n  AssertionError: {d_f(x)}",
             "fact": f"{decoy} gives {d_f(x)}, tests want {r_f(x)}"},
      shows=err)
  instructions = f"{mod}.py calls {util}.{typo}, which {util}.py does not define."
  return instructions, files, {f"test_{mod}_full.py": hidden}, [test], meta


def _op(rng: random.Random, names: _Names):
  mod, fn = names.pick(rng, _MODS), names.pick(rng, _OP_FNS)
  right, bad = rng.sample(sorted(_OPS), 2)
  third = next(o for o in sorted(_OPS) if o not in (right, bad))

  def distinct(a, b):
    return len({f(a, b) for f in _OPS.values()}) == 3

  a, b = next((a, b) for a, b in ((rng.randint(3, 12), rng.randint(2, 9)) for _ in range(100))
              if distinct(a, b))
  test = f"test_{mod}.py"
  files = {
      f"{mod}.py": f"def {fn}(a, b):\n    return a {bad} b\n",
      test: _test_file(mod, fn, [(f"{fn}({a}, {b})", _OPS[right](a, b))], fn),
  }
  more = [(p, q) for p, q in ((5, 4), (9, 2), (7, 3), (4, 6))
          if distinct(p, q) and (p, q) != (a, b)]
  hidden = _test_file(mod, fn, [(f"{fn}({p}, {q})", _OPS[right](p, q)) for p, q in
                                [(a, b)] + more[:2]], fn)
  fix = {"path": f"{mod}.py", "old": f"a {bad} b", "new": f"a {right} b"}
  want = _OPS[right](a, b)
  shows = f"{fn}({a}, {b}) == {want}"
  read_mod = _step("read_file", {"path": f"{mod}.py"}, fix["old"], f"{mod}.py has a {bad} b")
  meta = _meta(
      "op", (mod, fn, a, b, right), fix,
      direct=[_step("read_file", {"path": test}, shows, f"tests want {shows}"), read_mod],
      tests_first=[_step("run_tests", {}, f"{shows}, {fn}({a}, {b})\n  AssertionError: "
                         f"{_OPS[bad](a, b)}", f"tests want {shows}"), read_mod],
      wrong_first=[read_mod],
      wrong={"path": f"{mod}.py", "old": fix["old"], "new": f"a {third} b",
             "shows": f"{shows}, {fn}({a}, {b})\n  AssertionError: {_OPS[third](a, b)}",
             "fact": f"a {third} b fails, tests want {shows}"},
      shows=shows)
  instructions = f"{fn} in {mod}.py uses the wrong operator."
  return instructions, files, {f"test_{mod}_full.py": hidden}, [test], meta


def _imports(rng: random.Random, names: _Names):
  mod, fn = names.pick(rng, _MODS), names.pick(rng, _FNS)
  lib, decoy = names.sample(rng, _UTILS, 2, avoid=(mod,))  # neither is the module (_const)
  missing = _typo(lib, rng, _UTILS)  # So the listing shows which module was meant.
  h, other = rng.sample(sorted(_HELPERS), 2)
  h_f = _HELPERS[h][1]
  x = rng.randint(2, 11)
  test = f"test_{mod}.py"
  files = {
      f"{lib}.py": f"def {h}(x):\n    return {_HELPERS[h][0]}\n",
      f"{decoy}.py": f"def {other}(x):\n    return {_HELPERS[other][0]}\n",
      f"{mod}.py": f"from {missing} import {h}\n\n\ndef {fn}(x):\n    return {h}(x)\n",
      test: _test_file(mod, fn, [(f"{fn}({x})", h_f(x))], fn),
  }
  hidden = _test_file(mod, fn, [(f"{fn}({v})", h_f(v)) for v in (x, x + 5, -2)], fn)
  fix = {"path": f"{mod}.py", "old": missing, "new": lib}
  err = f"No module named '{missing}'"
  listing = _step("list_files", {}, f"{lib}.py",
                  f"modules: {', '.join(sorted(p[:-3] for p in files if p != test))}")
  meta = _meta(
      "imports", (mod, missing, lib, decoy, h), fix, direct=[listing],
      tests_first=[_step("run_tests", {}, err, f"no module {missing}"), listing],
      wrong_first=[listing],
      wrong={"path": f"{mod}.py", "old": fix["old"], "new": decoy,
             "shows": f"cannot import name '{h}' from '{decoy}'",
             "fact": f"{decoy} has no {h}"},
      shows=err)
  instructions = f"{mod}.py imports {h} from {missing}, which does not exist."
  return instructions, files, {f"test_{mod}_full.py": hidden}, [test], meta


def _rename(rng: random.Random, names: _Names):
  mod, h = names.pick(rng, _MODS), rng.choice(sorted(_HELPERS))
  typo = _typo(h, rng, _HELPERS)
  h_f = _HELPERS[h][1]
  x = rng.randint(2, 11)
  test = f"test_{mod}.py"
  files = {
      f"{mod}.py": f"def {typo}(x):\n    return {_HELPERS[h][0]}\n",
      test: _test_file(mod, h, [(f"{h}({x})", h_f(x))], h),
  }
  hidden = _test_file(mod, h, [(f"{h}({v})", h_f(v)) for v in (x, x + 4, -3)], h)
  fix = {"path": f"{mod}.py", "old": f"def {typo}", "new": f"def {h}"}
  err = f"cannot import name '{h}' from '{mod}'"
  read_mod = _step("read_file", {"path": f"{mod}.py"}, fix["old"], f"{mod}.py has {typo}")
  meta = _meta(
      "rename", (mod, h, typo), fix,
      direct=[_step("read_file", {"path": test}, f"import {h}", f"tests import {h}"), read_mod],
      tests_first=[_step("run_tests", {}, err, f"tests import {h}"), read_mod],
      wrong_first=None, wrong=None, shows=err)
  instructions = f"The tests import a function that {mod}.py misnames."
  return instructions, files, {f"test_{mod}_full.py": hidden}, [test], meta


_BUILDERS = {"const": _const, "helper": _helper, "op": _op, "imports": _imports,
             "rename": _rename}


def generate(seed: int = 0, per_template: int = 80, names: str = "standard"
             ) -> list[task_format.Task]:
  """The suite: `per_template` tasks of each template, ids `repo-<template>-<n>`.

  names="random" makes up every file, function and constant name (`_Names`): tasks for
  pre-training transcripts only, ids `repo-random-<template>-<n>`, all in the train split (they
  are no benchmark: none of their names, repositories or fixes is the suite's).

  Deterministic in `seed`. No two tasks share a combination (`metadata["key"]`), a visible
  test assertion or a fix, and the split is a function of the combination, so a held-out task's
  repository, failing test and fix never appear in the train split.
  """
  namer, seen = _Names(names), _Seen()
  tasks = []
  for template in TEMPLATES:
    tasks += _draw(template, seed, per_template, namer, seen, exact=True,
                   prefix=f"{SUITE}-{'random-' if namer.random else ''}{template}",
                   split=None if not namer.random else "train")
  return tasks


def generate_fresh(suite: list[task_format.Task], seed: int, per_template: int,
                   templates: tuple[str, ...] = TEMPLATES) -> list[task_format.Task]:
  """More train tasks with the suite's names, none of which is any of `suite`'s.

  Up to `per_template` tasks of each of `templates` (fewer where the template's combinations run
  out: op's fixes are unique by module and operator pair, so the suite's 80 leave it almost
  none), ids `repo-fresh-<template>-<n>`, split "train". None shares a combination, a visible
  assertion or a fix with a task of `suite` (any split: held-out, validation or train) or with
  another: the same guarantee the suite gives between its train and held-out splits, so
  training on them never shows a held-out repository, failing test or fix. What they share
  with the suite is its name lists, as its own train and held-out tasks do. Deterministic in
  `seed`; use another seed than the suite's.
  """
  seen = _Seen()
  for t in suite:
    if t.suite == SUITE and "key" in t.metadata:
      seen.add(t.metadata["template"], t.metadata, t.files[t.visible_tests[0]])
  tasks = []
  for template in templates:
    if template not in _BUILDERS:
      raise ValueError(f"unknown template {template!r}; known: {TEMPLATES}")
    tasks += _draw(template, seed, per_template, _Names("standard"), seen, exact=False,
                   prefix=f"{SUITE}-fresh-{template}", split="train")
  return tasks


class _Seen:
  """The combinations, fixes and visible assertions already drawn."""

  def __init__(self):
    self.keys: set[tuple] = set()
    self.fixes: set[tuple] = set()
    self.asserts: set[str] = set()

  @staticmethod
  def _parts(template, meta, visible_text):
    asserts = [l.strip() for l in visible_text.splitlines() if "assert " in l]
    return (template, *map(str, meta["key"])), tuple(sorted(meta["fix"].items())), asserts

  def taken(self, template, meta, visible_text) -> bool:
    key, fix, asserts = self._parts(template, meta, visible_text)
    return key in self.keys or fix in self.fixes or any(a in self.asserts for a in asserts)

  def add(self, template, meta, visible_text) -> None:
    key, fix, asserts = self._parts(template, meta, visible_text)
    self.keys.add(key)
    self.fixes.add(fix)
    self.asserts.update(asserts)


def _draw(template: str, seed: int, count: int, namer: _Names, seen: _Seen, *, exact: bool,
          prefix: str, split: str | None) -> list[task_format.Task]:
  """`count` new tasks of `template` (fewer when not `exact` and the tries run out); `split`
  None: the suite's split by the combination's hash."""
  rng = random.Random(f"{SUITE}-{template}-{seed}")
  tasks, tries = [], 0
  while len(tasks) < count:
    tries += 1
    if tries > count * 50:
      if not exact:
        break
      raise ValueError(f"template {template}: only {len(tasks)} distinct tasks; lower "
                       "per_template")
    instructions, files, hidden, visible, meta = _BUILDERS[template](rng, namer)
    if not _edits_apply(files, meta) or seen.taken(template, meta, files[visible[0]]):
      continue  # Every repository, failing assertion and fix is the suite's only one.
    seen.add(template, meta, files[visible[0]])
    key = tuple(meta["key"])
    tasks.append(task_format.from_dict({
        "task_id": f"{prefix}-{len(tasks):03d}",
        "instructions": instructions,
        "files": files,
        "hidden_tests": hidden,
        "visible_tests": visible,
        "grading": "all_pass",
        "limits": {k: getattr(LIMITS, k) for k in
                   ("timeout_s", "memory_mb", "max_turns", "max_tokens", "wall_s")},
        "split": split or ("test" if _stable_hash(template, *key) < _TEST_SHARE else "train"),
        "suite": SUITE,
        "metadata": meta,
    }))
  return tasks


def _edits_apply(files: dict[str, str], meta: dict) -> bool:
  """Whether the oracle's edits each match exactly once (edit_file's rule): the fix on the
  repository, the wrong edit on it, and the fix from the wrong state."""
  fix, wrong = meta["fix"], meta["wrong"]
  text = files[fix["path"]]
  if text.count(fix["old"]) != 1:
    return False
  if wrong:
    after = text.replace(wrong["old"], wrong["new"], 1)
    return text.count(wrong["old"]) == 1 and after.count(wrong["new"]) == 1
  return True


def split(tasks: list[task_format.Task], which: str) -> list[task_format.Task]:
  """The "train" or "test" (held-out) tasks."""
  if which not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {which!r}")
  return [t for t in tasks if t.split == which]


def validation(tasks: list[task_format.Task], fraction: float = 0.15
               ) -> tuple[list[task_format.Task], list[task_format.Task]]:
  """Carves a validation split out of the train tasks: (train rest, validation).

  Difficulty is calibrated on validation, never on the held-out split. Deterministic; each
  template contributes in proportion.
  """
  if not 0 < fraction < 1:
    raise ValueError(f"fraction must be in (0, 1), got {fraction}")
  train = split(tasks, "train")
  valid = {t.task_id for t in train if _stable_hash("valid", t.task_id) < fraction}
  return ([t for t in train if t.task_id not in valid], [t for t in train if t.task_id in valid])


def solved_files(task: task_format.Task) -> dict[str, str]:
  """The task's files with the oracle fix applied."""
  fix = task.metadata["fix"]
  files = dict(task.files)
  text = files[fix["path"]]
  if text.count(fix["old"]) != 1:
    raise ValueError(f"{task.task_id}: fix's old text occurs {text.count(fix['old'])} times")
  files[fix["path"]] = text.replace(fix["old"], fix["new"], 1)
  return files
