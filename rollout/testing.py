"""Shared fixtures for the tests of rollout and of its users: tiny configs and models, and a
live server (test-only helpers).

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
  127.0.0.1 port (public app only, no admin app), for tests that talk HTTP to a real sampler.

  Why one helper: the tests of the clients of the server (samplers, policies, /health users)
  all need the same start and stop, and both must be bounded: a start or a stop that does not
  finish in `timeout_s` raises TimeoutError naming it, instead of hanging the test. `close` is
  safe to call twice (a test may kill a server its fixture closes again) and does not stop the
  engine, which the caller owns.

  Attributes: `engine`, `server`, `port`, `url` ("http://127.0.0.1:<port>").
  """

  def __init__(self, engine, *, timeout_s: float = 60.0, **server_kw):
    """`server_kw` goes to `rollout.server.Server` (model_name, request_timeout, health_checks,
    admin_token, ...)."""
    self.engine = engine
    self.timeout_s = timeout_s
    self.server = server_lib.Server(engine, **server_kw)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                    name="rollout-live-server")
    self._thread.start()
    self._closed = False
    try:
      self.port, _ = self._run(self.server.start("127.0.0.1", 0, None),
                               "the rollout server to start listening")
    except BaseException:
      self._stop_loop()
      raise
    self.url = f"http://127.0.0.1:{self.port}"

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
