"""No project module shadows a dependency, and Bazel's interpreter keeps script folders off
sys.path.

Why: Python puts a script's own folder first on sys.path (`python pkg/x.py`, Bazel's stub
running a binary's main), so a module in that folder named like a dependency replaces the
dependency for the whole process: rollout/tokenizers.py once hid the `tokenizers` library from
transformers, and the server died at start-up on a checkpoint with a tokenizer.json
("cannot import name 'Encoding' from 'tokenizers' (.../rollout/tokenizers.py)"). Two guards:
  * no `.py` module or package folder directly inside a project folder has the name of a
    top-level module the venv can import (the standard library included: `test`, `typing`...);
  * the toolchain's interpreter (build_defs/venv_python.sh, python -P) does not put a script's
    folder on sys.path, so a script imports a dependency even beside a module of its name.
"""

import os
import subprocess
import sys

import pytest

# The checkout (runfiles are symlinks into it, as in layering_test): every project folder.
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
INTERPRETER = os.path.join(ROOT, "build_defs", "venv_python.sh")
# Not project Python: Bazel's offline rule stand-ins, the venv, run outputs.
_SKIP = {"third_party", "runs", "node_modules", "__pycache__"}


def dependency_modules() -> set:
  """Top-level module names the venv's interpreter can import, whatever the current directory:
  built-in and standard-library modules, and every module, package and namespace folder of the
  interpreter's own path entries (stdlib, lib-dynload, site-packages)."""
  names = set(sys.builtin_module_names) | set(sys.stdlib_module_names)
  prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
  for entry in sys.path:
    real = os.path.realpath(entry) if entry else ""
    if not real or not any(real.startswith(p + os.sep) for p in prefixes):
      continue  # the workspace, Bazel's runfiles: ours, not dependencies
    if not os.path.isdir(real):
      continue  # python311.zip when absent
    for name in os.listdir(real):
      stem = name.split(".", 1)[0]
      path = os.path.join(real, name)
      if os.path.isdir(path):
        if "." not in name and name.isidentifier():  # packages and namespace folders
          names.add(name)
      elif name.endswith((".py", ".pyc", ".so", ".pyd")) and stem.isidentifier():
        names.add(stem)
  return names


def project_names(root: str = ROOT) -> list:
  """(folder, name) for every .py module and package folder directly inside a project folder
  (the workspace root and every folder below it that holds Python)."""
  out = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if not d.startswith((".", "bazel-")) and d not in _SKIP)
    rel = os.path.relpath(folder, root)
    out += [(rel, f[:-3]) for f in sorted(files) if f.endswith(".py")]
    out += [(rel, d + "/") for d in dirs
            if any(f.endswith(".py") for f in os.listdir(os.path.join(folder, d)))]
  return out


def shadowing(root: str = ROOT, deps=None) -> list:
  """`folder/name` of every project module or package named like a dependency."""
  deps = dependency_modules() if deps is None else deps
  return [os.path.normpath(os.path.join(folder, name)) + ("/" if name.endswith("/") else ".py")
          for folder, name in project_names(root) if name.rstrip("/") in deps]


def test_the_dependency_scan_sees_the_venv_and_the_standard_library():
  deps = dependency_modules()
  assert {"tokenizers", "jax", "numpy", "transformers", "typing", "test", "json"} <= deps


def test_no_project_module_or_package_is_named_like_a_dependency():
  assert shadowing() == [], (
      "these project modules share a name with a top-level module of the venv, which they "
      "shadow in any process whose script lies beside them; rename them")


def test_the_guard_finds_a_module_and_a_package_named_like_a_dependency(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "typing").mkdir(parents=True)
  for path in ("pkg/__init__.py", "pkg/tokenizers.py", "pkg/fine.py", "pkg/typing/__init__.py"):
    (tmp_path / path).write_text("")
  assert shadowing(str(tmp_path)) == ["pkg/tokenizers.py", "pkg/typing/"]


def test_the_interpreter_keeps_a_scripts_folder_off_sys_path(tmp_path):
  """A script beside a module named `tokenizers` imports the library, under the interpreter
  Bazel runs every binary and test with (the plain interpreter imports the module beside it)."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "tokenizers.py").write_text("raise ImportError('the module beside the script')\n")
  (pkg / "main.py").write_text("import sys\nimport tokenizers\n"
                               "print(tokenizers.Tokenizer.__module__, sys.flags.safe_path)\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  run = subprocess.run([INTERPRETER, str(pkg / "main.py")], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.split() == ["tokenizers", "True"]
  plain = subprocess.run([sys.executable, str(pkg / "main.py")], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
  assert "the module beside the script" in plain.stderr  # what -P prevents
  if os.environ.get("TEST_SRCDIR"):  # under bazel test, this test runs through it too
    assert sys.flags.safe_path, "Bazel's Python toolchain does not run python -P"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
