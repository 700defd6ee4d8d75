"""Samplers that read the weights through relays, as separate processes (#20): an origin relay
over the store, a cluster relay pulling from it, one sampler through the cluster relay only and
one through it and then the origin. The cluster relay is killed mid-run: the first sampler keeps
serving the version it holds (its /health says weight sync fails) and catches up once the relay
is back; the second fails over to the origin and never falls behind."""

import json
import os
import signal
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from pipeline import local
from pipeline import processes
from pipeline import testing
from testlib import waiting

PRELUDE = """
import logging
logging.basicConfig(level=logging.WARNING)
from pipeline import processes
"""
START_S = 300  # a sampler process builds its engine (JAX) on a loaded 2-core machine
MOVE_S = 60  # a version reaching a sampler, a relay coming up


def _health(url: str) -> tuple[int, dict]:
  """(HTTP status, JSON body) of a sampler's /health (503 is an answer, not an error)."""
  try:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _answers(url: str) -> bool:
  try:
    with urllib.request.urlopen(url + "/o/INDEX.json", timeout=5) as r:
      return r.status == 200
  except OSError:
    return False


def _log(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()[-3000:]


def _versions(n: int) -> list:
  """n distinct weight versions of the tests' model: the learner's, then small steps."""
  flat, _ = testing.learner().sampler_weights()
  rng = np.random.default_rng(0)
  out = [flat]
  for _ in range(n - 1):
    out.append({k: (v + rng.normal(0, 1e-3, v.shape)).astype(v.dtype)
                for k, v in out[-1].items()})
  return out


def test_samplers_through_relays_hold_their_version_while_theirs_is_down(tmp_path):
  work = str(tmp_path / "work")
  channel = local.WeightChannel(processes.paths(work)["weights"], model_cfg=testing.MODEL)
  versions = _versions(3)
  channel.publish(versions[0], 0)
  ports = {n: testing.free_port() for n in ("origin", "cluster", "a", "b")}
  url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
  logs = {n: str(tmp_path / f"{n}.log") for n in ("origin", "cluster", "cluster2", "a", "b")}
  relay = {
      "origin": PRELUDE + f"processes.run_relay({work!r}, port={ports['origin']})",
      "cluster": PRELUDE + (f"processes.run_relay({work!r}, port={ports['cluster']}, "
                            f"upstream=[{url['origin']!r}])")}
  procs = {}
  try:
    for n in ("origin", "cluster"):
      procs[n] = testing.spawn(relay[n], logs[n])
      waiting.wait_until(lambda n=n: _answers(url[n]), lambda n=n: f"relay {n}: {_log(logs[n])}",
                         timeout_s=MOVE_S)
    via = {"a": [url["cluster"]], "b": [url["cluster"], url["origin"]]}
    for n in ("a", "b"):
      procs[n] = testing.spawn(PRELUDE + f"""
processes.run_sampler({work!r}, port={ports[n]}, max_slots=8, max_len=128, stale_versions=0,
                      stale_s=1.0, weight_urls={via[n]!r})
""", logs[n])
    for n in ("a", "b"):
      testing.wait_http(url[n], procs[n], logs[n], timeout=START_S)

    def serving(n, version, healthy=True):
      code, body = _health(url[n])
      return body["policy_version"] == version and (code == 200) == healthy

    channel.publish(versions[1], 1)
    for n in ("a", "b"):
      waiting.wait_until(lambda n=n: serving(n, 1), f"sampler {n} serving version 1",
                         timeout_s=MOVE_S)

    os.killpg(procs["cluster"].pid, signal.SIGKILL)  # the cluster's relay dies mid-run
    procs["cluster"].wait(timeout=MOVE_S)
    channel.publish(versions[2], 2)
    # b fails over to the origin; a, whose only relay is down, keeps serving version 1 and
    # says that its weight sync fails.
    waiting.wait_until(lambda: serving("b", 2), "sampler b serving version 2 via the origin",
                       timeout_s=MOVE_S)
    waiting.wait_until(lambda: serving("a", 1, healthy=False),
                       lambda: f"sampler a unhealthy on version 1: {_health(url['a'])}",
                       timeout_s=MOVE_S)
    code, body = _health(url["a"])
    assert code == 503 and any("weight sync" in p for p in body["problems"]), body

    procs["cluster2"] = testing.spawn(relay["cluster"], logs["cluster2"])  # back, same port
    waiting.wait_until(lambda: serving("a", 2), lambda: f"sampler a back on version 2: "
                       f"{_health(url['a'])}\n{_log(logs['a'])}", timeout_s=MOVE_S)
    assert serving("b", 2)
  finally:
    for p in procs.values():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    channel.publisher.close()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
