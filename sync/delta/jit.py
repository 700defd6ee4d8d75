"""numba for the delta kernels: loading it, and the on-disk cache of the compiled kernels.

What: `numba` (None when it is not installed, or `SYNC_NO_NUMBA` is set), `HAVE_NUMBA`, and
`njit(**options)`, the decorator every kernel of `sparse_kernels` and `unit_kernels` is
compiled with: `numba.njit` with numba's on-disk cache (`cache=True`) in `CACHE_DIR`.
`kernels()` lists the dispatchers it made (for `warm_up`'s tests and for reports).

Why a cache: numba compiles a kernel on its first call, which costs seconds per process
(1-4 s on a quiet machine, 14 s at load 3 on 2 cores for every kernel `codec.warm_up`
compiles). A sampler would pay that on its first delta, so its first swap would be seconds
late. With the compiled code on disk, a new process loads it in a fraction of that, and
`codec.warm_up` at a sampler's start-up (`Subscriber` calls it) does even that before the
first delta arrives.

Where the cache lives, the first writable of:
  * `SYNC_KERNEL_CACHE_DIR` (empty, "0" or "off": no cache, compile in every process);
  * `NUMBA_CACHE_DIR`, where the user pointed numba's caches;
  * `$XDG_CACHE_HOME/sync-delta-kernels` (default `~/.cache/sync-delta-kernels`);
  * `<temp dir>/sync-delta-kernels-<uid>`.
Numba's own default, `__pycache__` beside the source, is no good under Bazel, whose runfiles
trees may be read-only (numba would then fall back to its user-wide directory silently), and
a project-chosen directory is one a test can point at. If none is writable, the kernels are
compiled per process as before (a WARNING says so).

Within that directory the kernels go to a subdirectory named by a hash of numba's version and
the sources of this module, `chunk_format`, `sparse_kernels` and `unit_kernels`. Numba checks
a cached function only against its own source file, but the kernels call functions and read
constants of the other modules (`unit_kernels` calls `sparse_kernels.mix_nb`, both read
`chunk_format`'s hash constants), so a change to any of them must select a fresh cache; the
compiled code is also keyed by the CPU (numba's own index), so one directory can serve
different machines.

Kernels compiled through `njit` must not hold numba dispatchers in closure variables: numba
keys a cached closure by its pickled cell contents, and a dispatcher pickles with a random
per-process id, so such a kernel would miss the cache in every new process. Call other
kernels through module globals instead.
"""

import contextlib
import hashlib
import logging
import os
import tempfile
import threading

log = logging.getLogger(__name__)

try:
  if os.environ.get("SYNC_NO_NUMBA"):  # for measuring and testing the fallback in a process
    raise ImportError("SYNC_NO_NUMBA is set")
  import numba  # pylint: disable=g-import-not-at-top
  from numba.core import config as _numba_config  # pylint: disable=g-import-not-at-top
except ImportError:
  numba = None

HAVE_NUMBA = numba is not None

ENV = "SYNC_KERNEL_CACHE_DIR"
_OFF = ("", "0", "off")
# The modules whose source decides what a kernel compiles to (see the module docstring).
_SOURCES = ("jit.py", "chunk_format.py", "sparse_kernels.py", "unit_kernels.py")
_lock = threading.Lock()
_kernels = []


def _writable(path: str) -> bool:
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
      pass
    return True
  except OSError:
    return False


def _candidates() -> list:
  """The directories to try, in order (see the module docstring)."""
  if ENV in os.environ:
    chosen = os.environ[ENV]
    return [] if chosen.strip().lower() in _OFF else [chosen]
  out = []
  if os.environ.get("NUMBA_CACHE_DIR"):
    out.append(os.environ["NUMBA_CACHE_DIR"])
  xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  out.append(os.path.join(xdg, "sync-delta-kernels"))
  out.append(os.path.join(tempfile.gettempdir(), f"sync-delta-kernels-{os.getuid()}"))
  return out


def source_tag() -> str:
  """A hash of numba's version and the kernels' sources: the name of their cache subdirectory."""
  h = hashlib.sha256(getattr(numba, "__version__", "none").encode())
  here = os.path.dirname(os.path.abspath(__file__))
  for name in _SOURCES:
    with open(os.path.join(here, name), "rb") as f:
      h.update(name.encode() + b"\0" + f.read())
  return h.hexdigest()[:16]


def _cache_dir():
  """The writable directory this process caches kernels in, or None (see module docstring)."""
  if not HAVE_NUMBA:
    return None
  tried = _candidates()
  if not tried:
    return None
  tag = source_tag()
  for base in tried:
    path = os.path.join(os.path.abspath(os.path.expanduser(base)), tag)
    if _writable(path):
      return path
  log.warning("no writable directory for the delta kernels' numba cache (tried %s); every "
              "process compiles them (seconds) before its first delta", ", ".join(tried))
  return None


CACHE_DIR = _cache_dir()


@contextlib.contextmanager
def _numba_cache_dir(path: str):
  """numba's cache directory set to `path` while a dispatcher is made: its cache locator takes
  the directory when the decorator runs, so only the kernels made here use it."""
  with _lock:
    old = _numba_config.CACHE_DIR
    _numba_config.CACHE_DIR = path
    try:
      yield
    finally:
      _numba_config.CACHE_DIR = old


def njit(**options):
  """`numba.njit(**options)`, cached on disk in `CACHE_DIR` when there is one.

  Raises:
    RuntimeError: numba is not installed (callers define kernels only when `HAVE_NUMBA`).
  """
  if not HAVE_NUMBA:
    raise RuntimeError("numba is not installed")
  if "cache" in options:
    raise ValueError("njit chooses the cache itself (see sync.delta.jit)")

  def decorate(fn):
    if CACHE_DIR is None:
      disp = numba.njit(cache=False, **options)(fn)
    else:
      with _numba_cache_dir(CACHE_DIR):
        disp = numba.njit(cache=True, **options)(fn)
    _kernels.append(disp)
    return disp

  return decorate


def kernels() -> list:
  """Every dispatcher `njit` made in this process (compiled or not yet)."""
  return list(_kernels)


def compiled_signatures() -> int:
  """How many (kernel, signature) pairs this process has compiled or loaded from the cache."""
  return sum(len(d.signatures) for d in _kernels)
