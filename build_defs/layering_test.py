"""The layers of build_defs/layers.bzl hold, and no modules import each other in a circle: in every
Python import, in every BUILD file, and in
Bazel itself (a wrong-way dependency fails `bazel build`).

The test reads the source tree, not its runfiles: under `bazel test` (local spawn strategy) the
runfiles are symlinks into the checkout, so the workspace root is found from this file's real
path. Run alone with `.venv/bin/python -m pytest build_defs/layering_test.py`.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
LAYERS_BZL = os.path.join(ROOT, "build_defs", "layers.bzl")


def _layers():
  text = open(LAYERS_BZL, encoding="utf-8").read()
  layers = ast.literal_eval(re.search(r"^LAYERS = (\{.*?^\})", text, re.S | re.M).group(1))
  test_only = ast.literal_eval(re.search(r"^TEST_ONLY = (\[.*?\])", text, re.S | re.M).group(1))
  return layers, test_only


LAYERS, TEST_ONLY = _layers()


def _is_test_code(path):
  name = os.path.basename(path)
  return name.endswith("_test.py") or name == "testing.py"


def _imports(path):
  """(line, top-level module) of every absolute import in a Python file."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield node.lineno, a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module.split(".")[0]


def _python_files(pkg, root=ROOT):
  for where, dirs, files in os.walk(os.path.join(root, pkg)):
    dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-"))]
    for f in files:
      if f.endswith(".py"):
        yield os.path.join(where, f)


def import_violations(root=ROOT, layers=LAYERS, test_only=TEST_ONLY):
  """'path:line: pkg imports other' for every import across layers that LAYERS does not allow."""
  out = []
  for pkg, allowed in layers.items():
    for path in _python_files(pkg, root):
      ok = set(allowed) | {pkg} | (set(test_only) if _is_test_code(path) else set())
      for line, mod in _imports(path):
        if mod in layers and mod not in ok:
          out.append(f"{os.path.relpath(path, root)}:{line}: {pkg} imports {mod}")
  return out


