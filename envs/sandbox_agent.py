"""The zygote that runs inside each sandbox (stdlib only, runs under the system python3).

Why a zygote: a fresh Python interpreter costs 8-50 ms to start; forking one that has already
started costs well under a millisecond. The host starts this program inside bubblewrap ahead of
demand (see `envs.slot`), so handing an episode a sandbox is a pipe round trip, and running
`python3 main.py` in it is a fork plus `runpy` ("fast path") instead of an exec. Other commands
(`sh -c ...`, `git`, a python with unusual flags) are forked and exec'd as usual.

In namespace mode the zygote is PID 1 of the sandbox's PID namespace (bwrap --as-pid-1). That
buys three things: code inside cannot kill it (the kernel ignores signals to a namespace's init
from inside), it reaps every orphan, and `kill(-1, SIGKILL)` from it kills every other process in
the sandbox, so after each command nothing is left running (daemons included). It also makes
itself non-dumpable so sandboxed code, which runs under the same uid, cannot ptrace it.

Protocol: length-prefixed JSON messages on the fds that were stdin/stdout at start (4-byte
big-endian length, then UTF-8 JSON). Requests carry an "op": exec, write_files, read_files,
list_files, ping. File operations run here, inside the sandbox, so symlinks planted by sandboxed
code resolve inside the sandbox's view and can never reach host paths.
"""

import atexit
import ctypes
import json
import os
import resource
import pkgutil  # pylint: disable=unused-import; runpy.run_path imports it lazily (ms).
import runpy  # Imported up front so the fast path does not pay for it (about 10 ms).
import select
import signal
import stat
import struct
import sys
import time
import traceback

import sandbox_audit  # Beside this file in the sandbox (/opt/envs); stdlib only.

AUDIT_FD = 1000
WORKSPACE = "/workspace"
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PYTHONS = ("python", "python3", "/usr/bin/python3", "/usr/bin/python", "/bin/python3",
            "python3.11", "/usr/bin/python3.11")
_MAX_FILE_BYTES = 1 << 20
_MAX_TOTAL_BYTES = 16 << 20

_libc = ctypes.CDLL(None, use_errno=True)


def _recv(fd):
  header = _read_exact(fd, 4)
  if header is None:
    return None
  (n,) = struct.unpack(">I", header)
  body = _read_exact(fd, n)
  return json.loads(body.decode())


def _read_exact(fd, n):
  chunks = []
  while n:
    chunk = os.read(fd, n)
    if not chunk:
      return None
    chunks.append(chunk)
    n -= len(chunk)
  return b"".join(chunks)


def _send(fd, obj):
  body = json.dumps(obj).encode()
  data = struct.pack(">I", len(body)) + body
  while data:
    data = data[os.write(fd, data):]


def _safe_rel(path):
  """A path relative to /workspace, or raises ValueError."""
  if not isinstance(path, str) or not path or "\0" in path:
    raise ValueError(f"bad path {path!r}")
  norm = os.path.normpath(path)
  if os.path.isabs(norm) and norm.startswith(WORKSPACE + "/"):
    norm = os.path.relpath(norm, WORKSPACE)
  if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
    raise ValueError(f"path {path!r} is outside the workspace")
  return norm


def _close_fds_except(keep):
  # os.closerange here is 65k close() calls (about 8 ms); listing the open fds is microseconds.
  for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    if fd not in keep:
      try:
        os.close(fd)
      except OSError:
        pass


