"""Tests for testlib.waiting: the waits return as soon as they can and fail loudly at the deadline."""

import os
import subprocess
import sys
import threading
import time

import pytest

from testlib import waiting


def test_wait_until_returns_the_first_truthy_value():
  calls = []

  def cond():
    calls.append(1)
    return len(calls) >= 3 and "done"

  assert waiting.wait_until(cond, "three calls", poll_s=0.001) == "done"
  assert len(calls) == 3


def test_wait_until_raises_naming_what_it_waited_for_and_the_state_left():
  state = {"n": 0}
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match=r"waited 0.05s for the counter \(n=0\)"):
    waiting.wait_until(lambda: state["n"], lambda: f"the counter (n={state['n']})",
                       timeout_s=0.05)
  assert time.monotonic() - t0 >= 0.05  # it waited its full time first


def test_wait_event():
  ev = threading.Event()
  threading.Timer(0.01, ev.set).start()
  waiting.wait_event(ev, "the timer")
  with pytest.raises(TimeoutError, match="never set"):
    waiting.wait_event(threading.Event(), "an event never set", timeout_s=0.01)


def test_pid_alive_counts_a_zombie_as_exited():
  proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE)
  assert waiting.pid_alive(proc.pid) and waiting.pid_alive(os.getpid())
  with pytest.raises(TimeoutError, match=rf"still alive: \[{proc.pid}\]"):
    waiting.wait_exited([proc.pid], timeout_s=0.05)
  proc.stdin.close()  # it exits; unreaped, it stays a zombie until wait()
  waiting.wait_exited([proc.pid])
  assert proc.poll() == 0
  assert not waiting.pid_alive(proc.pid)  # reaped: gone from /proc


def test_url_answers_only_a_success_status():
  import http.server  # pylint: disable=g-import-not-at-top

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # pylint: disable=invalid-name
      self.send_response(200 if self.path == "/health" else 503)
      self.end_headers()

    def log_message(self, *args):
      pass

  server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_port}"
  try:
    assert waiting.url_answers(url + "/health")
    assert not waiting.url_answers(url + "/busy")
  finally:
    server.shutdown()
    server.server_close()
  assert not waiting.url_answers(url + "/health")  # nothing listens any more


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
