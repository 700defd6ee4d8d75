"""GradeCache: repeated attempts reuse the real grade; infrastructure failures are never kept."""

import sys
import threading

import pytest

from envs import reward as reward_lib
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc
from pipeline import controller
from pipeline import testing
from pipeline.grade_cache import GradeCache


class _Counting:
  def __init__(self, fn):
    self.fn = fn
    self.calls = 0

  def __call__(self, *args):
    self.calls += 1
    return self.fn(*args)


def _files(task, body):
  return dict(task.files, **{"solution.py": task.prompt + body})


def test_repeats_reuse_the_sandbox_grade():
  task = suite_pyfunc.split(suite_pyfunc.generate(), "train")[0]
  cfg = reward_lib.RewardConfig()
  with pool_lib.WarmPool(size=1) as pool:
    real = _Counting(lambda t, f, p, c: reward_lib.grade(t, f, pool=p, config=c))
    cache = GradeCache(real)
    good, bad = _files(task, task.solution), _files(task, "    return None\n")
    first = cache(task, good, pool, cfg)
    assert first.status == reward_lib.OK and first.reward == 1.0
    again = cache(task, dict(good), pool, cfg)
    assert again is first and real.calls == 1
    wrong = cache(task, bad, pool, cfg)
    assert wrong.reward == 0.0 and real.calls == 2
    assert cache(task, bad, pool, cfg).reward == 0.0 and real.calls == 2
    assert (cache.hits, cache.misses) == (2, 2)


def test_infra_failures_are_graded_again_and_entries_are_bounded():
  task = suite_pyfunc.split(suite_pyfunc.generate(), "train")[0]
  outcomes = [reward_lib.Grade(reward_lib.INFRA_ERROR, None, None, {}, {}, "host lost"),
              reward_lib.Grade(reward_lib.OK, 1.0, 1.0, {}, {}, "ok")]
  fake = _Counting(lambda t, f, p, c: outcomes[min(fake.calls - 1, 1)])
  cache = GradeCache(fake, max_entries=2)
  files = _files(task, task.solution)
  assert cache(task, files, None, None).status == reward_lib.INFRA_ERROR
  assert cache(task, files, None, None).status == reward_lib.OK and fake.calls == 2
  assert cache(task, files, None, None).status == reward_lib.OK and fake.calls == 2
  for body in ("    return 1\n", "    return 2\n"):  # two more entries evict the first
    cache(task, _files(task, body), None, None)
  cache(task, files, None, None)
  assert fake.calls == 5


def test_threads_share_the_cache():
  task = suite_pyfunc.split(suite_pyfunc.generate(), "train")[0]
  ok = reward_lib.Grade(reward_lib.OK, 1.0, 1.0, {}, {}, "ok")
  fake = _Counting(lambda t, f, p, c: ok)
  cache = GradeCache(fake)
  files = _files(task, task.solution)
  cache(task, files, None, None)
  threads = [threading.Thread(target=cache, args=(task, files, None, None)) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert fake.calls == 1 and cache.hits == 8


@pytest.mark.parametrize("enabled", [True, False])
def test_controller_grades_through_the_cache_when_configured(enabled):
  tasks = testing.tasks(2)
  ok = reward_lib.Grade(reward_lib.OK, 1.0, 1.0, {}, {}, "ok")
  fake = _Counting(lambda t, f, p, c: ok)
  ctrl = controller.RolloutController(tasks, None, None, lambda eps: None, grade_fn=fake,
                                      config=testing.config(grade_cache=enabled))
  files = _files(tasks[0], tasks[0].solution)
  for _ in range(3):
    assert ctrl.grade_fn(tasks[0], files, None, None) is ok
  assert fake.calls == (1 if enabled else 3)
  assert (ctrl.grade_cache is not None) == enabled


def test_bad_size_is_an_error():
  with pytest.raises(ValueError, match="max_entries"):
    GradeCache(lambda *a: None, max_entries=0)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
