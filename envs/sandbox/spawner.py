"""The spawn helper: makes sandboxes by forking an interpreter that has the zygote imported.

Runs on the host (stdlib only, under the system python3, as the sandbox uid), started once per
pool by `launcher` through a plain fork + exec (no Python runs in a forked child of the host,
whose threads, JAX's among them, make `os.fork` unsafe there). It is single-threaded, so forking
it is safe.

Why: a sandbox used to be bubblewrap exec'ing a fresh `python3 zygote.py`. The interpreter's
start and the zygote's imports were most of a start's CPU (see BENCHMARKS.md) and what bounded
burst throughput. Forked from here, a sandbox costs one fork plus the namespace and mount set-up
bubblewrap did, done here with the same system calls:

  At start the helper makes the pool's user namespace (root inside mapped to the sandbox uid)
  and a PID namespace, and serves from that PID namespace's init (see `_pool_namespaces`).

  Per request it forks Z into a new PID namespace of its own and answers the host with a pidfd
  of Z. Z, PID 1 there: joins the sandbox's cgroups (through cgroup.procs descriptors the host
  opened), unshares mount, network, IPC, UTS and cgroup namespaces, builds the root (a fresh
  tmpfs holding /usr read-only, /proc, a minimal /dev, a fresh /tmp, the workspace, the
  programs read-only at /opt/envs), pivots into it and detaches the host's tree, remounts /
  read-only, brings up loopback, sets the hostname, enters a user namespace of its own capped at
  one more and that one (uid nobody, no capabilities, no_new_privs: bwrap's --disable-userns),
  and becomes the zygote. Z's exit completes only once every process of its PID namespace has
  been reaped, so the pidfd says when the sandbox is gone.

Every sandbox gets new namespaces (its user namespace nested in the pool's), a new tmpfs /tmp
and /dev, and a new cgroup; what sandboxes share is this program's memory image, forked.
Death: when the helper's init exits (at EOF on its socket: the host closed it or died), the
kernel kills every process of its PID namespace and the namespaces nested in it.

Degraded mode (no user namespaces): Z joins the cgroups, moves to the workspace and becomes the
zygote on the host, with PR_SET_PDEATHSIG; the helper kills them at EOF.

Usage: spawner.py SOCKET_FD --ns|--degraded NPROC_CAP (0: leave RLIMIT_NPROC as it is).
Protocol (SOCK_SEQPACKET, fds by SCM_RIGHTS): request {"id", "ns", "workspace", "opt", "site",
"newroot"[, "profile"]} with fds [zygote's control read end, its control write end, cgroup.procs
descriptors]; the reply {"id"} with [pidfd of Z], or {"id", "error"}. With "profile", the reply
and the zygote's ready message carry {phase: time.perf_counter()} marks and CPU seconds.
"""

import _signal
import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

# Everything a sandbox's start and its zygote use is imported here, once: an import in a fork
# would be paid again by every sandbox. (hostcheck's probe runs this file's source with -c and
# builds no zygote.)
if sys.argv[1:2] != ["--probe"]:
  import zygote  # pylint: disable=g-import-not-at-top  # Beside this file; stdlib only.

_libc = ctypes.CDLL(None, use_errno=True)
# Resolved here, once: ctypes builds a function's wrapper object on its first use, and a fork
# that did that would build it (and copy the memory it writes) again in every sandbox.
for _name in ("mount", "umount2", "unshare", "setns", "sethostname", "prctl", "syscall"):
  getattr(_libc, _name)
del _name
# Read here, once, for the same reason (the kernel's value, the same inside every sandbox).
with open("/proc/sys/kernel/cap_last_cap") as _f:
  _CAP_LAST = int(_f.read())
del _f

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_SILENT = 32, 4096, 16384, 32768
MS_SLAVE = 1 << 19
# Flags a bind mount keeps from its source (locked in a user namespace, so a remount that
# dropped them would fail); statvfs's ST_* values are the same bits.
_KEPT = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | (1 << 21)  # + noatime, nodiratime, relatime
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126},
             "aarch64": {"pivot_root": 41, "capset": 91}}.get(os.uname().machine, {})
WORKSPACE = "/workspace"  # Every namespaced sandbox's workspace, as its processes see it.
SANDBOX_UID = 65534  # Inside the sandbox (the final user namespace), as bwrap's default.
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _check(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
         f"mount {source} on {target}")


