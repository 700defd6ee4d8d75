import sys

import pytest

from pipeline import resources


def test_split_a_third_for_inference():
  s = resources.split_devices(list(range(12)), 1 / 3)
  assert s.sampler_devices == (0, 1, 2, 3) and s.learner_devices == tuple(range(4, 12))
  assert not s.shared
  # Never starves either side.
  s = resources.split_devices([0, 1], 0.05)
  assert s.sampler_devices == (0,) and s.learner_devices == (1,)
  s = resources.split_devices([0, 1], 0.95)
  assert s.sampler_devices == (0,) and s.learner_devices == (1,)


def test_one_device_is_shared():
  s = resources.split_devices(["cpu0"], 1 / 3)
  assert s.shared and s.sampler_devices == ("cpu0",) == s.learner_devices


def test_assign_and_env():
  assert resources.assign([5, 6], 3) == [5, 6, 5]
  assert resources.process_env([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
  assert resources.process_env([0, 1], "cpu")["XLA_FLAGS"].endswith("=2")
  with pytest.raises(ValueError):
    resources.split_devices([0, 1], 0.0)
  with pytest.raises(ValueError):
    resources.assign([], 1)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
