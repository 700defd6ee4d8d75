"""The zygote that runs inside each sandbox (stdlib only, runs under the system python3).

Why a zygote: a fresh Python interpreter costs 8-50 ms to start; forking one that has already
started costs well under a millisecond. The spawn helper (`spawner`), which has this module
imported, forks it into each new sandbox's namespaces ahead of demand (see `slot`, `pool`), so
handing an episode a sandbox is a pipe round trip. The zygote also
keeps one command process forked ahead of demand (`command_process`, the "spare"), which waits on a
pipe for its request, so running a command costs a pipe write rather than a fork: `python3
main.py` then runs in the spare itself ("fast path", no interpreter start) and other commands
(`sh -c ...`, `git`, a python with unusual flags) exec from it.

In namespace mode the zygote is PID 1 of the sandbox's PID namespace . That
buys three things: code inside cannot kill it (the kernel ignores signals to a namespace's init
from inside), it reaps every orphan, and `kill(-1, SIGKILL)` from it kills every other process in
the sandbox, so after each command nothing is left running (daemons included). It also makes
itself non-dumpable so sandboxed code, which runs under the same uid, cannot ptrace it. The next
spare is forked only after that kill, so sandboxed code never runs beside a waiting spare.

Protocol: length-prefixed JSON messages on the fds that were stdin/stdout at start (4-byte
big-endian length, then UTF-8 JSON). Requests carry an "op": exec, write_files, read_files,
list_files, ping. File operations run here, inside the sandbox, so symlinks planted by sandboxed
code resolve inside the sandbox's view and can never reach host paths.
"""

import _signal
import ctypes
import gc
import json
import marshal
import os
import resource
import select
import signal
import stat
import struct
import sys
import time

import command_process  # Beside this file in the sandbox (/opt/envs); stdlib only.

WORKSPACE = "/workspace"
PROFILE = None  # {phase: time.perf_counter()} of this sandbox's start, when profiled.
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PF_EXITING = 0x4  # task flag, /proc/PID/stat field 9
_MAX_STDIN_BYTES = 60000  # Fits a pipe buffer, so writing it never blocks.
_MAX_FILE_BYTES = 1 << 20
_MAX_TOTAL_BYTES = 16 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl  # pylint: disable=pointless-statement  # Resolved once, before any fork (spawner).


def _noop(*_):
  pass


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


class _Spare:
  """A forked command process waiting for its request, and the zygote's ends of its pipes."""

  def __init__(self, pid, req_w, in_w, out_r, err_r, aud_r, status_r):
    self.pid = pid
    self.req_w = req_w
    self.in_w = in_w
    self.out_r = out_r
    self.err_r = err_r
    self.aud_r = aud_r
    self.status_r = status_r
    self.ready = False  # Whether its READY was read (see Zygote._await_spare).

  def close(self):
    for fd in (self.req_w, self.in_w, self.out_r, self.err_r, self.aud_r, self.status_r):
      if fd >= 0:
        try:
          os.close(fd)
        except OSError:
          pass
    self.req_w = self.in_w = self.out_r = self.err_r = self.aud_r = self.status_r = -1