def _syscall(name, *args):
  return _libc.syscall(_SYSCALLS[name], *args)


def _write(path, text):
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _map_ids(inside, uid, gid):
  """Maps one uid and gid of a just-made user namespace to this process's own outside (all an
  unprivileged process may)."""
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/uid_map", f"{inside} {uid} 1")
  _write("/proc/self/gid_map", f"{inside} {gid} 1")


def _bind(source, target, *, readonly, devices=False):
  _mount(source, target, None, MS_BIND | MS_REC | MS_SILENT)
  flags = (os.statvfs(target).f_flag & _KEPT) | MS_NOSUID | (0 if devices else MS_NODEV)
  _mount(None, target, None, MS_BIND | MS_REMOUNT | flags | (MS_RDONLY if readonly else 0))


def _build_root(req):
  """The sandbox's file system, as bwrap's --ro-bind /usr, --proc, --dev, --tmpfs /tmp,
  --bind WS /workspace and --remount-ro / made it (see envs/README.md, "Isolation")."""
  _mount(None, "/", None, MS_SLAVE | MS_REC | MS_SILENT)
  new = req["newroot"]
  _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
  for d in ("usr", "proc", "dev", "tmp", "workspace", "opt", "opt/envs", "opt/envs_site"):
    os.mkdir(os.path.join(new, d), 0o755)
  _bind("/usr", f"{new}/usr", readonly=True)
  for name, target in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin"),
                       ("sbin", "usr/sbin")):
    os.symlink(target, os.path.join(new, name))
  _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  dev = f"{new}/dev"
  _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
  for name in _DEVICES:
    if os.path.exists(f"/dev/{name}"):
      os.close(os.open(f"{dev}/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
      _bind(f"/dev/{name}", f"{dev}/{name}", readonly=False, devices=True)
  for name, target in (("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2"), ("fd", "/proc/self/fd"),
                       ("core", "/proc/kcore"), ("ptmx", "pts/ptmx")):
    os.symlink(target, f"{dev}/{name}")
  os.mkdir(f"{dev}/shm", 0o755)
  os.mkdir(f"{dev}/pts", 0o755)
  _mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC,
         "newinstance,ptmxmode=0666,mode=620")
  _mount("tmpfs", f"{new}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
  _bind(req["workspace"], f"{new}/workspace", readonly=False)
  _bind(req["opt"], f"{new}/opt/envs", readonly=True)
  _bind(req["site"], f"{new}/opt/envs_site", readonly=True)
  os.chdir(new)
  _check(_syscall("pivot_root", b".", b"."), "pivot_root")
  _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
  os.chdir("/")
  flags = os.statvfs("/").f_flag & _KEPT
  _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)


def _loopback_up():
  s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  try:
    ifreq = fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0))  # SIOCGIFFLAGS
    flags = struct.unpack("16sH14x", ifreq)[1] | 0x1  # IFF_UP
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags))  # SIOCSIFFLAGS
  finally:
    s.close()


def _drop_privileges():
  """Leaves the pool's user namespace for this sandbox's own, which may hold one more (bwrap's
  --disable-userns: the limit is counted per namespace, so it is set in a namespace of the
  sandbox's own), and that one, as uid nobody, with no capabilities and no way to gain any."""
  _check(_libc.unshare(CLONE_NEWUSER), "unshare the sandbox's user namespace")
  _map_ids(0, 0, 0)
  _write("/proc/sys/user/max_user_namespaces", "1")
  _check(_libc.unshare(CLONE_NEWUSER), "unshare the final user namespace")
  _map_ids(SANDBOX_UID, 0, 0)
  for cap in range(_CAP_LAST + 1):
    _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop the bounding set")
  _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
  header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  data = ctypes.create_string_buffer(24)  # two (effective, permitted, inheritable) words, zero
  _check(_syscall("capset", ctypes.c_char_p(header), data), "capset")
  _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _become_zygote(ctl_r, ctl_w, *, ns_mode, workspace, profile=None):
  """Runs the zygote (imported before the fork) on the control pipe; never returns."""
  os.dup2(ctl_r, 0)
  os.dup2(ctl_w, 1)
  zygote.command_process.close_fds_except((0, 1, 2))
  if ns_mode:
    sys.path[0] = "/opt/envs"  # Where the programs are inside the sandbox.
  zygote.WORKSPACE = workspace
  zygote.PROFILE = profile
  # As in a freshly started interpreter (this helper ignores both; exec'd commands would
  # inherit an ignored SIGINT). _signal: see _sandbox.
  _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
  _signal.signal(_signal.SIGINT, _signal.default_int_handler)
  code = 0
  try:
    zygote.Zygote(ns_mode=ns_mode).serve()
  except BaseException:  # pylint: disable=broad-except
    code = 1
  os._exit(code)


