"""An HTTP relay (and origin) for weight-sync objects, for a per-cluster relay tree.

What: `Relay(upstream)` serves `GET /o/<key>` (with `Range`) for the objects of a store. Its
upstream is either a `store.Store` (then it is the origin, next to the learner) or the URLs of
a parent relay (then it is a cluster relay). Immutable objects (versioned keys) are fetched
from upstream once, concurrent requests for the same key share that one fetch, and the result
is cached (LRU by bytes); indexes (`INDEX.json`, and a sharded version's, `manifest.is_mutable`)
are refetched after a short TTL, and a root index refetched drops the shards' (so a shard's
index served is never older than the root one served before it). `warm()` pulls the newest
version's manifest and delta before samplers ask, so a cluster's samplers never wait on the
WAN one by one. `RelayServer` runs a relay on its own thread (tests, tools). A parent found by
name is followed when it moves (`resolve_upstream`, as transport.HttpSource's `resolve`).

Why: across clusters the WAN is the scarce link; one relay per cluster moves each version over
it exactly once and serves the local samplers over the cluster network. A relay never hands
out partial objects it has not finished receiving, and samplers verify hashes anyway.
"""

import asyncio
import collections
import threading
import time

import aiohttp
from aiohttp import web

from sync import transport
from sync import manifest as manifest_lib

_SLICE = 256 << 10
_ROOT_INDEXES = (manifest_lib.INDEX_KEY, manifest_lib.SHARDED_INDEX_KEY)


class _StoreUpstream:

  def __init__(self, store):
    self._store = store

  async def get(self, key):
    return await asyncio.get_running_loop().run_in_executor(None, self._store.get, key)


class _HttpUpstream:

  def __init__(self, urls, stats, resolve=None):
    self._urls = [urls] if isinstance(urls, str) else list(urls)
    self._stats = stats
    self._resolve = resolve
    self._session = None

  async def get(self, key):
    if self._session is None:
      self._session = aiohttp.ClientSession()
    try:
      return await transport.fetch(self._session, self._urls, key, stats=self._stats)
    except transport.HttpError:
      if not self._follow():
        raise
      return await transport.fetch(self._session, self._urls, key, stats=self._stats)

  def _follow(self) -> bool:
    """Takes the parents' URLs `resolve` gives now (a parent placed again elsewhere)."""
    if self._resolve is None:
      return False
    try:
      urls = [u.rstrip("/") for u in self._resolve()]
    except Exception:  # pylint: disable=broad-except
      return False
    if not urls or urls == [u.rstrip("/") for u in self._urls]:
      return False
    transport.log.warning("upstream relays moved from %s to %s", ", ".join(self._urls),
                          ", ".join(urls))
    self._urls = urls
    return True

  async def close(self):
    if self._session is not None:
      await self._session.close()