def _stat_fields(path):
  """A /proc .../stat line's fields after the command name (field 3 on)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    return os.read(fd, 4096).rsplit(b")", 1)[1].split()
  finally:
    os.close(fd)


def _minflt_of(pid):
  """Page faults of a process of the sandbox so far (/proc/PID/stat field 10), for a profile."""
  return int(_stat_fields(f"/proc/{pid}/stat")[7])


def _task_state(pid):
  """"exiting" once the kernel is tearing every thread of pid down (none can run user code
  again), "zombie" once it has exited, "running" before, "unknown" if /proc cannot say."""
  states = set()
  try:
    for tid in os.listdir(f"/proc/{pid}/task"):
      try:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
      except FileNotFoundError:
        continue  # That thread has finished exiting since the listing.
      if fields[0] in (b"Z", b"X"):
        states.add("zombie")
      else:
        states.add("exiting" if int(fields[6]) & _PF_EXITING else "running")
  except (OSError, IndexError, ValueError):
    return "unknown"
  if not states:
    return "unknown"
  if "running" in states:
    return "running"
  return "exiting" if "exiting" in states else "zombie"


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
    # _signal: signal.signal's enum conversions would touch (and so copy) dozens of pages.
    _signal.signal(_signal.SIGCHLD, _noop)
    self.base_path = [p for p in sys.path if p and not p.startswith("/opt/envs")]
    self._pgids = set()
    self._spare = None
    self._cleanup_pending = False

  def serve(self):
    self._fork_spare()
    self._await_spare()
    ready = {"ok": True, "pid": os.getpid(), "ns_mode": self.ns_mode}
    if PROFILE is not None:  # Set by the spawner when the host asked for a start's profile.
      PROFILE["z_ready"] = time.perf_counter()
      PROFILE["z_cpu"] = time.process_time()
      PROFILE["z_minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      PROFILE["spare_minflt"] = _minflt_of(self._spare.pid) if self._spare else -1
      ready["profile"] = PROFILE
    _send(self.ctl_w, ready)
    while True:
      req = _recv(self.ctl_r)
      if req is None:
        self._kill_all()
        if not self.ns_mode:
          # The host waits for this before it counts the sandbox as gone (see slot.close).
          try:
            _send(self.ctl_w, {"ok": True, "bye": True, "clean": not self._others()})
          except OSError:
            pass
        return
      try:
        resp = getattr(self, "op_" + req["op"])(req)
        resp["ok"] = True
      except Exception as e:  # pylint: disable=broad-except
        resp = {"ok": False, "error": f"{type(e).__name__}: {e}"}
      _send(self.ctl_w, resp)
      if self._cleanup_pending:
        # The command reported its exit and was already exiting; finish it off and reap it
        # before anything else happens in the sandbox.
        self._kill_all()
        self._cleanup_pending = False
      if self._spare is None and req.get("fork_next", True):
        # After answering, so the fork overlaps the host's work on the response. Not after a
        # command the host said is the sandbox's last (sandbox.run): that spare would be
        # killed unused. A later exec forks one on demand.
        self._fork_spare()

  # -- spare -----------------------------------------------------------------------------------

  def _fork_spare(self):
    """Forks the next command process; it prepares itself and waits for its request."""
    pipes = [os.pipe() for _ in range(6)]  # stdin, stdout, stderr, audit, status, request
    # Everything allocated so far stays out of the child's garbage collections: a collection
    # that walked it would write to (and so copy) most of the zygote's pages.
    gc.freeze()
    try:
      pid = os.fork()
    except OSError:
      for r, w in pipes:
        os.close(r)
        os.close(w)
      return  # Retried on demand by _take_spare, which then reports the error.
    if pid == 0:
      (in_r, _), (_, out_w), (_, err_w), (_, aud_w), (_, status_w), (req_r, _) = pipes
      command_process.main((in_r, out_w, err_w, aud_w, status_w, req_r),
                         base_path=self.base_path, workspace=WORKSPACE)  # Never returns.
    ((in_r, in_w), (out_r, out_w), (err_r, err_w), (aud_r, aud_w), (status_r, status_w),
     (req_r, req_w)) = pipes
    for fd in (in_r, out_w, err_w, aud_w, status_w, req_r):
      os.close(fd)
    self._spare = _Spare(pid, req_w, in_w, out_r, err_r, aud_r, status_r)

  def _await_spare(self, timeout_s=10.0):
    """Waits until the spare has done its set-up (it writes READY on its status pipe), so the
    first command of a sandbox the host was told is ready does not wait for it. A spare that
    died instead (EOF) is replaced on demand by _take_spare."""
    if self._spare is None or self._spare.ready:
      return
    fd, got = self._spare.status_r, b""
    deadline = time.monotonic() + timeout_s
    while not got.endswith(command_process.READY):
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return
      chunk = os.read(fd, len(command_process.READY) - len(got))
      if not chunk:
        return
      got += chunk
    self._spare.ready = True

  def _take_spare(self, body, stdin_data):
    """Hands the request to the spare (forking one if needed); returns it, now running."""
    for attempt in range(2):
      if self._spare is None:
        self._fork_spare()
        if self._spare is None:
          raise OSError("cannot fork a command process")
      spare, self._spare = self._spare, None
      try:
        os.write(spare.in_w, stdin_data)
        os.close(spare.in_w)
        spare.in_w = -1
        data = body
        while data:
          data = data[os.write(spare.req_w, data):]
        os.close(spare.req_w)
        spare.req_w = -1
        return spare
      except BrokenPipeError:
        # The spare died while waiting (say, the OOM killer): reap it and fork another.
        spare.close()
        self._kill_all()
        if attempt:
          raise
    raise AssertionError("unreachable")

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

  def _kill_all(self, exclude=()):
    """Kills every other process in the sandbox and reaps them.

    Returns how many were alive, not counting pids in `exclude`.
    """
    killed = 0
    for _ in range(100):
      others = self._others()
      if not others:
        break
      killed = max(killed, len([p for p in others if p not in exclude]))
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
    # Requests are served one at a time and the next spare is forked before the next request
    # is read, so the answer to a ping after an exec names that exec's replacement spare, which
    # has done its set-up by then.
    del req
    self._await_spare()
    return {"pid": os.getpid(), "spare_pid": self._spare.pid if self._spare else None}

  def op_exec(self, req):
    argv = req["argv"]
    if not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError("argv must be a non-empty list of strings")
    cap = int(req.get("max_output_bytes", 1 << 20))
    timeout_s = float(req.get("timeout_s", 10))
    stdin_data = req.get("stdin", "").encode()
    if len(stdin_data) > _MAX_STDIN_BYTES:
      raise ValueError(f"stdin over {_MAX_STDIN_BYTES} bytes; write a file instead")
    body = marshal.dumps({
        "argv": argv, "cpu_s": int(req.get("cpu_s", 10)),
        "memory_mb": int(req.get("memory_mb", 512)), "nproc": int(req.get("nproc", 64)),
        "rlimit_nproc": int(req.get("rlimit_nproc", int(req.get("nproc", 64)) + 8)),
        "fsize_mb": int(req.get("fsize_mb", 64)), "env": req.get("env") or {},
        "cwd": req.get("cwd"), "fast_path": bool(req.get("fast_path", True))})
    self._pgids = set()
    start = time.monotonic()
    spare = self._take_spare(body, stdin_data)
    pid, out_r, err_r, aud_r = spare.pid, spare.out_r, spare.err_r, spare.aud_r
    status_r = spare.status_r
    self._pgids.add(pid)
    bufs = {out_r: bytearray(), err_r: bytearray(), aud_r: bytearray(), status_r: bytearray()}
    dropped = {out_r: 0, err_r: 0, aud_r: 0, status_r: 0}
    caps = {out_r: cap, err_r: cap, aud_r: 65536, status_r: 4096}
    open_fds = {out_r, err_r, aud_r, status_r}
    status = None
    reported = None  # The exit code the command reported, once it is known to be exiting.
    report_checked = False
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
        room = caps[fd] - len(bufs[fd])
        if room > 0:
          bufs[fd] += chunk[:room]
        dropped[fd] += max(0, len(chunk) - max(room, 0))
      if status is None and not open_fds and bufs[status_r] and not report_checked:
        # Checked once, as the pipes close: the command's own exit path closes them just
        # before it exits.
        report_checked = True
        reported = self._reported_exit(pid, bytes(bufs[status_r]))
        if reported is not None:
          break
    wall = time.monotonic() - start
    if reported is not None:
      # The command is exiting: count what it left running without waiting for it to go.
      leftovers = len([p for p in self._others() if p != pid])
      if leftovers:
        leftovers = self._kill_all(exclude=(pid,))
      else:
        self._cleanup_pending = True  # Done right after the answer (see serve).
      exit_code = reported
    else:
      leftovers = self._kill_all()
      if status is None:
        # Killed by us; it was reaped inside _kill_all.
        status = signal.SIGKILL
      exit_code = os.waitstatus_to_exitcode(status) if not timed_out else -signal.SIGKILL
    spare.close()
    violations = []
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
    if (b"Resource temporarily unavailable" in stderr or b"fork: retry" in stderr
        or b"Cannot fork" in stderr):  # The last: dash's words.
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

  def _reported_exit(self, pid, report):
    """The exit code a fast-path command reported, once the kernel has it exiting; else None.

    The command closes its pipes just before exiting, so this waits microseconds. A report from
    sandboxed code that then carries on is never confirmed (the normal wait takes over, and
    reports the real exit), and one followed at once by a different exit says no more than
    os._exit could have.
    """
    code = None
    for line in report.splitlines():
      try:
        who, what = (int(x) for x in line.split())
      except ValueError:
        continue
      if who == pid and 0 <= what <= 255:
        code = what
    if code is None:
      return None
    for i in range(20):
      state = _task_state(pid)
      if state == "exiting":
        return code
      if state != "running":
        return None  # Gone or a zombie already: waitpid has the real status.
      # Let the command reach its exit (it may share this CPU), briefly.
      if i < 3:
        os.sched_yield()
      else:
        time.sleep(0.0001)
    return None

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
