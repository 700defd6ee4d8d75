"""The pre-forked command process inside the sandbox (stdlib only, forked from the zygote).

Why pre-forked: forking the zygote (a started Python) costs about half a millisecond on a VM, and
the setup after it (new session, descriptors, OOM score, audit hook) about as much again. The
zygote (`zygote.py`) forks the next child as soon as the previous command has been cleaned
up; the child does here everything that does not depend on the request while the sandbox is
idle, then blocks reading its request. Starting a command is then a pipe write: the child applies
the request's limits, environment and working directory and runs the command, `python3 file.py`
in-process (the "fast path", no interpreter start) and anything else through exec.

Why this is safe: a child is forked only after every process of the previous command has been
killed and reaped, from the zygote, which sandboxed code cannot change (it is non-dumpable, so
not ptrace-able and its /proc/PID/mem is closed). A waiting child runs nothing but this file, no
sandboxed code runs while one waits, and each child serves exactly one command. So a command's
process carries nothing from earlier commands.

Request (a `marshal`led dict from the zygote, read to EOF on REQUEST_FD): argv, cpu_s,
memory_mb, nproc, rlimit_nproc, fsize_mb, env, cwd, fast_path. Descriptors: 0 stdin, 1 stdout,
2 stderr, AUDIT_FD audit events (see `audit_hook`), all pipes to the zygote.
"""

import _signal
import atexit
import builtins
import ctypes
import importlib.machinery
import marshal
import os
import resource
import runpy  # Here, in the zygote, so `python3 -m` commands do not pay for it.
import signal
import sys
import traceback

import audit_hook  # Beside this file in the sandbox (/opt/envs); stdlib only.

AUDIT_FD = 1000
REQUEST_FD = 1001
STATUS_FD = 1002  # READY once prepared; fast path: "pid code" just before exiting (not inherited).
READY = b"ready\n"
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_WARM_REQUEST = marshal.dumps({"argv": ["python3", "main.py"], "cpu_s": 11, "memory_mb": 512,
                               "nproc": 64, "rlimit_nproc": 72, "fsize_mb": 64,
                               "env": {"A": "b"}, "cwd": None, "fast_path": True})
PYTHONS = ("python", "python3", "/usr/bin/python3", "/usr/bin/python", "/bin/python3",
           "python3.11", "/usr/bin/python3.11")
_MB = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl  # pylint: disable=pointless-statement  # Resolved once, before any fork (spawner).
_DEFAULT_ENV_FOR = None  # The workspace os.environ holds the default environment for, if any.


def close_fds_except(keep):
  """Closes every descriptor but `keep` (close_range(2) over the gaps: no list to build; up
  to the descriptor limit, which bounds the loop a kernel without close_range would run)."""
  low = 0
  for fd in sorted(keep) + [max(os.sysconf("SC_OPEN_MAX"), max(keep) + 1)]:
    if fd > low:
      os.closerange(low, fd)
    low = fd + 1


def use_default_env(workspace):
  """Makes os.environ the environment of a command that asks for none (a request's env is then
  applied as changes). Done once per pool by the spawner where every workspace is the same
  (namespaced sandboxes), so command processes, forked with it, skip it."""
  global _DEFAULT_ENV_FOR
  if _DEFAULT_ENV_FOR != workspace:
    os.environ.clear()
    os.environ.update(_command_env({}, workspace))
    _DEFAULT_ENV_FOR = workspace


def main(fds, *, base_path, workspace):
  """Runs in the freshly forked child; never returns.

  Args:
    fds: read end of stdin, write ends of stdout, stderr, audit and status, read end of request.
    base_path: sys.path for sandboxed Python, without the zygote's own directory.
    workspace: the default working directory.
  """
  code = 127
  try:
    _prepare(fds, workspace)
    req = _read_request()
    if req is None:
      code = 0  # The zygote is done with us (shutting down, or discarding a spare).
    else:
      _run(req, base_path, workspace)  # Returns only on a setup error (raises).
  except BaseException:  # pylint: disable=broad-except
    try:
      os.write(2, traceback.format_exc().encode())
    except BaseException:  # pylint: disable=broad-except
      pass
  finally:
    # Never unwind into the zygote's code, whatever happened above.
    os._exit(code)