def _sandbox(req, ctl_r, ctl_w, cgroup_fds, ns):
  """Z, a fork of the helper: the sandbox's first process (PID 1 of its PID namespace, or a
  process on the host in degraded mode). Builds the sandbox and becomes its zygote."""
  try:
    if "profile" in req:
      req["profile"] = {"z_forked": time.perf_counter()}
    # _signal, not signal: signal.signal's enum conversions would touch (and so copy) dozens
    # of the helper's pages in every sandbox.
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
    for fd in cgroup_fds:
      os.write(fd, b"0")  # This process; allowed by the opener's (the host's) credentials.
      os.close(fd)
    _mark(req, "z_cgroups")
    if not ns:
      os.chdir(req["workspace"])
      _become_zygote(ctl_r, ctl_w, ns_mode=False, workspace=req["workspace"])
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
                         | CLONE_NEWCGROUP), "unshare namespaces")
    _mark(req, "z_namespaces")
    _build_root(req)
    _mark(req, "z_root")
    _loopback_up()
    _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    os.setsid()  # bwrap's --new-session: no controlling terminal to inject input into.
    _mark(req, "z_net_uts")
    _drop_privileges()
    os.chdir(WORKSPACE)
    _mark(req, "z_privileges")
  except BaseException as e:  # pylint: disable=broad-except
    _report(ctl_w, f"sandbox set-up failed: {type(e).__name__}: {e}")
    os._exit(1)
  if req.get("probe"):
    body = json.dumps({"ok": True, "probe": True}).encode()
    os.write(ctl_w, struct.pack(">I", len(body)) + body)
    os._exit(0)
  _become_zygote(ctl_r, ctl_w, ns_mode=True, workspace=WORKSPACE, profile=req.get("profile"))


def _report(fd, error):
  """An error on the zygote's control pipe, where the host waits for its ready message."""
  body = json.dumps({"ok": False, "error": error}).encode()
  try:
    os.write(fd, struct.pack(">I", len(body)) + body)
  except OSError:
    pass


