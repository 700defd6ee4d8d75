"""Tests for the local fleet: a burst of 100 episodes with bounded sandboxes, job failures."""

import sys

import pytest

from envs import fleet
from envs import inprocess_policy
from envs import metrics
from envs import suite_pyfunc
from envs import testing
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def _boom(host, payload):
  raise RuntimeError(f"bad job {payload}")


def test_burst_of_100_sandbox_jobs_bounded():
  jobs = [fleet.Job(f"j{i}", fleet.sandbox_job,
                    {"files": {"m.py": f"print({i} * 2)"}, "command": ["python3", "m.py"]})
          for i in range(100)]
  jobs.append(fleet.Job("bad", _boom, 7))
  with fleet.LocalFleet(pool_size=2, concurrency=4, max_live=6) as f:
    results = f.run(jobs)
    assert f.pool.stats["peak_live"] <= 6
  assert len(results) == 101
  for i in range(100):
    r = results[f"j{i}"]
    assert r.error is None and r.value["stdout"] == f"{i * 2}\n"
  assert "bad job 7" in results["bad"].error


def test_single_turn_episodes_over_the_fleet():
  ts = suite_pyfunc.generate()[:12]
  gen = testing.scripted_generate(["    return 0\n"])
  pol = inprocess_policy.InProcessPolicy(gen, TOK)
  jobs = [fleet.Job(t.task_id, fleet.single_turn_job, {"task": t, "policy": pol, "n": 2})
          for t in ts]
  with fleet.LocalFleet(pool_size=2, concurrency=3) as f:
    results = f.run(jobs)
  trajs = [tr for r in results.values() for tr in r.value]
  assert len(trajs) == 24
  m = metrics.summarize(trajs)
  assert m["infra_failures"] == 0 and m["episodes"] == 24


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