def _prepare(fds, workspace):
  """Everything that does not depend on the request (runs ahead of demand)."""
  in_r, out_w, err_w, aud_w, status_w, req_r = fds
  os.setsid()
  signal.set_wakeup_fd(-1)
  # _signal: signal.signal's enum conversions would touch (and so copy) dozens of pages.
  _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
  os.dup2(in_r, 0)
  os.dup2(out_w, 1)
  os.dup2(err_w, 2)
  os.dup2(aud_w, AUDIT_FD)
  os.dup2(status_w, STATUS_FD, inheritable=False)
  os.dup2(req_r, REQUEST_FD)
  close_fds_except((0, 1, 2, AUDIT_FD, STATUS_FD, REQUEST_FD))
  try:
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
      os.write(fd, b"1000")
    finally:
      os.close(fd)
  except OSError:
    pass
  use_default_env(workspace)
  # Reports only; nothing but this file runs until the request is read. Exec replaces it.
  audit_hook.install(AUDIT_FD, workspace=workspace)
  _warm_up()
  # Tells the zygote this process is ready (it waits for the first one before the sandbox says
  # ready, so a sandbox handed out never makes its first command wait for this set-up).
  os.write(STATUS_FD, READY)


def _command_env(user_env, workspace):
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", **user_env}
  env.update(ENVS_AUDIT_FD=str(AUDIT_FD), PYTHONPATH="/opt/envs_site",
             PYTHONDONTWRITEBYTECODE="1", ENVS_WORKSPACE=workspace)
  return env


def _warm_up():
  """Runs what a command's start runs, without effect, so it runs from private memory.

  Memory the child writes to is shared with the zygote until then, and the first write to each
  page copies it (copy on write). Doing that here, while the sandbox is idle, takes those copies
  off the command's critical path.
  """
  req = marshal.loads(_WARM_REQUEST)
  for which in (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC):
    resource.getrlimit(which)
  _command_env(req["env"], "/")
  os.path.dirname(os.path.realpath(os.path.abspath("warm-up.py")))
  with open("/dev/null", "rb") as f:
    f.read()
  _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)
  main = type(sys)("__main__")
  main.__dict__.update(__builtins__=builtins, __cached__=None,
                       __loader__=importlib.machinery.SourceFileLoader("__main__", "/"))
  exec(compile(b"pass\n", "<warm-up>", "exec"), main.__dict__)  # pylint: disable=exec-used
  atexit._ncallbacks()  # pylint: disable=protected-access


def _read_request():
  chunks = []
  while True:
    chunk = os.read(REQUEST_FD, 1 << 16)
    if not chunk:
      break
    chunks.append(chunk)
  os.close(REQUEST_FD)
  if not chunks:
    return None
  # marshal, not JSON: one C call, and the zygote, not sandboxed code, wrote it.
  return marshal.loads(b"".join(chunks))


def _run(req, base_path, workspace):
  argv = req["argv"]
  for which, value in (
      (resource.RLIMIT_CPU, int(req["cpu_s"])),
      (resource.RLIMIT_AS, int(req["memory_mb"]) * _MB),
      # The host decides (slot.py): the host-wide cap where a pids cgroup (nproc + 1) bounds
      # the sandbox, else nproc plus some slack.
      (resource.RLIMIT_NPROC, int(req["rlimit_nproc"])),
      (resource.RLIMIT_FSIZE, int(req["fsize_mb"]) * _MB),
      (resource.RLIMIT_CORE, 0),
      (resource.RLIMIT_NOFILE, 256)):
    # Soft below hard: at the soft CPU limit the kernel sends SIGXCPU (reported as such),
    # SIGKILL only at the hard one.
    resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
  env = _command_env(req.get("env") or {}, workspace)
  os.chdir(req.get("cwd") or workspace)
  # Sandboxed code may read its own /proc/self entries (the zygote's are closed to it).
  _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
  if argv[0] in PYTHONS and req.get("fast_path", True):
    _run_python_here(argv[1:], env, base_path)
  os.execvpe(argv[0], argv, env)


