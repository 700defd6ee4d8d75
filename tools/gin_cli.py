"""Command-line gin for the launch and eval entry points: files, `--gin.X=V` and flag shorthands.

    --gin_file=PATH        a gin file (repeatable; relative paths are from the workspace, also
                           under `bazel run`, where the working directory is the runfiles tree)
    --gin.SCOPE.NAME=V     a binding, exactly `SCOPE.NAME = V` in a gin file
    --NAME=V               shorthand for `--gin.<configurable>.NAME=V` for the entry point's main
                           configurable (e.g. `--n=4` for eval_run); V is a Python literal, or a
                           string when it does not parse as one

Unknown flags are an error before any work starts.
"""

from __future__ import annotations

import ast
import inspect
import os
from typing import Callable, Sequence

import gin


class CliError(ValueError):
  """A malformed or unknown command-line flag, or a gin file that does not exist."""


def workspace_root() -> str:
  return os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(
      os.path.dirname(os.path.abspath(__file__)))


def resolve_path(path: str) -> str:
  if os.path.isabs(path):
    return path
  return os.path.join(workspace_root(), path)


def _literal(v: str) -> str:
  """The gin text for a flag value: itself if it is a literal, else a quoted string."""
  try:
    ast.literal_eval(v)
    return v
  except (ValueError, SyntaxError):
    return repr(v)


def split_args(argv: Sequence[str], main: Callable, *, extra_flags: Sequence[str] = ()
               ) -> tuple[list[str], list[str], dict]:
  """Splits argv into (gin files, gin bindings, extra flag values).

  `main` is the gin configurable that `--NAME=V` shorthands bind; `extra_flags` are plain
  flags the caller handles itself (returned as {name: value}; a bare `--name` is "true").
  """
  name = getattr(main, "__name__", None) or main.__wrapped__.__name__
  params = set(inspect.signature(main).parameters)
  files, bindings, extra = [], [], {}
  for arg in argv:
    if not arg.startswith("--"):
      raise CliError(f"unexpected argument {arg!r} (flags look like --name=value)")
    key, eq, value = arg[2:].partition("=")
    if key == "gin_file":
      if not eq:
        raise CliError("--gin_file needs a value")
      files.append(resolve_path(value))
    elif key.startswith("gin."):
      if not eq:
        raise CliError(f"{arg}: a binding needs a value (--gin.X=V)")
      bindings.append(f"{key[4:]} = {value}")
    elif key in extra_flags:
      extra[key] = value if eq else "true"
    elif key in params:
      if not eq:
        raise CliError(f"{arg} needs a value")
      bindings.append(f"{name}.{key} = {_literal(value)}")
    else:
      known = sorted(params | set(extra_flags) | {"gin_file", "gin.X"})
      raise CliError(f"unknown flag --{key} (known: {', '.join('--' + k for k in known)})")
  for f in files:
    if not os.path.isfile(f):
      raise CliError(f"gin file not found: {f}")
  return files, bindings, extra


def parse(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Clears gin, then parses files and bindings; errors become CliError with gin's message."""
  gin.clear_config()
  gin.add_config_file_search_path(workspace_root())
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=True)
  except (ValueError, KeyError, SyntaxError, TypeError, NameError) as e:
    raise CliError(f"bad gin config: {e}") from e