def _reply(sock, msg, fds=()):
  socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def _minflt():
  """Page faults of this process so far (in a fork: since the fork), for a start's profile."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _mark(req, name):
  """Records when a phase of the start ended, when the host asked for a profile."""
  if "profile" in req:
    req["profile"][name] = time.perf_counter()


def _pool_namespaces(nproc_cap):
  """Makes the pool's user namespace (root inside is the sandbox uid outside) and PID namespace,
  and returns in the process that is that PID namespace's init; the caller's process stays
  outside, waits for it and exits with it (so the host's handle on the helper stays valid).

  Why: the init forks each sandbox into a new PID namespace of its own (unshare(CLONE_NEWPID),
  fork, then setns back, which needs CAP_SYS_ADMIN over the PID namespace it is in), so a
  sandbox is one fork of this process. And when the init exits, the kernel kills every process
  of its PID namespace and those nested in it: every sandbox of the pool.
  """
  if nproc_cap:
    # Set before the user namespace is made: the kernel takes the namespace's limit on all
    # tasks of the uid (every sandbox of the pool) from here.
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc_cap, nproc_cap))
  uid, gid = os.geteuid(), os.getegid()
  _check(_libc.unshare(CLONE_NEWUSER), "unshare the pool's user namespace")
  _map_ids(0, uid, gid)
  _check(_libc.unshare(CLONE_NEWPID), "unshare the pool's PID namespace")
  init = os.fork()
  if init == 0:
    return os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
  while True:
    try:
      _, status = os.waitpid(init, 0)
      os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    except InterruptedError:
      continue
    except ChildProcessError:
      os._exit(1)


def serve(sock, *, ns, nproc_cap):
  """Forks one sandbox per request until EOF on the socket, then ends them all."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  pool_pidns = _pool_namespaces(nproc_cap) if ns else None
  # Children are reaped by the kernel: a sandbox whose init exited never lingers as a zombie
  # counting against its pids cgroup. (Each sandbox sets SIGCHLD back to the default.)
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)
  me = os.getpid()
  live = {}  # pid -> pidfd of each degraded sandbox (namespaced ones end with this process)
  if ns:
    # Every namespaced sandbox's workspace is the same: set the commands' environment once
    # here, not in each command process.
    zygote.command_process.use_default_env(WORKSPACE)
  gc.collect()
  gc.freeze()  # Keep collections in the forks from writing to (and so copying) these pages.
  while True:
    try:
      msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
    except InterruptedError:
      continue
    if not msg:
      break
    req = {}
    try:
      req = json.loads(msg)
      if req["ns"] != ns:
        raise ValueError(f"this helper makes {'namespaced' if ns else 'degraded'} sandboxes")
      if "profile" in req:
        req["profile"] = {"spawner_received": time.perf_counter(), "s_cpu": time.process_time(),
                          "s_minflt": _minflt()}
      pid = _fork_sandbox(pool_pidns)
    except BaseException as e:  # pylint: disable=broad-except
      for fd in fds:
        os.close(fd)
      _reply(sock, {"id": req.get("id"), "error": f"spawner: {type(e).__name__}: {e}"})
      continue
    if pid == 0:
      try:
        for fd in live.values():
          os.close(fd)
        sock.close()
        if pool_pidns is not None:
          os.close(pool_pidns)
        if not ns:
          _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
          if os.getppid() != me:
            os._exit(1)  # The helper died before the death signal was armed.
      except BaseException:  # pylint: disable=broad-except
        os._exit(1)
      _sandbox(req, fds[0], fds[1], fds[2:], ns)  # Never returns.
    for fd in fds:
      os.close(fd)
    reply = {"id": req["id"]}
    try:
      pidfd = os.pidfd_open(pid)
    except OSError as e:
      _reply(sock, {"id": req["id"], "error": f"spawner: the sandbox exited at once ({e})"})
      continue
    if "profile" in req:
      reply["profile"] = dict(req["profile"], spawner_forked=time.perf_counter(),
                              s_cpu=time.process_time() - req["profile"]["s_cpu"],
                              s_minflt=_minflt() - req["profile"]["s_minflt"])
    _reply(sock, reply, [pidfd])
    if ns:
      os.close(pidfd)
      continue
    live[pid] = pidfd
    for p, fd in list(live.items()):  # Forget the sandboxes that have exited.
      if _exited(fd):
        os.close(fd)
        del live[p]
  for fd in live.values():
    try:
      signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
      pass
  # Namespaced sandboxes: this process is their PID namespaces' ancestor's init; its exit
  # takes them all down.


def _fork_sandbox(pool_pidns):
  """os.fork(), the child in a new PID namespace of its own (as its PID 1) when `pool_pidns`
  (an fd of this process's PID namespace) is given."""
  if pool_pidns is None:
    return os.fork()
  _check(_libc.unshare(CLONE_NEWPID), "unshare a PID namespace")
  pid = -1
  try:
    pid = os.fork()
  finally:
    if pid != 0:  # Here, not in the child, which is in the new namespace for good.
      _check(_libc.setns(pool_pidns, CLONE_NEWPID), "setns back to the pool's")
  return pid


def _exited(pidfd):
  return bool(select.select([pidfd], [], [], 0)[0])


def probe(req):
  """Builds one sandbox the way `serve` does, runs nothing in it, as a host check (see
  `hostcheck`). Raises if any step fails."""
  ctl_r, host_w = os.pipe()
  host_r, ctl_w = os.pipe()
  pid = _fork_sandbox(_pool_namespaces(0))  # As serve() does.
  if pid == 0:
    _sandbox(dict(req, probe=True), ctl_r, ctl_w, [], True)
  os.close(ctl_r)
  os.close(ctl_w)
  first = os.read(host_r, 1 << 16)
  os.close(host_w)
  os.waitpid(pid, 0)
  if b'"probe": true' not in first:
    raise OSError(first[4:].decode(errors="replace"))


if __name__ == "__main__":
  if sys.argv[1:2] == ["--probe"]:
    try:
      probe(json.loads(sys.argv[2]))
    except BaseException as e:  # pylint: disable=broad-except
      print(f"{type(e).__name__}: {e}", file=sys.stderr)
      sys.exit(1)
    sys.exit(0)
  serve(socket.socket(fileno=int(sys.argv[1])), ns=sys.argv[2] == "--ns",
        nproc_cap=int(sys.argv[3]))
