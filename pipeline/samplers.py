"""The controller's view of the samplers: submit a request, learn each sampler's policy version,
and route around samplers that fail.

`EngineSampler` wraps an in-process `rollout.engine.Engine`; `HttpSampler` talks to a sampling
server over its OpenAI-compatible HTTP API (the multi-process deployment). `SamplerSet` sends each
request to the live sampler with the least work in flight and, when a sampler fails a request
(it died, its connection broke, it timed out), marks it dead and retries the request on another
one, so no request is lost and none is answered twice. A request a sampler refuses as invalid
(`RequestRejected`) is not retried: it is a bug in the request, and the controller stops on it.

A dead sampler is not written off: it is probed again with doubling back-off (a restarted
sampler process comes back at the same address) and rejoins once it is up and serves weights
within the staleness bound of the newest version any sampler served, so a run does not go on at
reduced capacity after a sampler restart, nor take samples from a sampler that is still behind.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

import numpy as np

from rollout.engine import Completion, EngineStopped
from rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


class SamplerDown(RuntimeError):
  """A sampler cannot take or finish requests (dead process, stopped engine, broken link)."""


class RequestRejected(ValueError):
  """A sampler refused the request itself (HTTP 4xx): a bug in the request, which another
  sampler would refuse too, so it is neither retried nor counted against the sampler."""


class EngineSampler:
  """An in-process engine."""

  def __init__(self, engine, name: str = "sampler"):
    self.engine = engine
    self.name = name

  def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
             timeout: Optional[float] = None) -> concurrent.futures.Future:
    try:
      return self.engine.submit(list(prompt_ids), params, timeout=timeout).future
    except EngineStopped as e:
      raise SamplerDown(f"{self.name}: {e}") from e

  def version(self) -> int:
    return int(self.engine.version)

  def alive(self) -> bool:
    return bool(self.engine.running)


class HttpSampler:
  """A sampling server reached over HTTP (`POST /v1/completions` with token-id prompts)."""

  def __init__(self, base_url: str, name: str = "", workers: int = 64):
    self.base_url = base_url.rstrip("/")
    self.name = name or base_url
    self._executor = concurrent.futures.ThreadPoolExecutor(workers)

  def _fetch(self, path: str, body: Optional[dict], timeout: Optional[float]) -> bytes:
    """GET (body None) or POST JSON; returns the response body.

    Raises:
      RequestRejected: the server refused the request (HTTP 4xx other than 429).
      SamplerDown: anything else (refused or reset connection, timeout, a body cut short,
        HTTP 429 / 5xx).
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(self.base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()
    except urllib.error.HTTPError as e:
      if e.code in (429, 500, 502, 503, 504):
        raise SamplerDown(f"{self.name}: {path}: HTTP {e.code}") from e
      raise RequestRejected(f"{self.name}: {path}: HTTP {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
      raise SamplerDown(f"{self.name}: {path}: {e!r}") from e

  def _complete(self, prompt_ids, params: SamplingParams, timeout) -> list:
    body = {"model": "policy", "prompt": [int(t) for t in prompt_ids], "n": params.n,
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "seed": params.seed, "logprobs": 1,
            "stop_token_ids": list(params.stop_token_ids), "return_routing": True,
            "return_prompt_routing": True}
    if timeout is not None:
      body["timeout"] = timeout
    if params.stop:
      body["stop"] = list(params.stop)
    raw = self._fetch("/v1/completions", body, None if timeout is None else timeout + 30)
    try:
      out = json.loads(raw)
    except json.JSONDecodeError as e:  # a body cut short by a dying server
      raise SamplerDown(f"{self.name}: unreadable response ({e})") from e

    def arr(x):  # [moe_layers][positions][k] lists -> uint8 array
      return None if x is None else np.asarray(x, np.uint8)

    comps = []
    for ch in sorted(out["choices"], key=lambda c: c["index"]):
      comps.append(Completion(
          token_ids=list(ch["token_ids"]), logprobs=list(ch["logprobs"]["token_logprobs"]),
          routing=arr(ch.get("routing")), policy_versions=list(ch["policy_versions"]),
          finish_reason=ch.get("finish_reason") or "stop", text=ch.get("text", ""),
          index=ch["index"], prompt_routing=arr(ch.get("prompt_routing"))))
    return comps

  def submit(self, prompt_ids, params: SamplingParams, timeout: Optional[float] = None):
    return self._executor.submit(self._complete, list(prompt_ids), params, timeout)

  def version(self) -> int:
    for line in self._fetch("/metrics", None, 5).decode().splitlines():
      if line.startswith("rollout_policy_version"):
        return int(float(line.split()[-1]))
    raise SamplerDown(f"{self.name}: /metrics has no policy_version")

  def alive(self) -> bool:
    try:
      self._fetch("/health", None, 5)
      return True
    except (SamplerDown, RequestRejected):
      return False


class SamplerSet:
  """Routes requests over samplers, retrying failed ones elsewhere.

  Args:
    samplers: EngineSampler / HttpSampler objects.
    max_attempts: tries per request in all (across samplers) before its future fails.
    max_lag: a dead sampler rejoins only when it serves a version at most this many behind the
      newest any sampler served (the pipeline's staleness bound).
    probe_backoff_s: first wait before a dead sampler is probed again; it doubles after each
      failed probe, up to `max_probe_backoff_s`, and starts over when the sampler dies again.
    clock: monotonic seconds (tests pass a manual clock).
  """

  def __init__(self, samplers: Sequence, *, max_attempts: int = 3, max_lag: int = 0,
               probe_backoff_s: float = 0.5, max_probe_backoff_s: float = 30.0,
               clock=time.monotonic):
    if not samplers:
      raise ValueError("SamplerSet needs at least one sampler")
    if max_lag < 0 or probe_backoff_s <= 0 or max_probe_backoff_s < probe_backoff_s:
      raise ValueError("SamplerSet: need max_lag >= 0 and 0 < probe_backoff_s <= "
                       "max_probe_backoff_s")
    self.samplers = list(samplers)
    self.max_attempts = max_attempts
    self.max_lag = max_lag
    self.probe_backoff_s = probe_backoff_s
    self.max_probe_backoff_s = max_probe_backoff_s
    self._clock = clock
    self._lock = threading.Lock()
    self._probing = threading.Lock()
    self._inflight = {id(s): 0 for s in self.samplers}
    self._dead: set[int] = set()
    self._backoff: dict[int, float] = {}
    self._probe_at: dict[int, float] = {}
    self.newest_version: Optional[int] = None
    self.retries = 0
    self.failed_requests = 0
    self.rejoins = 0

  def live(self) -> list:
    with self._lock:
      return [s for s in self.samplers if id(s) not in self._dead]

  def dead(self) -> list:
    with self._lock:
      return [s for s in self.samplers if id(s) in self._dead]

  def mark_dead(self, sampler, why: str) -> None:
    with self._lock:
      if id(sampler) not in self._dead:
        self._dead.add(id(sampler))
        self._backoff[id(sampler)] = self.probe_backoff_s
        self._probe_at[id(sampler)] = self._clock() + self.probe_backoff_s
        log.warning("sampler %s is down (%s); its requests go elsewhere, and it is probed "
                    "again in %.1fs", sampler.name, why, self.probe_backoff_s)

  def _saw(self, version: int) -> None:
    with self._lock:
      if self.newest_version is None or version > self.newest_version:
        self.newest_version = version

  def probe_dead(self) -> list:
    """Probes every dead sampler whose back-off has run out; returns those that rejoined.

    A sampler rejoins when it answers and serves a version within `max_lag` of the newest;
    otherwise its next probe waits twice as long (up to `max_probe_backoff_s`).
    """
    if not self._probing.acquire(blocking=False):
      return []  # another thread is probing; one prober is enough
    try:
      now = self._clock()
      with self._lock:
        due = [s for s in self.samplers if id(s) in self._dead and self._probe_at[id(s)] <= now]
      rejoined = []
      for s in due:
        try:
          v = s.version() if s.alive() else None
          why = "it does not answer" if v is None else None
        except SamplerDown as e:
          v, why = None, str(e)
        with self._lock:
          newest = self.newest_version
          if v is not None and (newest is None or v >= newest - self.max_lag):
            self._dead.discard(id(s))
            self.rejoins += 1
            rejoined.append(s)
            log.warning("sampler %s is back (version %d, newest %s); it takes requests again",
                        s.name, v, newest)
            continue
          if why is None:
            why = f"it serves version {v}, more than {self.max_lag} behind the newest {newest}"
          b = self._backoff[id(s)] = min(2 * self._backoff[id(s)], self.max_probe_backoff_s)
          self._probe_at[id(s)] = self._clock() + b
        log.info("sampler %s is still out (%s); next probe in %.1fs", s.name, why, b)
      return rejoined
    finally:
      self._probing.release()

  def min_version(self) -> Optional[int]:
    """The oldest policy version any live sampler serves (None if none is live).

    Probes the dead samplers first (see `probe_dead`), so a restarted one rejoins here.
    """
    self.probe_dead()
    versions = []
    for s in self.live():
      try:
        versions.append(s.version())
      except SamplerDown as e:
        self.mark_dead(s, str(e))
    if versions:
      self._saw(max(versions))
    return min(versions) if versions else None

  def _pick(self, exclude: set):
    with self._lock:
      cands = [s for s in self.samplers if id(s) not in self._dead and id(s) not in exclude]
      if not cands:
        cands = [s for s in self.samplers if id(s) not in self._dead]
      if not cands:
        return None
      s = min(cands, key=lambda s: self._inflight[id(s)])
      self._inflight[id(s)] += 1
      return s

  def submit(self, prompt_ids, params: SamplingParams,
             timeout: Optional[float] = None) -> concurrent.futures.Future:
    """A future of the request's completions; retried on other samplers when one fails."""
    result: concurrent.futures.Future = concurrent.futures.Future()
    tried: set = set()

    def attempt(n: int) -> None:
      s = self._pick(tried)
      if s is None and self.probe_dead():
        s = self._pick(tried)
      if s is None:
        self.failed_requests += 1
        result.set_exception(SamplerDown("no live sampler"))
        return
      tried.add(id(s))
      try:
        fut = s.submit(prompt_ids, params, timeout)
      except SamplerDown as e:
        done(s, n, e)
        return
      fut.add_done_callback(lambda f: done(s, n, f.exception(), f))

    def done(s, n, err, fut=None) -> None:
      with self._lock:
        self._inflight[id(s)] -= 1
      if err is None:
        comps = fut.result()
        if any(c.finish_reason in ("cancelled", "error") for c in comps):
          err = SamplerDown(f"{s.name}: request ended early ({comps[0].finish_reason})")
        else:
          result.set_result(comps)
          return
      if isinstance(err, RequestRejected):
        self.failed_requests += 1
        result.set_exception(err)
        return
      if isinstance(err, (SamplerDown, EngineStopped)) or not s_alive(s):
        self.mark_dead(s, str(err))
      if n + 1 >= self.max_attempts:
        self.failed_requests += 1
        result.set_exception(err)
        return
      self.retries += 1
      attempt(n + 1)

    def s_alive(s) -> bool:
      try:
        return s.alive()
      except Exception:  # pylint: disable=broad-except
        return False

    attempt(0)
    return result
