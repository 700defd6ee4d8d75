"""The end-to-end tests' training checks catch runs that trained nothing (they have teeth)."""

import sys

import numpy as np
import pytest

from rl import testing


def _steps(n=2, **override):
  """Records of a run that trained: 4 episodes, 40 tokens per step, versions 1..n."""
  recs = [{"loss": 0.25, "grad_norm": 0.5, "tokens": 40.0, "trained_episodes": 4, "policy_version": i + 1}
          for i in range(n)]
  for r in recs:
    r.update(override)
  return recs


def test_a_run_that_trained_passes():
  testing.assert_steps_trained(_steps(), steps=2, episodes_per_step=4)
  testing.assert_steps_trained(_steps(), steps=2)  # count unknown: > 0 suffices
  testing.assert_steps_trained([dict(r, policy_version=r["policy_version"] + 5)
                                for r in _steps()], steps=2, start_version=5)
  no_episodes = [{k: v for k, v in r.items() if k != "trained_episodes"} for r in _steps()]
  testing.assert_steps_trained(no_episodes, steps=2, episodic=False)
  # An on-policy GRPO loss is ~0 by construction; the gradient is what must be non-zero.
  testing.assert_steps_trained(_steps(loss=0.0), steps=2)


def test_a_run_whose_requests_were_all_refused_fails():
  # What such a run logs: every step ran, the policy version advanced, the auxiliary loss is
  # non-zero, but no episode or token was trained.
  refused = _steps(trained_episodes=0, tokens=0.0, loss=0.013, grad_norm=0.02)
  with pytest.raises(AssertionError) as e:
    testing.assert_steps_trained(refused, steps=2, episodes_per_step=4)
  msg = str(e.value)
  assert "step 1: 0 trained_episodes" in msg and "step 2: 0 trained_episodes" in msg
  assert "step 1: 0.0 trained tokens" in msg


@pytest.mark.parametrize("records, kw, message", [
    (_steps(grad_norm=0.0), {}, "grad_norm 0.0"),
    (_steps(grad_norm=float("nan")), {}, "grad_norm nan"),
    ([{k: v for k, v in r.items() if k != "grad_norm"} for r in _steps()], {}, "grad_norm None"),
    (_steps(loss=float("nan")), {}, "loss nan"),
    (_steps(loss=float("inf")), {}, "loss inf"),
    (_steps(trained_episodes=3), {"episodes_per_step": 4}, "3 trained_episodes, 4 expected"),
    (_steps(policy_version=1), {}, "step 2: policy_version 1, 2 expected"),
    (_steps(), {"start_version": 1}, "step 1: policy_version 1, 2 expected"),
    (_steps(1), {}, "1 learner steps recorded, 2 expected"),
    ([], {}, "0 learner steps recorded"),
    ([{"loss": 0.3, "grad_norm": 0.1, "tokens": 5.0, "policy_version": 1}] * 2, {},
     "step 1: 0 trained_episodes"),  # an RL record without the count is not proof
])
def test_each_missing_sign_of_training_fails(records, kw, message):
  kw = dict({"steps": 2}, **kw)
  assert any(message in p for p in testing.step_problems(records, **kw)), (
      testing.step_problems(records, **kw))
  with pytest.raises(AssertionError, match="did not train"):
    testing.assert_steps_trained(records, **kw)


def test_weights_must_change_and_stay_finite():
  rng = np.random.default_rng(0)
  initial = {"a": rng.normal(size=(3, 4)).astype(np.float32),
             "b": rng.normal(size=(5,)).astype(np.float32)}
  moved = dict(initial, b=initial["b"] + np.float32(1e-3))
  testing.assert_weights_changed(initial, moved)
  with pytest.raises(AssertionError, match="none of the 2 weight arrays changed"):
    testing.assert_weights_changed(initial, {k: v.copy() for k, v in initial.items()})
  with pytest.raises(AssertionError, match="b: non-finite"):
    testing.assert_weights_changed(initial, dict(moved, b=np.full(5, np.nan, np.float32)))
  with pytest.raises(AssertionError, match="a: shape"):
    testing.assert_weights_changed(initial, dict(moved, a=initial["a"].T))
  with pytest.raises(AssertionError, match="names differ"):
    testing.assert_weights_changed(initial, {"a": initial["a"] + 1})


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
