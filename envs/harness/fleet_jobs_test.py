"""Tests for the episode jobs: a burst of single-turn episodes over the local fleet."""

import sys

import pytest

from envs import metrics
from envs.harness import fleet_jobs
from envs.harness import inprocess_policy
from envs.harness import scripted_sampler
from envs.sandbox import fleet
from envs.tasks import suite_pyfunc
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def test_single_turn_episodes_over_the_fleet():
  ts = suite_pyfunc.generate()[:12]
  gen = scripted_sampler.scripted_generate(["    return 0\n"])
  pol = inprocess_policy.InProcessPolicy(gen, TOK)
  jobs = [fleet.Job(t.task_id, fleet_jobs.single_turn_job, {"task": t, "policy": pol, "n": 2})
          for t in ts]
  with fleet.LocalFleet(pool_size=2, concurrency=3) as f:
    results = f.run(jobs)
  trajs = [tr for r in results.values() for tr in r.value]
  assert len(trajs) == 24
  m = metrics.summarize(trajs)
  assert m["infra_failures"] == 0 and m["episodes"] == 24


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
