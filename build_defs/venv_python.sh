#!/bin/sh
# The Python interpreter of every Bazel py_binary and py_test (build_defs/python_venv.bzl): the
# project's .venv Python, run with -P.
#
# Why -P (Python >= 3.11: "don't prepend a potentially unsafe path to sys.path"): Bazel's stub
# runs a binary's main as a script, `python <package>/<main>.py`, and a script's own folder would
# come first on sys.path, where any module of that package shadows a dependency of the same name
# (rollout/tokenizers.py once hid the `tokenizers` library from transformers). With -P, imports
# resolve from the workspace root (PYTHONPATH, which the stub sets) and the venv only, exactly
# as under `python -m package.module`. The flag is not inherited: processes a program starts with
# sys.executable get the plain interpreter.
root=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
exec "$root/.venv/bin/python3" -P "$@"
