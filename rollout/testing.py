"""Shared fixtures for the tests of rollout and of its users: tiny configs and models, a live
server, and a hold on the engine's decode calls (test-only helpers).

Tolerance policy (float32 everywhere in these tests): the sampler and the model compute the same
formulas with different matmul shapes, so results differ by float32 rounding only (observed
<= 1e-6 on log-probabilities of these tiny models). Comparisons use atol 1e-5 on logits and
log-probabilities -- ten times the observed gap, far below any real bug (a wrong mask, norm, or
expert changes log-probabilities by >= 1e-2). Token and routing comparisons are exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from moe import build
from moe.config import ModelConfig
from rollout import server as server_lib

ATOL = 1e-5


def tiny_config(**kw) -> ModelConfig:
  base = dict(vocab_size=259, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
              max_seq_len=64, init_std=0.2)
  base.update(kw)
  return ModelConfig(**base)


def tiny_model(seed: int = 0, **kw):
  return build.create(tiny_config(**kw), seed=seed)


class LiveServer:
  """A `rollout.server.Server` over `engine`, served from its own event-loop thread on a free
  127.0.0.1 port, and with `admin=True` its admin app too, on a second free port, for tests that
  talk HTTP to a real sampler.

  Why one helper: the tests of the server and of its clients (samplers, policies, /health users,
  the admin app's tests) all need the same start and stop, and both must be bounded: a start or a
  stop that does not finish in `timeout_s` raises TimeoutError naming it, instead of hanging the
  test. `close` is safe to call twice (a test may kill a server its fixture closes again) and
  does not stop the engine, which the caller owns.

  Attributes: `engine`, `server`, `port`, `url` ("http://127.0.0.1:<port>"); with the admin app
  also `admin_port`, `admin_url` and `admin_token` (the one given as `admin_token=`, or the one
  the server generated), else these are None.
  """

  def __init__(self, engine, *, admin: bool = False, admin_host: str = "127.0.0.1",
               timeout_s: float = 60.0, **server_kw):
    """`admin_host`: where the admin app listens (as `Server.start` takes it; "0.0.0.0" for a
    test of the Host check on all interfaces). `server_kw` goes to `rollout.server.Server`
    (model_name, request_timeout, health_checks, admin_token, admin_token_file,
    checkpoint_root, ...)."""
    self.engine = engine
    self.timeout_s = timeout_s
    self.server = server_lib.Server(engine, **server_kw)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                    name="rollout-live-server")
    self._thread.start()
    self._closed = False
    try:
      self.port, self.admin_port = self._run(
          self.server.start("127.0.0.1", 0, 0 if admin else None, admin_host),
          "the rollout server to start listening")
    except BaseException:
      # A start that failed half way (the admin port refused after the public app listens)
      # leaves runners behind: they are cleaned up, bounded, before the loop goes; the start's
      # own error is the one raised.
      try:
        self._run(self.server.stop(), "the rollout server to stop after a failed start")
      except Exception:  # noqa: BLE001 -- the start's error above is the one to report
        pass
      finally:
        self._stop_loop()
      raise
    self.url = f"http://127.0.0.1:{self.port}"
    self.admin_url = self.admin_token = None
    if admin:
      # An admin app on all interfaces is reached over loopback like one bound to it.
      connect = "127.0.0.1" if admin_host in ("", "0.0.0.0", "::") else admin_host
      self.admin_url = f"http://{connect}:{self.admin_port}"
      self.admin_token = self.server.admin.token

  def admin_auth(self, **headers) -> dict:
    """`headers` with the admin app's `Authorization: Bearer <token>` added."""
    if self.admin_token is None:
      raise ValueError("this LiveServer serves no admin app: pass admin=True")
    return {"Authorization": f"Bearer {self.admin_token}", **headers}

  def _run(self, coro, what: str):
    """Runs `coro` on the server's loop; its result, or TimeoutError after `timeout_s`."""
    fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
    done, _ = concurrent.futures.wait([fut], timeout=self.timeout_s)
    if not done:
      fut.cancel()
      raise TimeoutError(f"waited {self.timeout_s:g}s for {what}")
    return fut.result()

  def _stop_loop(self) -> None:
    self._closed = True
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(self.timeout_s)
    if self._thread.is_alive():
      raise TimeoutError(f"waited {self.timeout_s:g}s for the rollout server's loop thread to stop")
    # What is left (a start cancelled at its timeout) is cancelled and run out, as asyncio.run
    # does, so that no task is destroyed pending.
    left = asyncio.all_tasks(self._loop)
    for task in left:
      task.cancel()
    if left:
      self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    self._loop.close()

  def close(self) -> None:
    """Stops listening (a request after this fails to connect) and ends the loop thread."""
    if self._closed:
      return
    try:
      self._run(self.server.stop(), "the rollout server to stop")
    finally:
      self._stop_loop()


def hold_decode(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
  """Once `engine` is idle, makes every decode call set `entered` and wait on `gate` (60 s at
  most) before it runs; returns (entered, gate).

  Why: a test that must observe a request while it runs (a streamed chunk before the request
  ends, a client that disconnects mid-request) cannot race the engine on a fast machine; with
  the engine held inside its first decode call the request cannot finish until the test sets
  `gate`. Waiting for idleness first makes that first held call the test's own request's.
  """
  from rollout import device_programs  # pylint: disable=g-import-not-at-top
  from testlib import waiting  # pylint: disable=g-import-not-at-top

  def idle():
    m = engine.metrics()
    return m["active_slots"] == 0 and m["queue_depth"] == 0

  waiting.wait_until(idle, "the engine to finish the earlier requests")
  entered, gate = threading.Event(), threading.Event()
  real = device_programs.decode_chunk

  def held(*a, **kw):
    entered.set()
    gate.wait(60)
    return real(*a, **kw)

  monkeypatch.setattr(device_programs, "decode_chunk", held)
  return entered, gate
