"""Tests for the zygote and its pre-forked command process (envs.sandbox.zygote, command_process).

What is checked: the in-process fast path behaves like the real interpreter; a command never
sees state from an earlier one (interpreter state, processes) and never runs beside a waiting
spare; a spare that died while waiting is replaced; stdin, cwd, env and limits reach the command.
"""

import os
import signal
import sys

import pytest

from envs import sandbox
from envs.sandbox import pool as pool_lib
from testlib import waiting

_PROBE = """
import os, sys, __main__
print(__name__, __file__, sys.argv, sys.path[0])
print(__main__.__dict__ is globals(), type(__loader__).__name__, __spec__, __package__)
print(__doc__, __builtins__ is __import__("builtins"))
"""


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=1, max_live=2) as p:
    yield p


def _both_paths(pool, files, command, **kw):
  fast = sandbox.run(files, command, pool=pool, **kw)
  real = sandbox.run(files, command, pool=pool, fast_path=False, **kw)
  return fast, real


def test_fast_path_matches_the_interpreter(pool):
  fast, real = _both_paths(pool, {"d/m.py": '"""Doc."""\n' + _PROBE}, ["python3", "d/m.py", "x"])
  assert fast.exit_code == real.exit_code == 0, (fast, real)
  assert fast.stdout == real.stdout
  assert "__main__ /workspace/d/m.py ['d/m.py', 'x'] /workspace/d" in fast.stdout


def test_fast_path_dash_c_and_dash_m(pool):
  probe = "import sys; print(__name__, sys.argv, repr(sys.path[0]))"
  fast, real = _both_paths(pool, {}, ["python3", "-c", probe, "a"])
  assert fast.stdout == real.stdout == "__main__ ['-c', 'a'] ''\n"
  fast, real = _both_paths(pool, {"pkg/__init__.py": "", "pkg/mod.py": "print(__name__)"},
                           ["python3", "-m", "pkg.mod"])
  assert fast.stdout == real.stdout == "__main__\n"


def test_fast_path_errors_read_like_the_interpreter(pool):
  for files in ({"m.py": "def f():\n  raise ValueError('boom')\nf()\n"}, {"m.py": "x = (\n"},
                {"m.py": "import sys\nsys.exit('bye')\n"}, {}):  # The last: no such file.
    fast, real = _both_paths(pool, files, ["python3", "m.py"])
    assert (fast.exit_code, fast.stdout, fast.stderr) == (real.exit_code, real.stdout,
                                                         real.stderr), (fast, real)
    assert "command_process" not in fast.stderr and "zygote" not in fast.stderr


def test_commands_share_files_but_no_interpreter_state(pool):
  with sandbox.Sandbox({}, pool=pool) as sb:
    r = sb.exec(["python3", "-c", "import json, os, sys\njson.leak = 1\nos.environ['LEAK'] = '1'\n"
                 "sys.path.append('/leak')\nopen('f.txt', 'w').write('kept')"])
    assert r.exit_code == 0, r
    r = sb.exec(["python3", "-c", "import json, os, sys\n"
                 "print(hasattr(json, 'leak'), 'LEAK' in os.environ, '/leak' in sys.path, "
                 "open('f.txt').read())"])
    assert r.stdout == "False False False kept\n", r


def test_commands_never_run_beside_a_waiting_spare(pool):
  code = ("import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
          "print(pids == sorted({1, os.getpid()}), os.getpid() != 1)")
  with sandbox.Sandbox({}, pool=pool) as sb:
    for fast in (True, False, True):
      r = sb.exec(["python3", "-c", code], fast_path=fast)
      assert r.stdout == "True True\n", r  # Only the command and PID 1 (the zygote).


def _host_children(pid):
  out = []
  for tid in os.listdir(f"/proc/{pid}/task"):
    with open(f"/proc/{pid}/task/{tid}/children") as f:
      out += [int(c) for c in f.read().split()]
  return out


def _ns_pid(host_pid):
  """The pid of a host process in its innermost PID namespace (/proc/PID/status, NSpid)."""
  with open(f"/proc/{host_pid}/status") as f:
    return int(next(line for line in f if line.startswith("NSpid:")).split()[-1])


def test_dead_spare_is_replaced(pool):
  with sandbox.Sandbox({}, pool=pool) as sb:
    assert sb.exec(["true"]).exit_code == 0
    # Answered only once the zygote has forked the spare that follows the exec.
    spare = sb.slot.spare_pid()
    spares = _host_children(sb.slot.pid)
    assert len(spares) == 1 and _ns_pid(spares[0]) == spare, (spares, spare)
    os.kill(spares[0], signal.SIGKILL)
    # Exited (a zombie until the zygote reaps it): its pipe ends are closed, so the zygote's
    # hand-off to it fails and it forks another, which is what this test is about.
    waiting.wait_exited(spares, "the killed spare to exit")
    r = sb.exec(["python3", "-c", "print('replaced')"])
    assert (r.exit_code, r.stdout, r.violations) == (0, "replaced\n", []), r


