"""Shared Bazel macros: one py_test per *_test.py, run through pytest; one library + binary per
entry point.

Every test target's `main` is `//build_defs:pytest_runner.py`, which runs the test file through
pytest, so a file runs its tests whether or not it has a `__main__` block, and a target whose file
collects no test fails. Test files may still end with
`if __name__ == "__main__": sys.exit(pytest.main(...))` so that `python x_test.py` works too.

Every binary and test runs under the toolchain's interpreter, build_defs/venv_python.sh (the
venv's Python with -P): its main's own folder is not on sys.path, so imports resolve from the
workspace root as under `python -m`, and no module of the package can shadow a dependency.
"""

load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")

_RUNNER = "//build_defs:pytest_runner.py"

def pytest_test(name, srcs = None, deps = [], size = "small", data = [], tags = [], args = [], **kw):
    """A py_test that runs `<name>.py` (a pytest module) through the shared pytest runner."""
    srcs = srcs or [name + ".py"]
    py_test(
        name = name,
        srcs = srcs + [_RUNNER],
        main = _RUNNER,
        args = ["$(rootpath %s)" % srcs[0]] + args,
        deps = deps,
        size = size,
        data = data,
        tags = tags,
        python_version = "PY3",
        srcs_version = "PY3",
        **kw
    )

def tool_binary(name, deps = [], data = [], src = None, lib_name = None):
    """An entry point: the py_library `<name>_lib` of `<name>.py` and the py_binary `<name>`.

    Tests and other binaries depend on the library (praxis/paxml style), so a binary's code is
    importable and testable without running it.

    Args:
      name: the binary's target name (`bazel run //pkg:<name>`).
      deps: the library's dependencies.
      data: runtime files (gin configs, test data), reached through the library's runfiles.
      src: the source file when it is not `<name>.py`.
      lib_name: the library's name when it is not `<name>_lib`.
    """
    src = src or name + ".py"
    lib = lib_name or name + "_lib"
    py_library(
        name = lib,
        srcs = [src],
        data = data,
        deps = deps,
    )
    py_binary(
        name = name,
        srcs = [src],
        main = src,
        python_version = "PY3",
        deps = [":" + lib],
    )