class Zygote:
  """Serves requests from the host until the control pipe closes."""

  def __init__(self, ns_mode):
    self.ns_mode = ns_mode
    self.ctl_r = os.dup(0)
    self.ctl_w = os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
      os.dup2(null, fd)
    os.close(null)
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if not ns_mode:
      # Orphans of sandboxed code re-parent to us, so we can find and kill them.
      _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    self.wake_r, self.wake_w = os.pipe()
    os.set_blocking(self.wake_w, False)
    signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    self.base_path = [p for p in sys.path if p and not p.startswith("/opt/envs")]
    self._pgids = set()

  def serve(self):
    _send(self.ctl_w, {"ok": True, "pid": os.getpid(), "ns_mode": self.ns_mode})
    while True:
      req = _recv(self.ctl_r)
      if req is None:
        self._kill_all()
        return
      try:
        resp = getattr(self, "op_" + req["op"])(req)
        resp["ok"] = True
      except Exception as e:  # pylint: disable=broad-except
        resp = {"ok": False, "error": f"{type(e).__name__}: {e}"}
      _send(self.ctl_w, resp)

  # -- processes -------------------------------------------------------------------------------

  def _others(self):
    """Pids of live processes in the sandbox other than us (descendants in degraded mode)."""
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
      if not name.isdigit() or int(name) == me:
        continue
      if self.ns_mode:
        pids.append(int(name))
        continue
      try:
        with open(f"/proc/{name}/stat", "rb") as f:
          fields = f.read().rsplit(b")", 1)[1].split()
        if int(fields[1]) == me or int(fields[2]) in self._pgids:
          pids.append(int(name))
      except (OSError, IndexError, ValueError):
        pass
    return pids

  def _kill_all(self):
    """Kills every other process in the sandbox and reaps them; returns how many were alive."""
    killed = 0
    for _ in range(100):
      others = self._others()
      if not others:
        break
      killed = max(killed, len(others))
      if self.ns_mode:
        try:
          os.kill(-1, signal.SIGKILL)
        except OSError:
          pass
      else:
        for pgid in list(self._pgids):
          try:
            os.killpg(pgid, signal.SIGKILL)
          except OSError:
            pass
        for pid in others:
          try:
            os.kill(pid, signal.SIGKILL)
          except OSError:
            pass
      self._reap(block_s=0.01)
    self._reap()
    return killed

  def _reap(self, block_s=0.0):
    """Reaps finished children; returns {pid: status}."""
    done = {}
    deadline = time.monotonic() + block_s
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return done
      if pid == 0:
        if time.monotonic() >= deadline:
          return done
        time.sleep(0.001)
        continue
      done[pid] = status

  # -- exec ------------------------------------------------------------------------------------

  def op_ping(self, req):
    del req
    return {"pid": os.getpid()}

  def op_exec(self, req):
    argv = req["argv"]
    if not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError("argv must be a non-empty list of strings")
    cap = int(req.get("max_output_bytes", 1 << 20))
    timeout_s = float(req.get("timeout_s", 10))
    self._pgids = set()
    stdin_data = req.get("stdin", "").encode()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    aud_r, aud_w = os.pipe()
    if len(stdin_data) > 60000:
      raise ValueError("stdin over 60000 bytes; write a file instead")
    os.write(in_w, stdin_data)
    os.close(in_w)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
      self._child(argv, req, in_r, out_w, err_w, aud_w)  # never returns
    self._pgids.add(pid)
    for fd in (in_r, out_w, err_w, aud_w):
      os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray(), aud_r: bytearray()}
    dropped = {out_r: 0, err_r: 0, aud_r: 0}
    open_fds = {out_r, err_r, aud_r}
    status = None
    exited_at = None
    timed_out = False
    deadline = start + timeout_s
    while True:
      for p, st in self._reap().items():
        if p == pid:
          status, exited_at = st, time.monotonic()
      now = time.monotonic()
      if status is not None and (not open_fds or now - exited_at > 0.02):
        break
      if now >= deadline:
        timed_out = True
        break
      wait = min(deadline - now, 0.005 if status is not None else 0.5)
      ready, _, _ = select.select(list(open_fds) + [self.wake_r], [], [], wait)
      for fd in ready:
        if fd == self.wake_r:
          try:
            os.read(self.wake_r, 4096)
          except BlockingIOError:
            pass
          continue
        chunk = os.read(fd, 65536)
        if not chunk:
          open_fds.discard(fd)
          continue
        room = (cap if fd != aud_r else 65536) - len(bufs[fd])
        if room > 0:
          bufs[fd] += chunk[:room]
        dropped[fd] += max(0, len(chunk) - max(room, 0))
    wall = time.monotonic() - start
    leftovers = self._kill_all()
    if status is None:
      # Killed by us; it was reaped inside _kill_all.
      status = signal.SIGKILL
    for fd in (out_r, err_r, aud_r):
      os.close(fd)
    violations = []
    exit_code = os.waitstatus_to_exitcode(status) if not timed_out else -signal.SIGKILL
    if timed_out:
      violations.append(f"timeout: killed after {timeout_s:g}s wall time")
    elif leftovers:
      violations.append(f"left_processes: killed {leftovers} process(es) still running "
                        "after the command exited")
    sig = -exit_code if exit_code < 0 else 0
    if sig == signal.SIGXCPU:
      violations.append("cpu_time_limit: killed by SIGXCPU")
    elif sig == signal.SIGXFSZ:
      violations.append("file_size_limit: killed by SIGXFSZ")
    stderr = bytes(bufs[err_r])
    if b"MemoryError" in stderr or b"Cannot allocate memory" in stderr:
      violations.append("memory_limit: allocation refused")
    if b"File too large" in stderr:
      violations.append("file_size_limit: write refused (EFBIG)")
    if b"Resource temporarily unavailable" in stderr or b"fork: retry" in stderr:
      violations.append("process_limit: fork refused")
    for name, fd in (("stdout", out_r), ("stderr", err_r)):
      if dropped[fd]:
        violations.append(f"output_truncated: {name} over {cap} bytes, dropped {dropped[fd]}")
    events = []
    for line in bytes(bufs[aud_r]).splitlines():
      try:
        events.append(json.loads(line))
      except ValueError:
        pass
    return {
        "exit_code": exit_code,
        "stdout": bytes(bufs[out_r]).decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "timed_out": timed_out,
        "violations": violations,
        "events": events,
        "wall_s": wall,
    }

  def _child(self, argv, req, in_r, out_w, err_w, aud_w):
    try:
      os.setsid()
      signal.set_wakeup_fd(-1)
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      os.dup2(in_r, 0)
      os.dup2(out_w, 1)
      os.dup2(err_w, 2)
      os.dup2(aud_w, AUDIT_FD)
      _close_fds_except((0, 1, 2, AUDIT_FD))
      _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
      try:
        with open("/proc/self/oom_score_adj", "w") as f:
          f.write("1000")
      except OSError:
        pass
      mb = 1 << 20
      limits = [
          (resource.RLIMIT_CPU, int(req.get("cpu_s", 10))),
          (resource.RLIMIT_AS, int(req.get("memory_mb", 512)) * mb),
          # The pids cgroup (nproc + 1, counted, see slot.py) binds first where there is one.
          (resource.RLIMIT_NPROC, int(req.get("nproc", 64)) + 8),
          (resource.RLIMIT_FSIZE, int(req.get("fsize_mb", 64)) * mb),
          (resource.RLIMIT_CORE, 0),
          (resource.RLIMIT_NOFILE, 256),
      ]
      for which, value in limits:
        # Soft below hard: at the soft CPU limit the kernel sends SIGXCPU (reported as such),
        # SIGKILL only at the hard one.
        hard = value + 1 if which == resource.RLIMIT_CPU else value
        resource.setrlimit(which, (value, hard))
      env = dict(req.get("env") or {})
      env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
      env.setdefault("HOME", "/tmp")
      env.setdefault("LANG", "C.UTF-8")
      env["ENVS_AUDIT_FD"] = str(AUDIT_FD)
      env["PYTHONPATH"] = "/opt/envs_site"
      env["PYTHONDONTWRITEBYTECODE"] = "1"
      env["ENVS_WORKSPACE"] = WORKSPACE
      os.chdir(req.get("cwd") or WORKSPACE)
      if argv[0] in _PYTHONS and req.get("fast_path", True):
        self._run_python_here(argv[1:], env)
      os.execvpe(argv[0], argv, env)
    except SystemExit:
      raise
    except BaseException:  # pylint: disable=broad-except
      try:
        os.write(2, traceback.format_exc().encode())
      finally:
        os._exit(127)

  def _run_python_here(self, args, env):
    """Runs `python3 <args>` in this forked process; returns only if args need a real exec."""
    i = 0
    while i < len(args) and args[i] in ("-u", "-B", "-s", "-E", "-I"):
      i += 1
    if i >= len(args) or (args[i].startswith("-") and args[i] not in ("-c", "-m")):
      return
    os.environ.clear()
    os.environ.update(env)
    sandbox_audit.install(AUDIT_FD)
    code = 0
    try:
      if args[i] == "-c":
        if i + 1 >= len(args):
          return
        sys.argv = ["-c"] + args[i + 2:]
        sys.path = [""] + self.base_path
        exec(compile(args[i + 1], "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
      elif args[i] == "-m":
        if i + 1 >= len(args):
          return
        sys.argv = [args[i + 1]] + args[i + 2:]
        sys.path = [os.getcwd()] + self.base_path
        runpy.run_module(args[i + 1], run_name="__main__", alter_sys=True)
      else:
        sys.argv = args[i:]
        sys.path = [os.path.dirname(os.path.abspath(args[i]))] + self.base_path
        runpy.run_path(args[i], run_name="__main__")
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code & 0xFF
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 1
    try:
      atexit._run_exitfuncs()  # pylint: disable=protected-access
      sys.stdout.flush()
      sys.stderr.flush()
    except BaseException:  # pylint: disable=broad-except
      pass
    os._exit(code)

  # -- files -----------------------------------------------------------------------------------

  def op_write_files(self, req):
    written = []
    for rel, content in req["files"].items():
      rel = _safe_rel(rel)
      path = os.path.join(WORKSPACE, rel)
      parent = os.path.dirname(path)
      os.makedirs(parent, exist_ok=True)
      flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
      fd = os.open(path, flags, 0o755 if req.get("executable") else 0o644)
      try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
          raise ValueError(f"{rel} is not a regular file")
        data = content.encode()
        while data:
          data = data[os.write(fd, data):]
      finally:
        os.close(fd)
      written.append(rel)
    for rel in req.get("delete", []):
      rel = _safe_rel(rel)
      try:
        os.unlink(os.path.join(WORKSPACE, rel))
      except FileNotFoundError:
        pass
    return {"written": written}

  def _walk(self, root):
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames.sort()
      for name in sorted(filenames):
        full = os.path.join(dirpath, name)
        yield os.path.relpath(full, WORKSPACE), full

  def op_read_files(self, req):
    paths = req.get("paths")
    if paths is None:
      items = list(self._walk(WORKSPACE))
      items = [(rel, full) for rel, full in items if not rel.startswith(".git/")]
    else:
      items = []
      for rel in paths:
        rel = _safe_rel(rel)
        items.append((rel, os.path.join(WORKSPACE, rel)))
    files, skipped, total = {}, {}, 0
    for rel, full in items:
      try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
      except OSError as e:
        skipped[rel] = e.strerror or str(e)
        continue
      try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
          skipped[rel] = "not a regular file"
          continue
        if st.st_size > _MAX_FILE_BYTES or total + st.st_size > _MAX_TOTAL_BYTES:
          skipped[rel] = f"too large ({st.st_size} bytes)"
          continue
        data = os.read(fd, _MAX_FILE_BYTES + 1)
        total += len(data)
        files[rel] = data.decode("utf-8", "replace")
      finally:
        os.close(fd)
    return {"files": files, "skipped": skipped}

  def op_list_files(self, req):
    root = os.path.join(WORKSPACE, _safe_rel(req.get("path") or "."))
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if d != ".git")
      for name in sorted(filenames):
        out.append(os.path.relpath(os.path.join(dirpath, name), WORKSPACE))
        if len(out) >= int(req.get("limit", 1000)):
          return {"paths": sorted(out), "truncated": True}
    return {"paths": sorted(out), "truncated": False}


if __name__ == "__main__":
  for _arg in sys.argv[1:]:
    if _arg.startswith("--workspace="):
      WORKSPACE = _arg.split("=", 1)[1]
  Zygote(ns_mode="--ns" in sys.argv).serve()
