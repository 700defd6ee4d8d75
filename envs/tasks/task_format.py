"""The task format, and a loader that validates tasks and rejects bad ones with reasons.

A task is a small repository, instructions, tests the agent may run and tests it never sees.

JSONL format (one task per line) or a directory per task:

    <dir>/task.json     every field below except `files` and `hidden_tests`
    <dir>/repo/...      `files`: the starting repository, visible tests included
    <dir>/hidden/...    `hidden_tests`: never copied into the agent's sandbox

Fields:
  task_id         unique, [A-Za-z0-9_.-]+
  instructions    what the agent is asked to do (for SWE tasks: the issue)
  files           {relative path: text}: the starting repository
  visible_tests   test ids the agent may run ("tests/test_x.py" or "tests/test_x.py::test_name")
  hidden_tests    {relative path: text}: hidden test files, written over the final files to grade
  hidden_test_ids test ids run for the reward (default: every hidden test file)
  grading         "all_pass" (1 if every hidden test passes), "fraction" (passed / total), or
                  "swe" (1 iff every fail_to_pass and pass_to_pass test passes)
  fail_to_pass, pass_to_pass   test ids (SWE style; required when grading is "swe")
  language        "python" (the only one the sandbox image has)
  limits          {"timeout_s", "memory_mb", "max_turns", "max_tokens", "wall_s"}
  split           "train" or "test" (held out)
  suite           where it came from; prompt, entry_point, solution: single-turn mode (see
                  suite_pyfunc); metadata: free-form.
  stop            single-turn stop strings: where a completion of `prompt` ends (default, empty:
                  envs.harness.single_turn.STOP, made for one-line bodies; a suite whose bodies
                  hold blank lines, such as suite_humaneval, sets its own)

Test ids follow pytest's `path::name` form; the sandbox runs them with `envs.sandbox.testrunner`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Mapping

GRADING_MODES = ("all_pass", "fraction", "swe")
LANGUAGES = ("python",)
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_MAX_REPO_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 10.0   # per command
  memory_mb: int = 512
  max_turns: int = 20
  max_tokens: int = 16384   # tokens the model may generate in the whole episode
  wall_s: float = 600.0     # whole episode


@dataclasses.dataclass(frozen=True)
class Task:
  task_id: str
  instructions: str
  files: Mapping[str, str]
  hidden_tests: Mapping[str, str]
  visible_tests: tuple[str, ...] = ()
  hidden_test_ids: tuple[str, ...] = ()
  grading: str = "all_pass"
  fail_to_pass: tuple[str, ...] = ()
  pass_to_pass: tuple[str, ...] = ()
  language: str = "python"
  limits: Limits = Limits()
  split: str = "train"
  suite: str = ""
  prompt: str = ""
  entry_point: str = ""
  solution: str = ""
  stop: tuple[str, ...] = ()
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def graded_test_ids(self) -> tuple[str, ...]:
    if self.grading == "swe":
      return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))
    return self.hidden_test_ids or tuple(sorted(self.hidden_tests))

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["files"] = dict(self.files)
    d["hidden_tests"] = dict(self.hidden_tests)
    d["metadata"] = dict(self.metadata)
    return d


@dataclasses.dataclass(frozen=True)
class Rejection:
  source: str
  task_id: str | None
  reasons: tuple[str, ...]


@dataclasses.dataclass
class LoadResult:
  tasks: list[Task]
  rejected: list[Rejection]


def _check_path(path: Any, what: str) -> list[str]:
  if not isinstance(path, str) or not path:
    return [f"{what}: path {path!r} is not a non-empty string"]
  if "\0" in path or "\\" in path:
    return [f"{what}: path {path!r} has a NUL or backslash"]
  norm = os.path.normpath(path)
  if os.path.isabs(path) or norm.startswith("..") or norm != path:
    return [f"{what}: path {path!r} must be relative, normalized and inside the repository"]
  return []


def _check_files(files: Any, what: str) -> list[str]:
  if not isinstance(files, Mapping):
    return [f"{what} must be an object of path -> text"]
  reasons, size = [], 0
  for path, text in files.items():
    reasons += _check_path(path, what)
    if not isinstance(text, str):
      reasons.append(f"{what}: {path!r} content is not text")
    else:
      size += len(text.encode())
  if size > _MAX_REPO_BYTES:
    reasons.append(f"{what} total {size} bytes over {_MAX_REPO_BYTES}")
  return reasons


def _check_ids(ids: Any, what: str, available: Iterable[str]) -> list[str]:
  if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
    return [f"{what} must be a list of test ids"]
  have = set(available)
  return [f"{what}: test id {i!r} names a file that does not exist" for i in ids
          if i.partition("::")[0] not in have]


def validate(d: Mapping[str, Any]) -> list[str]:
  """Reasons the task dict is bad (empty if good)."""
  reasons = []
  known = {f.name for f in dataclasses.fields(Task)}
  unknown = set(d) - known
  if unknown:
    reasons.append(f"unknown fields {sorted(unknown)}")
  tid = d.get("task_id")
  if not isinstance(tid, str) or not _ID_RE.match(tid):
    reasons.append(f"task_id {tid!r} must match {_ID_RE.pattern}")
  if not isinstance(d.get("instructions"), str) or not d.get("instructions", "").strip():
    reasons.append("instructions must be non-empty text")
  files = d.get("files", {})
  hidden = d.get("hidden_tests")
  reasons += _check_files(files, "files")
  if not hidden:
    reasons.append("hidden_tests must hold at least one test file")
  else:
    reasons += _check_files(hidden, "hidden_tests")
  if d.get("language", "python") not in LANGUAGES:
    reasons.append(f"language {d.get('language')!r} not supported (have {LANGUAGES})")
  grading = d.get("grading", "all_pass")
  if grading not in GRADING_MODES:
    reasons.append(f"grading {grading!r} must be one of {GRADING_MODES}")
  if isinstance(files, Mapping) and isinstance(hidden, Mapping):
    everything = set(files) | set(hidden)
    reasons += _check_ids(d.get("visible_tests", []), "visible_tests", files)
    reasons += _check_ids(d.get("hidden_test_ids", []), "hidden_test_ids", everything)
    reasons += _check_ids(d.get("fail_to_pass", []), "fail_to_pass", everything)
    reasons += _check_ids(d.get("pass_to_pass", []), "pass_to_pass", everything)
  stop = d.get("stop", [])
  if (not isinstance(stop, (list, tuple)) or
      not all(isinstance(x, str) and x for x in stop)):
    reasons.append(f"stop must be a list of non-empty strings, got {stop!r}")
  if grading == "swe" and not d.get("fail_to_pass"):
    reasons.append("grading 'swe' needs at least one fail_to_pass test")
  limits = d.get("limits", {})
  if not isinstance(limits, Mapping):
    reasons.append("limits must be an object")
  else:
    lknown = {f.name for f in dataclasses.fields(Limits)}
    for k, v in limits.items():
      if k not in lknown:
        reasons.append(f"limits: unknown key {k!r}")
      elif not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        reasons.append(f"limits: {k} must be a positive number, got {v!r}")
  return reasons


def from_dict(d: Mapping[str, Any]) -> Task:
  """Builds a Task from a validated dict; raises ValueError listing the reasons otherwise."""
  reasons = validate(d)
  if reasons:
    raise ValueError(f"bad task {d.get('task_id')!r}: " + "; ".join(reasons))
  kw = dict(d)
  kw["limits"] = Limits(**kw.get("limits", {}))
  for k in ("visible_tests", "hidden_test_ids", "fail_to_pass", "pass_to_pass", "stop"):
    kw[k] = tuple(kw.get(k, ()))
  kw["files"] = dict(kw.get("files", {}))
  kw["hidden_tests"] = dict(kw["hidden_tests"])
  return Task(**kw)


def _read_tree(root: str) -> dict[str, str]:
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    for name in sorted(filenames):
      full = os.path.join(dirpath, name)
      with open(full, encoding="utf-8") as f:
        out[os.path.relpath(full, root)] = f.read()
  return out


def load_tasks(path: str) -> LoadResult:
  """Loads a .jsonl file, one task directory, or a directory of task directories."""
  raw: list[tuple[str, Any]] = []
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if line.strip():
          try:
            raw.append((f"{path}:{n}", json.loads(line)))
          except json.JSONDecodeError as e:
            raw.append((f"{path}:{n}", f"invalid JSON: {e}"))
  else:
    dirs = [path] if os.path.exists(os.path.join(path, "task.json")) else [
        os.path.join(path, d) for d in sorted(os.listdir(path))
        if os.path.isdir(os.path.join(path, d))]
    for d in dirs:
      try:
        with open(os.path.join(d, "task.json"), encoding="utf-8") as f:
          meta = json.load(f)
        if not isinstance(meta, dict):
          raise ValueError("task.json is not an object")
        meta["files"] = _read_tree(os.path.join(d, "repo"))
        meta["hidden_tests"] = _read_tree(os.path.join(d, "hidden"))
        raw.append((d, meta))
      except (OSError, ValueError) as e:
        raw.append((d, f"unreadable task directory: {e}"))
  tasks, rejected, seen = [], [], set()
  for source, d in raw:
    if isinstance(d, str):
      rejected.append(Rejection(source, None, (d,)))
      continue
    if not isinstance(d, dict):
      rejected.append(Rejection(source, None, ("not a JSON object",)))
      continue
    reasons = validate(d)
    if d.get("task_id") in seen:
      reasons.append(f"duplicate task_id {d.get('task_id')!r}")
    if reasons:
      rejected.append(Rejection(source, d.get("task_id"), tuple(reasons)))
      continue
    seen.add(d["task_id"])
    tasks.append(from_dict(d))
  return LoadResult(tasks, rejected)


def dump_jsonl(tasks: Iterable[Task], path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for t in tasks:
      f.write(json.dumps(t.to_json()) + "\n")


def write_task_dir(task: Task, root: str) -> str:
  """Writes one task in the directory format; returns its directory."""
  d = os.path.join(root, task.task_id)
  meta = task.to_json()
  for part, files in (("repo", meta.pop("files")), ("hidden", meta.pop("hidden_tests"))):
    for rel, text in files.items():
      full = os.path.join(d, part, rel)
      os.makedirs(os.path.dirname(full), exist_ok=True)
      with open(full, "w", encoding="utf-8") as f:
        f.write(text)
  os.makedirs(os.path.join(d, "hidden"), exist_ok=True)
  with open(os.path.join(d, "task.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  return d
