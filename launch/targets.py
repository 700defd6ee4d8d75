"""Turning a job's executable into a command line: Bazel targets, Python modules, commands.

Bazel targets are built once per experiment (`bazel build` of every label, one invocation) and
run from `<workspace>/bazel-bin/<package>/<name>`, the launcher script Bazel writes for a
py_binary (it sets up runfiles and the interpreter).

Fallback without Bazel (`use_bazel=False`; tests, or machines where Bazel is unavailable): a label
`//pkg/sub:name` runs as `python -m pkg.sub.name` from the workspace root with the launching
interpreter. That is exact for this project's convention that a py_binary `name` has
`main = "name.py"` in its package and imports from the workspace root; a target whose module file
does not exist is a clear error, never a guess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from launch import spec


class TargetError(RuntimeError):
  """A target cannot be built or resolved to a program."""


def workspace_root() -> str:
  """The workspace: $BUILD_WORKSPACE_DIRECTORY under `bazel run`, else this checkout."""
  ws = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
  if ws:
    return ws
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bazel_command() -> str:
  return os.environ.get("LAUNCH_BAZEL", "bazel")


def build(labels: Sequence[str], *, root: str, bazel_args: Sequence[str] = ()) -> None:
  """One `bazel build` of every label (no-op for none)."""
  if not labels:
    return
  exe = shutil.which(bazel_command())
  if exe is None:
    raise TargetError(f"{bazel_command()!r} is not on PATH; install Bazel or launch with "
                      "use_bazel=False (--nobazel) to run targets as Python modules")
  cmd = [exe, "build", *bazel_args, "--", *labels]
  proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, check=False)
  if proc.returncode != 0:
    tail = "\n".join(proc.stdout.splitlines()[-30:])
    raise TargetError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")


def bazel_bin_path(label: str, root: str) -> str:
  pkg, name = spec.parse_label(label)
  return os.path.join(root, "bazel-bin", pkg, name)


def module_of_label(label: str, root: str) -> str:
  """//pkg/sub:name -> "pkg.sub.name" if <root>/pkg/sub/name.py exists (see module docstring)."""
  pkg, name = spec.parse_label(label)
  path = os.path.join(root, pkg, name + ".py")
  if not os.path.isfile(path):
    raise TargetError(f"cannot run {label} without Bazel: {path} does not exist (the fallback "
                      "needs a py_binary whose main is <package>/<name>.py)")
  return ".".join([p for p in pkg.split("/") if p] + [name])


def command(executable: spec.Executable, *, root: str, use_bazel: bool) -> list[str]:
  """The argv prefix (before the job's args) for `executable`."""
  if isinstance(executable, spec.Command):
    return list(executable.argv)
  if isinstance(executable, spec.PyModule):
    return [sys.executable, "-u", "-m", executable.module]
  if use_bazel:
    path = bazel_bin_path(executable.label, root)
    if not os.path.isfile(path):
      raise TargetError(f"{executable.label} was built but {path} does not exist (not a binary "
                        "target?)")
    return [path]
  return [sys.executable, "-u", "-m", module_of_label(executable.label, root)]


def python_env(root: str, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
  """Environment for child Python processes: the workspace on sys.path, unbuffered output."""
  env = dict(os.environ if base is None else base)
  parts = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
  env["PYTHONPATH"] = os.pathsep.join(parts)
  env["PYTHONUNBUFFERED"] = "1"
  return env
