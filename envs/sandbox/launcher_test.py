"""Starting sandboxes runs no Python in a forked child of the host: no at-fork hooks run.

JAX warns "os.fork() was called. os.fork() is incompatible with multithreaded code, and JAX is
multithreaded" from an `os.register_at_fork(before=...)` hook, which CPython runs on every fork
that runs Python in the child (`os.fork`, `subprocess.Popen(preexec_fn=...)`), and the host runs
threads (JAX's, the pool's). Sandboxes are forked by the single-threaded spawn helper instead, which
the host starts with a plain fork + exec (no hooks). Each case runs in a fresh interpreter so
that its hook counts only its own forks.
"""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
  import os, subprocess, threading
  forks = []
  os.register_at_fork(before=lambda: forks.append(threading.current_thread().name))
  busy = threading.Event()
  threading.Thread(target=busy.wait, daemon=True).start()  # A threaded host, as JAX's is.
  {body}
  busy.set()
  print("FORKS", len(forks))
""")


def _forks(body):
  out = subprocess.run([sys.executable, "-c", _SCRIPT.format(body=textwrap.dedent(body))],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert out.returncode == 0, out.stderr
  return int(out.stdout.split("FORKS")[-1])


def test_the_hook_sees_a_preexec_fn_spawn():
  """The control: the old way of starting a sandbox ran the hooks (so the next test means it)."""
  assert _forks('subprocess.run(["true"], preexec_fn=lambda: None)') == 1


def test_starting_and_running_sandboxes_runs_no_fork_hooks():
  assert _forks("""
    from envs import sandbox
    from envs.sandbox import pool as pool_lib
    with pool_lib.WarmPool(size=2) as pool:
      for i in range(5):
        r = sandbox.run(files={"main.py": f"print({i})"}, command=["python3", "main.py"],
                        pool=pool)
        assert r.ok and r.stdout == f"{i}\\n", r
      with pool_lib.WarmPool(size=1, force_degraded=True) as degraded:
        assert sandbox.run(command=["true"], pool=degraded).exit_code == 0
  """) == 0
