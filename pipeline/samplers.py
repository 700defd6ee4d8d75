"""The controller's view of the samplers: submit a request, learn each sampler's policy version,
and route around samplers that fail.

`EngineSampler` wraps an in-process `rollout.engine.Engine` (or a `rollout.replicas.ReplicaSet`:
one sampler made of data-parallel engines, which `build_engines` lays out over the devices);
`HttpSampler` talks to a sampling
server over its OpenAI-compatible HTTP API (the multi-process deployment) through the harness's
completions client (`envs.harness.openai_policy`, the project's one). Both answer with the
harness's `envs.harness.policy.Completion` (token ids, logprobs, versions, routing of the
generated and of the prompt positions), the one type the controller, the harness and
`pipeline.episodes` handle; `pipeline.sampler_policy` puts a `SamplerSet` behind the harness's
`Policy` protocol. `SamplerSet` sends each
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
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional, Sequence

import jax

from envs.harness import inprocess_policy
from envs.harness import openai_policy
from moe.config import ModelConfig
from moe.tokenizer import ByteTokenizer
from rollout import replicas as replicas_lib
from rollout.engine import Engine, EngineConfig, EngineStopped
from rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


class SamplerDown(RuntimeError):
  """A sampler cannot take or finish requests (dead process, stopped engine, broken link)."""


class RequestRejected(ValueError):
  """A sampler refused the request itself (HTTP 4xx): a bug in the request, which another
  sampler would refuse too, so it is neither retried nor counted against the sampler."""


def build_engines(flat, cfg: ModelConfig, *, count: int = 1, replicas: int = 1,
                  expert: int = 1, tensor: int = 1, devices: Optional[Sequence] = None,
                  config: EngineConfig = EngineConfig(), tokenizer=None,
                  version: int = 0) -> list:
  """The in-process samplers' engines: `count` samplers, each `replicas` data-parallel engines
  (a `rollout.replicas.ReplicaSet`; an Engine when 1), each engine on `expert` x `tensor`
  devices (a mesh sharding the model, `rollout.placement`; one device when 1 x 1).

  Sampler i takes devices [i R E T, (i + 1) R E T) of `devices` (default: jax.local_devices();
  pass `pipeline.resources.split_devices(...).sampler_devices` to keep the learner's devices
  out). With one engine of one device per sampler and no `devices`, every engine runs on the
  default device, as samplers sharing one device always have (the CPU pipeline and its tests).

  A ReplicaSet is one sampler to the controller: one `EngineSampler`, one weight subscriber,
  whose swaps reach all its replicas at the same version (`ReplicaSet.swap_weights`).

  Raises:
    ValueError: too few devices for the layout (naming how many it needs), or a mesh the model
      cannot be sharded over.
  """
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}")
  kw = dict(config=config, tokenizer=tokenizer, version=version)
  if replicas == 1 and expert * tensor == 1 and devices is None:
    return [Engine.from_flat(flat, cfg, **kw) for _ in range(count)]
  devices = list(jax.local_devices() if devices is None else devices)
  need = count * replicas * expert * tensor
  if need > len(devices):
    raise ValueError(f"{count} samplers of {replicas} replicas of {expert * tensor} devices "
                     f"need {need} devices, have {len(devices)}")
  groups = replicas_lib.device_groups(devices, count, replicas * expert * tensor)
  out = []
  try:
    for group in groups:
      out.append(replicas_lib.build(flat, cfg, replicas=replicas, expert=expert, tensor=tensor,
                                    devices=group, **kw))
  except BaseException:
    for e in out:
      e.stop()
    raise
  return out


class EngineSampler:
  """An in-process engine (or replica set); its completions become the harness's Completions."""

  def __init__(self, engine, name: str = "sampler"):
    self.engine = engine
    self.name = name
    self.tokenizer = getattr(engine, "tokenizer", None) or ByteTokenizer()

  def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
             timeout: Optional[float] = None) -> concurrent.futures.Future:
    try:
      handle = self.engine.submit(list(prompt_ids), params, timeout=timeout)
    except EngineStopped as e:
      raise SamplerDown(f"{self.name}: {e}") from e
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f):
      if f.exception() is not None:
        out.set_exception(f.exception())
        return
      try:
        out.set_result([inprocess_policy.convert(c, self.tokenizer, params.max_tokens,
                                                 params.stop) for c in f.result()])
      except Exception as e:  # pylint: disable=broad-except
        out.set_exception(e)

    handle.future.add_done_callback(done)
    return out

  def version(self) -> int:
    return int(self.engine.version)

  def alive(self) -> bool:
    return bool(self.engine.running)


