"""Shared Bazel macros: one py_test per *_test.py, run through pytest.

Test files end with `if __name__ == "__main__": sys.exit(pytest.main(...))`, so the same file
runs under `bazel test` and under a plain `pytest`.
"""

load("@rules_python//python:defs.bzl", "py_test")

def pytest_test(name, srcs = None, deps = [], size = "small", data = [], tags = [], **kw):
    """A py_test for `<name>.py` (a pytest module)."""
    py_test(
        name = name,
        srcs = srcs or [name + ".py"],
        main = (srcs or [name + ".py"])[0],
        deps = deps,
        size = size,
        data = data,
        tags = tags,
        python_version = "PY3",
        srcs_version = "PY3",
        **kw
    )
