"""HTTP transport for weight sync: resumable GETs and a blocking `HttpSource`.

What: `fetch(session, urls, key)` downloads one immutable object from the first of `urls` that
answers, and when a transfer breaks (a relay dies, a connection resets) it continues from the
byte it reached with an HTTP `Range` request, on the same or the next URL. `HttpSource(urls)`
wraps that in a background event loop with the same `.get(key)` as `store.Store`, so a
`Subscriber` reads through relays exactly as it reads a store.

Why resume instead of retry: deltas of a 1 TB model are tens of GB; a restart from zero after a
hiccup would cost more than the update. Objects are immutable (versioned keys) and verified by
hash afterwards, so stitching bytes from two relays is safe. `INDEX.json` is the one mutable
object; it is small and always fetched whole.

Relays found by name (a launcher's `@relay_0`, launch/discovery.py) may come back elsewhere: a
cluster places a relay whose node died on another node, at another address. `HttpSource(urls,
resolve=...)` asks `resolve` for the relays' URLs now whenever no URL could deliver an object,
and when they changed, follows them and tries again at once (as a controller re-resolves a
sampler that went down, pipeline/samplers.HttpSampler). A relay that is only down (the same
address) is left to the caller's next poll.
"""

import asyncio
import logging
import threading
from typing import Callable, Optional, Sequence

import aiohttp

OBJECT_PREFIX = "/o/"
_RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
log = logging.getLogger(__name__)


class HttpError(IOError):
  """No URL could deliver the object."""


class Stats:
  """Bytes received and resumes, for reports and tests."""

  def __init__(self):
    self.bytes = 0
    self.resumes = 0
    self.requests = 0


async def fetch(session: aiohttp.ClientSession, urls: list, key: str, *, attempts: int = 6,
                stats: Stats | None = None, read_size: int = 1 << 20) -> bytes:
  """The bytes of `key` from relays/origins at `urls`, resuming broken transfers.

  Raises:
    KeyError: every URL answered 404.
    HttpError: attempts exhausted.
  """
  stats = stats or Stats()
  buf = bytearray()
  total = None
  missing = 0
  last_err = None
  for attempt in range(attempts * len(urls)):
    url = urls[attempt % len(urls)].rstrip("/") + OBJECT_PREFIX + key
    headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
    try:
      stats.requests += 1
      async with session.get(url, headers=headers) as resp:
        if resp.status == 404:
          missing += 1
          if missing >= len(urls):
            raise KeyError(key)
          continue
        if resp.status == 200:
          buf.clear()  # the server ignored the range: start over
          total = resp.content_length
        elif resp.status == 206:
          cr = resp.headers.get("Content-Range", "")  # bytes a-b/total
          start = int(cr.split()[1].split("-")[0])
          total = int(cr.rsplit("/", 1)[1])
          if start != len(buf):
            raise HttpError(f"server resumed at {start}, wanted {len(buf)}")
        elif resp.status == 416 and total is not None and len(buf) == total:
          return bytes(buf)
        else:
          raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
        async for piece in resp.content.iter_chunked(read_size):
          buf += piece
          stats.bytes += len(piece)
        if total is None or len(buf) == total:
          return bytes(buf)
        last_err = HttpError(f"short body {len(buf)}/{total}")
    except _RETRYABLE as e:
      last_err = e
    if buf:
      stats.resumes += 1
    await asyncio.sleep(min(0.05 * attempt, 1.0))
  raise HttpError(f"could not fetch {key} from {urls}: {last_err!r}")


class HttpSource:
  """A blocking `.get(key)` over relays/origins at `urls` (tried in order, resuming).

  `resolve`: where the relays are now (their URLs, in the same order), asked again when no URL
  could deliver an object; None: always `urls`. `moves` counts the times it followed them.
  """

  def __init__(self, urls, *, timeout_s: float = 60.0, attempts: int = 6,
               resolve: Optional[Callable[[], Sequence[str]]] = None):
    self.urls = [urls] if isinstance(urls, str) else list(urls)
    self.attempts = attempts
    self.stats = Stats()
    self.moves = 0
    self._resolve = resolve
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._thread.start()
    self._timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s,
                                          sock_connect=timeout_s)
    self._session = self._call(self._make_session())

  async def _make_session(self):
    return aiohttp.ClientSession(timeout=self._timeout)

  def _call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def get(self, key: str) -> bytes:
    try:
      return self._fetch(key)
    except HttpError:
      if not self.follow():
        raise
      return self._fetch(key)

  def _fetch(self, key: str) -> bytes:
    return self._call(fetch(self._session, self.urls, key, attempts=self.attempts,
                            stats=self.stats))

  def follow(self) -> bool:
    """Takes the URLs `resolve` gives now; whether they differ from those in use."""
    if self._resolve is None:
      return False
    try:
      urls = [u.rstrip("/") for u in self._resolve()]
    except Exception as e:  # pylint: disable=broad-except
      log.info("relays %s cannot be resolved now (%r)", self.urls, e)
      return False
    if not urls or urls == [u.rstrip("/") for u in self.urls]:
      return False
    log.warning("relays moved from %s to %s", ", ".join(self.urls), ", ".join(urls))
    self.urls = urls
    self.moves += 1
    return True

  def close(self) -> None:
    self._call(self._session.close())
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
