"""No state leaks from one episode's sandbox into another's.

Sandboxes are single-use, but they are all forks of one spawn helper (`spawner`): its memory
image, its directories and the host uid are what episodes have in common. So an episode plants
state everywhere it can write (workspace, /tmp, /dev/shm, /dev, environment, interpreter
modules, SysV IPC, POSIX message queues, the user keyring, an abstract and a TCP socket left
listening, a daemon, a random stream) and, while it still holds all of it, a concurrent episode
looks for every piece, and so does the next episode after it is gone. Each plant is checked to
have worked first, so a probe that finds nothing means something.
"""

import os
import signal
import threading

import pytest

from envs import sandbox
from envs.sandbox import pool as pool_lib
from testlib import waiting

_MARK = f"envs-leak-{os.getpid()}"
_KEY = 0x5EED
_PORT = 47321

_COMMON = f"""
import ctypes, os, platform, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
SYS = {{"x86_64": (248, 250), "aarch64": (217, 219)}}[platform.machine()]  # add_key, keyctl
KEY, PORT, MARK = {_KEY}, {_PORT}, {_MARK!r}
PATHS = ["/workspace/planted", "/tmp/planted", "/dev/shm/planted", "/dev/planted"]
"""

_PLANT = _COMMON + """
import builtins, json, random
done = []
for p in PATHS:
  with open(p, "w") as f:
    f.write("secret")
  done.append(p)
os.environ["PLANTED"] = "1"
os.putenv("PLANTED_PUTENV", "1")
json.PLANTED = builtins.PLANTED = 1
sys.modules["planted"] = json
if libc.shmget(KEY, 4096, 0o1666) >= 0: done.append("shm")
if libc.msgget(KEY, 0o1666) >= 0: done.append("msg")
if libc.semget(KEY, 1, 0o1666) >= 0: done.append("sem")
if rt.mq_open(b"/planted", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0: done.append("mqueue")
if libc.syscall(SYS[0], b"user", b"planted", b"secret", 6, -4) > 0: done.append("keyring")
abstract = socket.socket(socket.AF_UNIX)
abstract.bind(b"\\0planted")
abstract.listen()
tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("127.0.0.1", PORT))
tcp.listen()
done += ["abstract", "tcp"]
if os.fork() == 0:  # A daemon, in its own session.
  os.setsid()
  os.execv(sys.executable, ["python3", "-c", "import time; time.sleep(300)", MARK + "-daemon"])
print(" ".join(done), random.getrandbits(64), flush=True)
for s in (abstract, tcp):
  s.set_inheritable(True)
# Holds everything open; the host sees the mark in the command line once all is planted.
os.execv(sys.executable, ["python3", "-c", "import time; time.sleep(300)", MARK])
"""

_PROBE = _COMMON + """
import builtins, errno, json, random
found = [p for p in PATHS if os.path.exists(p)]
found += [k for k in ("PLANTED", "PLANTED_PUTENV") if k in os.environ]
found += [n for n, v in (("json", hasattr(json, "PLANTED")), ("builtins", hasattr(builtins, "PLANTED")),
                         ("modules", "planted" in sys.modules)) if v]
if libc.shmget(KEY, 0, 0) >= 0: found.append("shm")
if libc.msgget(KEY, 0) >= 0: found.append("msg")
if libc.semget(KEY, 0, 0) >= 0: found.append("sem")
if rt.mq_open(b"/planted", os.O_RDWR) >= 0: found.append("mqueue")
if libc.syscall(SYS[1], 10, -4, b"user", b"planted", 0) >= 0: found.append("keyring")  # SEARCH
for name, family, addr in (("abstract", socket.AF_UNIX, b"\\0planted"),
                           ("tcp", socket.AF_INET, ("127.0.0.1", PORT))):
  s = socket.socket(family)
  try:
    s.connect(addr)
    found.append(name)
  except OSError:
    pass
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
found += [f"process {p}" for p in others]
print("FOUND", found, random.getrandbits(64))
"""


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def _marked():
  found = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/cmdline", "rb") as f:
          if _MARK.encode() in f.read():
            found.append(int(name))
      except OSError:
        pass
  return found


def _probe(pool):
  r = sandbox.run(command=["python3", "-c", _PROBE], pool=pool)
  assert r.exit_code == 0, r
  found, rand = r.stdout.split("FOUND ")[1].rsplit(" ", 1)
  return found, int(rand)


def test_nothing_one_episode_leaves_reaches_another(pool):
  with sandbox.Sandbox({}, pool=pool) as planter:
    result = {}
    t = threading.Thread(target=lambda: result.update(r=planter.exec(
        ["python3", "-c", _PLANT], fast_path=False, timeout_s=120)))
    t.start()
    try:
      # Both the daemon and the holder carry the mark once everything is planted.
      waiting.wait_until(lambda: len(_marked()) >= 2 or not t.is_alive(),
                         lambda: f"the planting episode to finish planting ({_marked()})",
                         timeout_s=60)
      assert t.is_alive(), result
      during, rand_during = _probe(pool)  # A concurrent episode.
    finally:
      for pid in _marked():
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      waiting.wait_until(lambda: not t.is_alive(), "the planting command to end", timeout_s=60)
    # The probe finds what outlives a command in the planter's own sandbox (its processes and
    # sockets were killed with the command), so an empty finding elsewhere means something.
    same = planter.exec(["python3", "-c", _PROBE])
    assert same.stdout.split("FOUND ")[1].rsplit(" ", 1)[0] == str(
        ["/workspace/planted", "/tmp/planted", "/dev/shm/planted", "/dev/planted", "shm", "msg",
         "sem", "mqueue", "keyring"]), same
  planted, rand_planted = result["r"].stdout.split()[:-1], int(result["r"].stdout.split()[-1])
  assert planted == ["/workspace/planted", "/tmp/planted", "/dev/shm/planted", "/dev/planted",
                     "shm", "msg", "sem", "mqueue", "keyring", "abstract", "tcp"], result["r"]
  after, rand_after = _probe(pool)  # The next episode, once the planter is gone.
  assert during == "[]" and after == "[]", (during, after)
  # Each sandbox's interpreter draws its own random stream, though all are forks of one helper.
  assert len({rand_planted, rand_during, rand_after}) == 3