def test_table_lists_every_top_level_package():
  tops = {d for d in os.listdir(ROOT)
          if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
  assert tops - set(LAYERS) == set(), "packages missing from build_defs/layers.bzl LAYERS"
  for pkg, deps in LAYERS.items():
    assert pkg not in deps and set(deps) <= set(LAYERS), pkg


def test_layers_have_no_cycle():
  state = {}

  def visit(p, path):
    if state.get(p) == "open":
      raise AssertionError("cycle: " + " -> ".join(path + [p]))
    if state.get(p) != "done":
      state[p] = "open"
      for d in LAYERS[p]:
        visit(d, path + [p])
      state[p] = "done"

  for p in LAYERS:
    visit(p, [])


def test_every_python_import_follows_the_layers():
  assert import_violations() == []


def test_the_import_check_catches_a_wrong_way_import(tmp_path):
  (tmp_path / "low").mkdir()
  (tmp_path / "low" / "__init__.py").write_text("")
  (tmp_path / "low" / "m.py").write_text("import os\nfrom high import x\n")
  (tmp_path / "low" / "m_test.py").write_text("from helpers import wait\n")
  (tmp_path / "high").mkdir()
  (tmp_path / "high" / "m.py").write_text("from low import m\nfrom helpers import wait\n")
  layers = {"low": [], "high": ["low"], "helpers": []}
  found = import_violations(str(tmp_path), layers, ["helpers"])
  assert found == ["low/m.py:2: low imports high", "high/m.py:2: high imports helpers"]


def _module_graph(root, pkgs):
  """{module: modules it imports} over the Python files of `pkgs` under `root`.

  `from a.b import c` is an edge to the module a.b.c when that is a module (not to the package
  a.b, whose __init__ merely re-exports), else to a.b.
  """
  mods = {}
  for pkg in pkgs:
    for path in _python_files(pkg, root):
      name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
      mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  graph = {m: set() for m in mods}
  for m, path in mods.items():
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
      if isinstance(node, ast.Import):
        graph[m].update(a.name for a in node.names if a.name in mods)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        subs = [f"{node.module}.{a.name}" for a in node.names
                if f"{node.module}.{a.name}" in mods]
        graph[m].update(subs)
        if len(subs) < len(node.names) and node.module in mods:
          graph[m].add(node.module)
  return graph


def import_cycles(root=ROOT, pkgs=tuple(LAYERS) + ("build_defs",)):
  """Every set of two or more modules that import each other in a circle (any import, lazy ones
  inside functions included: a lazy import only hides a circle)."""
  graph = _module_graph(root, pkgs)
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def connect(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        cycles.append(sorted(comp))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
  for v in sorted(graph):
    if v not in index:
      connect(v)
  return cycles


def test_no_import_cycle_between_modules():
  assert import_cycles() == []


def test_the_cycle_check_finds_a_lazy_circle_but_not_a_package_reexport(tmp_path):
  pkg = tmp_path / "p"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("from p.a import f\n")  # re-export: no circle
  (pkg / "a.py").write_text("from p import b\ndef f():\n  pass\n")
  (pkg / "b.py").write_text("def g():\n  from p.c import h\n")
  (pkg / "c.py").write_text("import p.a\n")  # c -> a -> b -> (lazily) c
  (pkg / "d.py").write_text("from p import a\n")
  assert import_cycles(str(tmp_path), ["p"]) == [["p.a", "p.b", "p.c"]]


def test_gin_only_in_tools():
  out = []
  for pkg in LAYERS:
    if pkg == "tools":
      continue
    for path in _python_files(pkg):
      out += [f"{os.path.relpath(path, ROOT)}:{line}" for line, mod in _imports(path)
              if mod == "gin"]
  assert out == [], "gin is imported outside tools/"


def _build_files(pkg):
  for root, dirs, files in os.walk(os.path.join(ROOT, pkg)):
    dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-"))]
    if "BUILD" in files:
      yield os.path.join(root, "BUILD")


def test_every_build_file_declares_its_layer():
  out = []
  for pkg in LAYERS:
    for path in _build_files(pkg):
      text = open(path, encoding="utf-8").read()
      if f'default_visibility = visible_to("{pkg}")' not in text:
        out.append(os.path.relpath(path, ROOT))
      if '"//visibility:public"' in text:
        out.append(os.path.relpath(path, ROOT) + " (public visibility)")
  assert out == [], "BUILD files without package(default_visibility = visible_to(<their layer>))"


def _probe_build(dep):
  return ('load("@rules_python//python:defs.bzl", "py_library")\n'
          f'py_library(name = "probe", srcs = [], deps = ["{dep}"])\n')


def test_bazel_rejects_a_wrong_way_dependency():
  """A nested Bazel on a workspace of symlinks to this one plus two probe targets, one inside
  moe/ (the bottom layer) depending on pipeline, one inside pipeline/ depending on moe."""
  assert shutil.which("bazel"), "bazel must be on PATH (scripts/bootstrap.sh installs it)"
  work = tempfile.mkdtemp(prefix="layering_", dir=os.environ.get("TEST_TMPDIR"))
  try:
    ws = os.path.join(work, "ws")
    os.mkdir(ws)
    for name in os.listdir(ROOT):
      if name in ("moe", "pipeline") or name.startswith(("bazel-", ".venv", ".git")):
        continue
      os.symlink(os.path.join(ROOT, name), os.path.join(ws, name))
    for pkg in ("moe", "pipeline"):  # real dirs, so a probe subpackage can be added
      os.mkdir(os.path.join(ws, pkg))
      for name in os.listdir(os.path.join(ROOT, pkg)):
        os.symlink(os.path.join(ROOT, pkg, name), os.path.join(ws, pkg, name))
    os.makedirs(os.path.join(ws, "moe", "layering_probe"))
    os.makedirs(os.path.join(ws, "pipeline", "layering_probe"))
    with open(os.path.join(ws, "moe", "layering_probe", "BUILD"), "w") as f:
      f.write(_probe_build("//pipeline:config"))
    with open(os.path.join(ws, "pipeline", "layering_probe", "BUILD"), "w") as f:
      f.write(_probe_build("//moe:config"))

    def build(target):
      return subprocess.run(
          ["bazel", f"--output_user_root={os.path.join(work, 'ur')}", "--batch", "build",
           "--nobuild", target], cwd=ws, capture_output=True, text=True, timeout=600,
          check=False)

    up = build("//pipeline/layering_probe:probe")
    assert up.returncode == 0, up.stderr[-3000:]
    down = build("//moe/layering_probe:probe")
    assert down.returncode != 0, "Bazel accepted moe depending on pipeline"
    assert "is not visible from target" in down.stderr or "not visible" in down.stderr, (
        down.stderr[-3000:])
  finally:
    subprocess.run(["chmod", "-R", "u+w", work], check=False)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