class HttpSampler:
  """A sampling server reached over HTTP (`POST /v1/completions` with token-id prompts).

  Requests go through `envs.harness.openai_policy.OpenAIPolicy` with the project server's extra
  fields (stop token ids, routing of generated and prompt positions, a server-side timeout).
  `require` names the fields a choice must carry (default: token ids, logprobs, per-token
  versions); a server that leaves one out is refused with the reason (`RequestRejected`).
  """

  def __init__(self, base_url: str, name: str = "", workers: int = 64, tokenizer=None,
               require: Sequence[str] = ("token_ids", "logprobs", "policy_versions"),
               resolve: Optional[Callable[[], str]] = None):
    """`resolve`: where the server is now, asked again before each health probe, for a
    server that may come back at another address (a sampler a cluster placed again on
    another node, found by name through launch.discovery); None: always `base_url`."""
    self.name = name or base_url
    self._executor = concurrent.futures.ThreadPoolExecutor(workers)
    self._tokenizer = tokenizer or ByteTokenizer()
    self._require = tuple(require)
    self._resolve = resolve
    self._connect(base_url)

  def _connect(self, base_url: str) -> None:
    self.base_url = base_url.rstrip("/")
    self.client = openai_policy.OpenAIPolicy(self.base_url, "policy", self._tokenizer,
                                             require=self._require)

  def _resolved(self) -> Optional[str]:
    if self._resolve is None:
      return None
    try:
      return self._resolve().rstrip("/")
    except Exception as e:  # pylint: disable=broad-except
      log.info("sampler %s: its address cannot be resolved now (%r)", self.name, e)
      return None

  def moved(self) -> bool:
    """Whether `resolve` now gives another address than the one in use."""
    url = self._resolved()
    return url is not None and url != self.base_url

  def refresh(self) -> None:
    """Follows the server to the address `resolve` gives now (no-op without `resolve`)."""
    url = self._resolved()
    if url is not None and url != self.base_url:
      log.warning("sampler %s moved from %s to %s", self.name, self.base_url, url)
      self._connect(url)

  def _get(self, path: str, timeout: float) -> bytes:
    """GET /health or /metrics; SamplerDown on anything but a 200."""
    try:
      with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
        return r.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
      raise SamplerDown(f"{self.name}: {path}: {e!r}") from e

  def _complete(self, prompt_ids, params: SamplingParams, timeout) -> list:
    extra = {"stop_token_ids": list(params.stop_token_ids), "return_routing": True,
             "return_prompt_routing": True}
    if timeout is not None:
      extra["timeout"] = timeout
    try:
      return self.client.complete(
          prompt_ids, max_tokens=params.max_tokens, stop=params.stop,
          temperature=params.temperature, top_p=params.top_p, seed=params.seed, n=params.n,
          extra=extra, timeout_s=None if timeout is None else timeout + 30)
    except (openai_policy.ServerRejected, openai_policy.MissingField) as e:
      raise RequestRejected(f"{self.name}: {e}") from e
    except openai_policy.ServerUnavailable as e:
      raise SamplerDown(f"{self.name}: {e}") from e
    except openai_policy.MalformedResponse as e:  # a broken answer: this server is at fault
      raise SamplerDown(f"{self.name}: {e}") from e

  def submit(self, prompt_ids, params: SamplingParams, timeout: Optional[float] = None):
    return self._executor.submit(self._complete, [int(t) for t in prompt_ids], params, timeout)

  def version(self) -> int:
    for line in self._get("/metrics", 5).decode().splitlines():
      if line.startswith("rollout_policy_version"):
        return int(float(line.split()[-1]))
    raise SamplerDown(f"{self.name}: /metrics has no policy_version")

  def alive(self) -> bool:
    self.refresh()
    try:
      self._get("/health", 5)
      return True
    except SamplerDown:
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
    otherwise its next probe waits twice as long (up to `max_probe_backoff_s`). A sampler
    found by name that now resolves to another address (`HttpSampler.moved`) is probed at
    once.
    """
    if not self._probing.acquire(blocking=False):
      return []  # another thread is probing; one prober is enough
    try:
      now = self._clock()
      with self._lock:
        dead = [s for s in self.samplers if id(s) in self._dead]
        due = [s for s in dead if self._probe_at[id(s)] <= now]
      # One that is back at another address (placed again on another node) is probed now,
      # whatever its back-off, which starts over: the move says it has restarted.
      moved = [s for s in dead if getattr(s, "moved", lambda: False)()]
      due += [s for s in moved if s not in due]
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
          b = self.probe_backoff_s if s in moved else 2 * self._backoff[id(s)]
          b = self._backoff[id(s)] = min(b, self.max_probe_backoff_s)
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
