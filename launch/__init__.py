"""XManager-shaped launcher: experiments of work units of named jobs, run locally or under xm.

Modules: `spec` (Experiment / WorkUnit / Job / executables, sweeps), `discovery` (how a running job
finds its peers by name), `targets` (Bazel labels -> commands), `local` (the local process
executor), `xm_adapter` (the same experiment on the real `xmanager` package when installed).
"""