def test_stdin_cwd_env_and_limits_reach_the_command(pool):
  with sandbox.Sandbox({"sub/x.txt": "x"}, pool=pool) as sb:
    code = ("import os, resource, sys\nprint(sys.stdin.read(), os.getcwd(), os.environ['K'], "
            "resource.getrlimit(resource.RLIMIT_NPROC)[0], "
            "resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)")
    # With a pids cgroup that is the sandbox's process bound (nproc + 1) and RLIMIT_NPROC the
    # host-wide cap; without one, RLIMIT_NPROC is the bound (nproc + 8).
    pids = sb.slot.cgroups.get("pids")
    rlimit = sb.slot.features.nproc_cap if pids else 17
    for fast in (True, False):
      r = sb.exec(["python3", "-c", code], stdin="in", cwd="/workspace/sub", env={"K": "v"},
                  nproc=9, memory_mb=300, fast_path=fast)
      assert r.stdout == f"in /workspace/sub v {rlimit} 300\n", r
      if pids:
        with open(os.path.join(pids, "pids.max")) as f:
          assert f.read().strip() == "10"
    r = sb.exec(["sh", "-c", "cat; pwd; echo $K"], stdin="in\n", cwd="/workspace/sub",
                env={"K": "v"})
    assert r.stdout == "in\n/workspace/sub\nv\n", r


def test_a_command_sees_the_default_environment_and_only_its_own_changes(pool):
  # The default environment is set once per pool (in the spawn helper, inherited by every
  # zygote and command process); a command's env is applied on top, in its process only.
  show = ["python3", "-c", "import os; print(sorted(os.environ.items()))"]
  default = [("ENVS_AUDIT_FD", "1000"), ("ENVS_WORKSPACE", "/workspace"), ("HOME", "/tmp"),
             ("LANG", "C.UTF-8"), ("PATH", "/usr/local/bin:/usr/bin:/bin"),
             ("PYTHONDONTWRITEBYTECODE", "1"), ("PYTHONPATH", "/opt/envs_site")]
  with sandbox.Sandbox({}, pool=pool) as sb:
    for fast in (True, False):
      r = sb.exec(show, env={"K": "v", "HOME": "/workspace"}, fast_path=fast)
      changed = sorted(dict(default, K="v", HOME="/workspace").items())
      assert r.stdout == f"{changed}\n", (fast, r)
      # Nothing of that command's env reaches the next one, in this sandbox or another.
      assert sb.exec(show, fast_path=fast).stdout == f"{default}\n", fast
      assert sandbox.run(command=show, pool=pool, fast_path=fast).stdout == f"{default}\n", fast


def test_a_command_holds_no_descriptor_of_the_zygote(pool):
  # Only its stdio, the audit pipe (1000) and, in the in-process path, the exit report pipe
  # (1002, not inherited by exec); 3 is the listing's own. The zygote's control pipe, its other
  # command pipes and the helper's socket are all closed before a command runs.
  show = ["python3", "-c", "import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')))"]
  with sandbox.Sandbox({}, pool=pool) as sb:
    assert sb.exec(show, fast_path=True).stdout == "[0, 1, 2, 3, 1000, 1002]\n"
    assert sb.exec(show, fast_path=False).stdout == "[0, 1, 2, 3, 1000]\n"


def test_exit_report_is_only_trusted_from_an_exiting_process(pool):
  # Sandboxed code can write an exit report and close its pipes, then carry on: the zygote must
  # wait for the real exit. The report descriptor never reaches exec'd programs.
  code = ("import os, time\nos.write(1002, b'0')\nfor fd in (0, 1, 2, 1000, 1002):\n"
          "  os.close(fd)\ntime.sleep(0.3)\nos._exit(3)")
  r = sandbox.run({"m.py": code}, ["python3", "m.py"], pool=pool)
  assert (r.exit_code, r.timed_out, r.violations) == (3, False, []), r
  r = sandbox.run({}, ["python3", "-c", "import os\ntry:\n  os.fstat(1002)\nexcept OSError:\n"
                       "  print('closed')"], pool=pool, fast_path=False)
  assert r.stdout == "closed\n", r


def test_forked_child_returning_does_not_decide_the_exit_code(pool):
  code = ("import os, sys\npid = os.fork()\nif pid == 0:\n  sys.exit(3)\n"
          "os.waitpid(pid, 0)\nprint('parent')")
  r = sandbox.run({"m.py": code}, ["python3", "m.py"], pool=pool)
  assert (r.exit_code, r.stdout, r.violations) == (0, "parent\n", []), r


def test_many_commands_in_one_sandbox_stay_fast_and_clean(pool):
  with sandbox.Sandbox({"m.py": "import sys\nprint(sys.argv[1])"}, pool=pool) as sb:
    for i in range(30):
      r = sb.exec(["python3", "m.py", str(i)] if i % 2 else ["sh", "-c", f"echo {i}"])
      assert (r.exit_code, r.stdout, r.violations) == (0, f"{i}\n", []), r


def test_no_spare_is_forked_after_the_last_command(pool):
  # sandbox.run's one command is the sandbox's last: a spare forked after it would be killed
  # unused (a fork and a warm-up of CPU per episode). A later command still runs.
  with sandbox.Sandbox({}, pool=pool) as sb:
    assert sb.slot.spare_pid() is not None  # The first spare, forked while the pool held it.
    assert sb.exec(["true"], last=True).exit_code == 0
    assert sb.slot.spare_pid() is None
    r = sb.exec(["python3", "-c", "print('on demand')"])
    assert (r.exit_code, r.stdout) == (0, "on demand\n"), r
    assert sb.slot.spare_pid() is not None


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
