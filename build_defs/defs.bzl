"""Shared Bazel macros: one py_test per *_test.py, run through pytest.

Every test target's `main` is `//build_defs:pytest_runner.py`, which runs the test file through
pytest, so a file runs its tests whether or not it has a `__main__` block, and a target whose file
collects no test fails. Test files may still end with
`if __name__ == "__main__": sys.exit(pytest.main(...))` so that `python x_test.py` works too.
"""

load("@rules_python//python:defs.bzl", "py_test")

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
