"""Coding tasks: the task format and loader (`task_format`) and the generated suites
(`suite_pyfunc`, tiny single-function tasks; `suite_swe`, SWE-style repository tasks).
See envs/README.md.
"""
