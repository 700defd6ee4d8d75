"""A repository rule that makes the project's .venv Bazel's Python toolchain.

The venv is created by scripts/bootstrap.sh from the pinned requirements files, so Bazel never
downloads an interpreter or packages itself (these machines have no general internet). The
toolchain's interpreter is build_defs/venv_python.sh, the venv's Python with -P, so that no
binary or test has its own package folder on sys.path (see that file).
"""

_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _python_venv_impl(rctx):
    root = rctx.path(Label("//:WORKSPACE")).dirname
    interpreter = "%s/build_defs/venv_python.sh" % root
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", _BUILD.format(interpreter = interpreter))

python_venv = repository_rule(
    implementation = _python_venv_impl,
    local = True,
)