class Relay:
  """Serves and caches store objects from an upstream (see module docstring)."""

  def __init__(self, upstream, *, cache_bytes: int = 8 << 30, index_ttl_s: float = 0.2,
               resolve_upstream=None):
    """`resolve_upstream`: with URLs for `upstream`, where those parents are now (asked again
    when none of them answers, as transport.HttpSource's `resolve`)."""
    self.upstream_stats = transport.Stats()
    if isinstance(upstream, (str, list, tuple)):
      self._up = _HttpUpstream(upstream, self.upstream_stats, resolve_upstream)
    else:
      self._up = _StoreUpstream(upstream)
    self.cache_bytes = cache_bytes
    self.index_ttl_s = index_ttl_s
    self._cache = collections.OrderedDict()
    self._cached = 0
    self._inflight = {}
    self._index = {}  # index key -> (monotonic time fetched, bytes)
    self.upstream_fetches = collections.Counter()  # key -> upstream fetches
    self.served_bytes = 0

  async def get(self, key: str) -> bytes:
    """The object, from cache, from an in-flight fetch, or from upstream."""
    if manifest_lib.is_mutable(key):  # an index (a sharded version has one per shard)
      t, data = self._index.get(key, (0.0, None))
      if data is None or time.monotonic() - t > self.index_ttl_s:
        data = await self._up.get(key)
        if key in _ROOT_INDEXES:
          # A shard's index is never older than the root index served before it: a sampler
          # that read a new version in the root goes on to find it in every shard's index
          # (the learner writes those first), not in one cached a moment before.
          for k in [k for k in self._index if k not in _ROOT_INDEXES]:
            del self._index[k]
        self._index[key] = (time.monotonic(), data)
      return data
    if key in self._cache:
      self._cache.move_to_end(key)
      return self._cache[key]
    fut = self._inflight.get(key)
    if fut is None:
      fut = asyncio.get_running_loop().create_future()
      self._inflight[key] = fut
      try:
        self.upstream_fetches[key] += 1
        data = await self._up.get(key)
        self._put(key, data)
        fut.set_result(data)
      except BaseException as e:
        fut.set_exception(e)
        fut.exception()  # mark retrieved; waiters re-raise it
        raise
      finally:
        del self._inflight[key]
    return await asyncio.shield(fut)

  def _put(self, key, data):
    if len(data) > self.cache_bytes:
      return
    self._cache[key] = data
    self._cached += len(data)
    while self._cached > self.cache_bytes:
      _, old = self._cache.popitem(last=False)
      self._cached -= len(old)

  async def warm(self) -> int | None:
    """Prefetches the newest version's manifest and delta (or snapshot); returns its number."""
    index = manifest_lib.Index.from_bytes(await self.get(manifest_lib.INDEX_KEY))
    if index.latest is None:
      return None
    m = manifest_lib.Manifest.from_bytes(
        await self.get(manifest_lib.manifest_key(index.latest)))
    refs = [m.delta] if m.delta is not None else m.snapshot
    await asyncio.gather(*(self.get(r.key) for r in refs))
    return index.latest

  async def _send(self, resp: web.StreamResponse, data: memoryview) -> None:
    for i in range(0, len(data), _SLICE):
      await resp.write(data[i:i + _SLICE])
      self.served_bytes += min(_SLICE, len(data) - i)

  async def handle(self, request: web.Request) -> web.StreamResponse:
    key = request.match_info["key"]
    if ".." in key.split("/"):
      raise web.HTTPBadRequest()
    try:
      data = await self.get(key)
    except KeyError:
      raise web.HTTPNotFound() from None
    except (transport.HttpError, OSError) as e:
      raise web.HTTPBadGateway(text=str(e)) from None
    start, status, headers = 0, 200, {}
    rng = request.headers.get("Range")
    if rng:
      try:
        unit, spec = rng.split("=", 1)
        start = int(spec.split("-", 1)[0])
        assert unit == "bytes" and 0 <= start
      except (ValueError, AssertionError):
        raise web.HTTPBadRequest(text="bad Range") from None
      if start >= len(data):
        raise web.HTTPRequestRangeNotSatisfiable(
            headers={"Content-Range": f"bytes */{len(data)}"})
      status = 206
      headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_length = len(data) - start
    await resp.prepare(request)
    await self._send(resp, memoryview(data)[start:])
    await resp.write_eof()
    return resp

  def app(self) -> web.Application:
    app = web.Application()
    app.router.add_get(transport.OBJECT_PREFIX + "{key:.+}", self.handle)
    return app

  async def close(self):
    if isinstance(self._up, _HttpUpstream):
      await self._up.close()


class RelayServer:
  """Runs a Relay on 127.0.0.1 (or `host`) in a background thread."""

  def __init__(self, relay: Relay, host: str = "127.0.0.1", port: int = 0):
    self.relay = relay
    self._host, self._port = host, port
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._runner = None
    self.url = None

  def start(self) -> str:
    self._thread.start()
    self.url = self.call(self._start())
    return self.url

  async def _start(self):
    self._runner = web.AppRunner(self.relay.app())
    await self._runner.setup()
    site = web.TCPSite(self._runner, self._host, self._port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # pylint: disable=protected-access
    return f"http://{self._host}:{port}"

  def call(self, coro):
    """Runs a coroutine on the relay's loop and waits for it."""
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def stop(self) -> None:
    """Stops serving at once, cutting open transfers (what a crashing relay does)."""
    async def _stop():
      await self._runner.shutdown()
      await self._runner.cleanup()
      await self.relay.close()
    self.call(_stop())
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()


def serve(store_url: str, port: int, upstream: list | None = None) -> None:
  """Blocking: an origin (upstream=None, serving `store_url`) or a cluster relay."""
  from sync import store as store_lib  # pylint: disable=g-import-not-at-top
  relay = Relay(upstream if upstream else store_lib.Store(store_url))
  web.run_app(relay.app(), port=port)

