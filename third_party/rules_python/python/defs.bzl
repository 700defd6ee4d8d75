"""Offline stand-in for rules_python: forwards to Bazel 4.2.3's native Python rules."""

def py_library(**kw):
    native.py_library(**kw)

def py_binary(**kw):
    native.py_binary(**kw)

def py_test(**kw):
    native.py_test(**kw)

def py_runtime(**kw):
    native.py_runtime(**kw)
