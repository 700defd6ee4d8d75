"""Tests for the local fleet: a burst of 100 sandbox jobs with bounded sandboxes, job failures."""

import sys

import pytest

from envs.sandbox import fleet


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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