def _run_python_here(args, env, base_path):
  """Runs `python3 <args>` in this process; returns only if args need a real exec."""
  i = 0
  while i < len(args) and args[i] in ("-u", "-B", "-s", "-E", "-I"):
    i += 1
  if i >= len(args) or (args[i].startswith("-") and args[i] not in ("-c", "-m")):
    return
  if args[i] in ("-c", "-m") and i + 1 >= len(args):
    return
  source = None
  if not args[i].startswith("-"):
    if not args[i].endswith(".py"):
      return  # A directory or zip application: the real interpreter handles those.
    try:
      with open(args[i], "rb") as f:
        source = f.read()
    except OSError:
      return  # The real interpreter reports it exactly as python would.
  # os.environ holds the default environment (see _prepare): apply only the differences.
  for key in set(os.environ) - set(env):
    del os.environ[key]
  for key, value in env.items():
    if os.environ.get(key) != value:
      os.environ[key] = value
  code = 0
  try:
    if args[i] == "-c":
      sys.argv = ["-c"] + args[i + 2:]
      sys.path = [""] + base_path
      _exec_main(args[i + 1], None)
    elif args[i] == "-m":
      sys.argv = [args[i + 1]] + args[i + 2:]
      sys.path = [os.getcwd()] + base_path
      runpy.run_module(args[i + 1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = args[i:]
      path = os.path.abspath(args[i])  # As the interpreter (3.9+) sets __file__.
      sys.path = [os.path.dirname(os.path.realpath(path))] + base_path
      _exec_main(source, path)
  except SystemExit as e:
    code = _exit_code(e)
  except BaseException as e:  # pylint: disable=broad-except
    _print_uncaught(e)
    code = 1
  try:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:  # pylint: disable=broad-except
    pass
  _exit_now(code)


def _exit_now(code):
  """Reports the exit code and closes the pipes, then exits.

  So the zygote can answer without waiting for the kernel to tear this process down (a fork of
  the zygote: about half a millisecond). It trusts the report only once the kernel marks this
  process as exiting, so sandboxed code that writes a report and carries on gains nothing.
  """
  try:
    # With the pid: a process that sandboxed code forked from this one and that returns
    # instead of exiting ends here too.
    os.write(STATUS_FD, f"{os.getpid()} {code}\n".encode())
  except OSError:
    pass
  for fd in (0, 1, 2, AUDIT_FD, STATUS_FD):
    try:
      os.close(fd)
    except OSError:
      pass
  os._exit(code)


def _exec_main(source, path):
  """Runs source as the __main__ module, as the interpreter does for a script (path) or -c."""
  main = type(sys)("__main__")
  main.__dict__.update(__builtins__=builtins, __spec__=None, __package__=None)
  if path is None:
    main.__loader__ = importlib.machinery.BuiltinImporter
  else:
    main.__dict__.update(__file__=path, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
  sys.modules["__main__"] = main
  code = compile(source, path or "<string>", "exec")
  exec(code, main.__dict__)  # pylint: disable=exec-used


def _exit_code(e):
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code & 0xFF
  print(e.code, file=sys.stderr)
  return 1


def _print_uncaught(e):
  # Drop this file's frames, so the traceback reads like the interpreter's own.
  tb = e.__traceback__
  here = _print_uncaught.__code__.co_filename
  while tb is not None and tb.tb_frame.f_code.co_filename == here:
    tb = tb.tb_next
  e = e.with_traceback(tb)  # The default hook prints the exception's own traceback.
  try:
    sys.excepthook(type(e), e, tb)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exception(type(e), e, tb)
