"""Minimal test runner that runs inside the sandbox (stdlib only; the sandbox has no pytest).

Tests are pytest-style: top-level `def test_*():` functions using plain `assert`, in files named
by test ids `path/to/test_x.py` (every test in the file) or `path/to/test_x.py::test_name`.

Why not trust an exit code: graded code runs in the same process as the test, so it can call
`os._exit(0)` at import time or patch `sys.exit`. This runner never imports the code under test
itself: it finds test names with `ast`, then forks one child per test that imports and runs it,
and counts a test as passed only if the child sends back that test's random token after the
function returned. The child's stdout and stderr are captured (and shown truncated), so it
cannot print a forged summary; the runner makes itself non-dumpable so the child cannot reach its
descriptors through /proc. What remains (reading the token out of memory) is detected by
`envs.hacks` as exit-path or runner patching.

Usage: python3 testrunner.py --nonce NONCE [--timeout S] TEST_ID...
Prints one line: NONCE <json {"tests": {id: {"outcome", "message"}}}>.
"""

import ast
import ctypes
import importlib.util
import json
import os
import select
import signal
import sys
import time
import traceback

_MAX_MESSAGE = 2000


def _collect(test_ids):
  """Expands test ids to (file, name) pairs; returns (pairs, errors by id)."""
  pairs, errors = [], {}
  for tid in test_ids:
    path, _, name = tid.partition("::")
    try:
      with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
      errors[tid] = f"collection error: {type(e).__name__}: {e}"
      continue
    names = [n.name for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if name:
      if name in names:
        pairs.append((path, name))
      else:
        errors[tid] = f"collection error: no test function {name!r} in {path}"
    else:
      if not names:
        errors[tid] = f"collection error: no tests in {path}"
      pairs.extend((path, n) for n in names)
  return pairs, errors


def _child(path, name, token, wfd, out_fd):
  os.setpgid(0, 0)
  os.dup2(out_fd, 1)
  os.dup2(out_fd, 2)
  for fd in os.listdir("/proc/self/fd"):
    if int(fd) not in (0, 1, 2, wfd):
      try:
        os.close(int(fd))
      except OSError:
        pass
  try:
    directory = os.path.dirname(os.path.abspath(path))
    sys.path[:0] = [directory, os.getcwd()]
    modname = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    getattr(module, name)()
    os.write(wfd, b"PASS " + token)
    code = 0
  except BaseException as e:  # pylint: disable=broad-except
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    msg = "".join(lines[-3:])[-_MAX_MESSAGE:]
    os.write(wfd, b"FAIL " + msg.encode("utf-8", "replace"))
    code = 1
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:  # pylint: disable=broad-except
    pass
  os._exit(code)


def _run_one(path, name, timeout_s):
  token = os.urandom(16).hex().encode()
  r, w = os.pipe()
  out_r, out_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    os.close(out_r)
    _child(path, name, token, w, out_w)
  os.close(w)
  os.close(out_w)
  msg, out = b"", b""
  deadline = time.monotonic() + timeout_s
  fds = {r, out_r}
  timed_out = False
  while fds:
    left = deadline - time.monotonic()
    if left <= 0:
      timed_out = True
      break
    ready, _, _ = select.select(list(fds), [], [], left)
    for fd in ready:
      chunk = os.read(fd, 65536)
      if not chunk:
        fds.discard(fd)
      elif fd == r:
        msg = (msg + chunk)[:_MAX_MESSAGE + 64]
      else:
        out = (out + chunk)[:_MAX_MESSAGE]
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:
    pass
  os.waitpid(pid, 0)
  os.close(r)
  os.close(out_r)
  captured = out.decode("utf-8", "replace")
  if timed_out:
    return "timeout", f"timed out after {timeout_s:g}s\n{captured}"
  if msg == b"PASS " + token:
    return "passed", captured
  if msg.startswith(b"FAIL "):
    return "failed", msg[5:].decode("utf-8", "replace") + ("\n" + captured if captured else "")
  return "failed", "test process exited without reporting a result (exit path patched?)\n" + captured


def main(argv):
  nonce, timeout_s, ids = None, 5.0, []
  i = 0
  while i < len(argv):
    if argv[i] == "--nonce":
      nonce, i = argv[i + 1], i + 2
    elif argv[i] == "--timeout":
      timeout_s, i = float(argv[i + 1]), i + 2
    else:
      ids.append(argv[i])
      i += 1
  try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no /proc/<pid>/fd access.
  except (OSError, AttributeError):
    pass
  pairs, errors = _collect(ids)
  results = {tid: {"outcome": "error", "message": m} for tid, m in errors.items()}
  for path, name in pairs:
    outcome, message = _run_one(path, name, timeout_s)
    results[f"{path}::{name}"] = {"outcome": outcome, "message": message}
  line = json.dumps({"tests": results})
  os.write(1, f"{nonce} {line}\n".encode())


if __name__ == "__main__":
  main(sys.argv[1:])
