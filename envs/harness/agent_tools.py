"""The agent's tools, run against its episode sandbox; each returns an observation string.

Every file operation and command goes through the sandbox (`envs.sandbox.Sandbox`), never the
host's view of the workspace. The toolbox also records what the agent ran and read, which
`envs.hacks` inspects for reward hacking.
"""

from __future__ import annotations

import re
import time

from envs import sandbox as sandbox_lib
from envs.sandbox import slot as slot_lib
from envs.sandbox import testexec
from envs.tasks import task_format


class InfraFailure(RuntimeError):
  """The sandbox broke under a tool call: the episode is an infrastructure failure."""


def _clip(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  half = limit // 2
  return f"{text[:half]}\n...[{len(text) - limit} characters cut]...\n{text[-half:]}"


_FRAME_RE = re.compile(r'^\s*File "(?:/workspace/)?([^"]*)", line (\d+), in .*$')
_CARETS_RE = re.compile(r"^\s*[\^~]+\s*$")


def _compact_message(message: str) -> list[str]:
  """A failure traceback as `path:line source` lines for the workspace's frames, then the error.

  Frames outside the workspace (the test runner's, importlib's), caret lines and the workspace's
  absolute path carry nothing the agent can act on; what it needs is the failing line (which
  shows the expected value) and the error.
  """
  out, lines, i = [], message.strip("\n").splitlines(), 0
  while i < len(lines):
    m = _FRAME_RE.match(lines[i])
    if m:
      source = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME_RE.match(
          lines[i + 1]) else ""
      if not m.group(1).startswith(("/", "<")):  # Not the runner's or importlib's frames.
        out.append(f"{m.group(1)}:{m.group(2)} {source}".rstrip())
      i += 2 if source else 1
    elif _CARETS_RE.match(lines[i]) or lines[i].startswith("Traceback (most recent call"):
      i += 1
    else:
      out.append(lines[i].strip().replace("/workspace/", ""))
      i += 1
  return out


# Observation limits below this are a small model's with a context of a few hundred tokens: test
# reports are always compact there. Above it (the default 4000) the full report is kept.
COMPACT_BELOW_CHARS = 1024


def report_text(report: testexec.TestReport, limit: int) -> str:
  """The test report as the agent sees it, within `limit` characters.

  With `limit` >= COMPACT_BELOW_CHARS, the full summary when it fits. Otherwise a compact one:
  the pass count, then each failing test's id, the failing `path:line source` lines and the
  error (passing tests are counted, not listed). If that is still too long, each failure keeps
  its id and its last two lines (the failing line, which shows the expected value, and the
  error), and failures that do not fit are counted.
  """
  full = report.summary()
  if report.infra_error or report.runner_failed or (
      limit >= COMPACT_BELOW_CHARS and len(full) <= limit):
    return _clip(full, limit)
  head = f"{report.num_passed}/{len(report.outcomes)} passed"
  blocks = [[f"{outcome.upper()} {tid}"] +
            ["  " + b for b in _compact_message(report.messages.get(tid, ""))]
            for tid, outcome in report.outcomes.items() if outcome != "passed"]
  text = "\n".join([head] + ["\n".join(b) for b in blocks])
  if len(text) <= limit:
    return text
  pieces = ["\n".join(b[:1] + b[1:][-2:]) for b in blocks]

  def render(n, count=True):  # The head, the first n failures, and a count of the others.
    rest = [f"... {len(pieces) - n} more failed"] if n < len(pieces) and count else []
    return "\n".join([head] + pieces[:n] + rest)

  n = len(pieces)
  while n > 1 and len(render(n)) > limit:
    n -= 1
  if len(render(n)) > limit:  # The first failure matters more than the count of the others.
    return render(n, count=False)[:limit]
  return render(n)


class ToolBox:
  """Tools bound to one episode's sandbox.

  `tool_names`, when given, are the only tools the agent was offered (the system prompt's list);
  a call to any other is an error observation, as for an unknown tool.
  """

  def __init__(self, sb: sandbox_lib.Sandbox, task: task_format.Task, *,
               observation_max_chars: int = 4000, tool_names: tuple[str, ...] | None = None):
    self.sb = sb
    self.tool_names = None if tool_names is None else tuple(tool_names)
    self.task = task
    self.max_chars = observation_max_chars
    self.commands: list[str] = []
    self.read_paths: list[str] = []
    self.events: list[dict] = []
    self.submitted = False

  def call(self, name: str, args: dict) -> tuple[str, bool]:
    """Runs one tool; returns (observation, ok). Raises InfraFailure if the sandbox broke."""
    fn = getattr(self, "tool_" + name, None)
    if fn is None or (self.tool_names is not None and name not in self.tool_names):
      offered = f"; tools are {', '.join(self.tool_names)}" if self.tool_names else ""
      return f"error: unknown tool {name!r}{offered}", False
    try:
      return fn(**args)
    except TypeError as e:
      return f"error: bad arguments for {name}: {e}", False
    except ValueError as e:
      return f"error: {e}", False
    except slot_lib.SlotError as e:
      raise InfraFailure(str(e)) from e

  def _exec(self, argv: list[str], **kw) -> slot_lib.Result:
    r = self.sb.exec(argv, timeout_s=kw.pop("timeout_s", self.task.limits.timeout_s),
                     memory_mb=self.task.limits.memory_mb, **kw)
    if r.infra_error:
      raise InfraFailure(r.infra_error)
    self.events += r.events
    return r

  def tool_list_files(self, path: str = ".") -> tuple[str, bool]:
    paths = self.sb.list_files(str(path))
    return _clip("\n".join(paths) or "(no files)", self.max_chars), True

  def tool_read_file(self, path: str) -> tuple[str, bool]:
    self.read_paths.append(str(path))
    files, skipped = self.sb.slot.read_files([str(path)])
    if path in skipped or not files:
      return f"error: cannot read {path}: {skipped.get(path, 'no such file')}", False
    return _clip(next(iter(files.values())), self.max_chars), True

  def tool_write_file(self, path: str, content: str) -> tuple[str, bool]:
    self.sb.write_files({str(path): str(content)})
    return f"wrote {len(str(content))} characters to {path}", True

  def tool_edit_file(self, path: str, old: str, new: str) -> tuple[str, bool]:
    files, skipped = self.sb.slot.read_files([str(path)])
    if not files:
      return f"error: cannot read {path}: {skipped.get(path, 'no such file')}", False
    text = next(iter(files.values()))
    count = text.count(old) if old else 0
    if count != 1:
      return (f"error: `old` must occur exactly once in {path}; it occurs {count} times"), False
    self.sb.write_files({str(path): text.replace(old, new, 1)})
    return f"edited {path}", True

  def tool_run(self, command: str) -> tuple[str, bool]:
    self.commands.append(str(command))
    t = time.monotonic()
    r = self._exec(["sh", "-c", str(command)])
    head = f"exit code {r.exit_code}" + (" (timed out)" if r.timed_out else "")
    head += f" in {time.monotonic() - t:.2f}s"
    out = head + ("\n" + r.stdout if r.stdout else "") + ("\n[stderr]\n" + r.stderr
                                                          if r.stderr else "")
    return _clip(out, self.max_chars), r.exit_code == 0 and not r.timed_out

  def tool_run_tests(self, tests: list[str] | None = None) -> tuple[str, bool]:
    ids = [str(t) for t in tests] if tests else list(self.task.visible_tests)
    if not ids:
      return "this task has no visible tests", True
    self.commands.append("run_tests " + " ".join(ids))
    report = testexec.run_tests(self.sb.slot, ids, total_timeout_s=self.task.limits.timeout_s * 4,
                                memory_mb=self.task.limits.memory_mb)
    if report.infra_error:
      raise InfraFailure(report.infra_error)
    if report.result is not None:
      self.events += report.result.events
    return (report_text(report, self.max_chars),
            report.num_passed == len(report.outcomes))

  def tool_submit(self) -> tuple[str, bool]:
    self.submitted = True
    return "submitted", True
