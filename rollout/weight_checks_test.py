"""The weight checks refuse non-finite and wildly mis-scaled weights and pass real updates."""

import sys
import time

import numpy as np
import pytest

from moe import params as moe_params
from rollout import testing
from rollout import weight_checks


@pytest.fixture(scope="module")
def served():
  model = testing.tiny_model(seed=5, router_type="sigmoid")
  flat = moe_params.flatten(model)
  return model.config, {k: np.asarray(v) for k, v in flat.items()}


def test_the_served_weights_and_small_updates_pass(served):
  cfg, flat = served
  ref = weight_checks.rms(flat)
  rng = np.random.default_rng(0)
  for new in (flat,
              {k: (v * np.float32(1.01)).astype(v.dtype) for k, v in flat.items()},
              # an RL-sized step: each weight moves by about a learning rate
              {k: v + 1e-5 * rng.standard_normal(v.shape).astype(v.dtype)
               for k, v in flat.items()},
              # another fine-tune: every tensor 5x larger or smaller (still far inside 100x)
              {k: v * np.float32(5.0 if i % 2 else 0.2) for i, (k, v) in enumerate(flat.items())}):
    got = weight_checks.check(new, cfg, ref)
    assert set(got) == set(flat)
  # A zero-initialised tensor (the sigmoid router's bias) has no scale to compare with: it may
  # take any value of a sane absolute size.
  bias = next(k for k in flat if k.endswith("router/bias"))
  assert ref[bias] == 0.0
  weight_checks.check({**flat, bias: np.full_like(flat[bias], 0.3)}, cfg, ref)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_naming_the_tensor(served, value):
  cfg, flat = served
  bad = dict(flat)
  bad["layers/1/attn/v"] = flat["layers/1/attn/v"].copy()
  bad["layers/1/attn/v"][3, 1, 2] = value
  with pytest.raises(ValueError, match=r"layers/1/attn/v holds 1 non-finite.*\(3, 1, 2\)"):
    weight_checks.check(bad, cfg, weight_checks.rms(flat))
  with pytest.raises(ValueError, match="non-finite"):  # with no reference too
    weight_checks.check(bad, cfg)


def test_random_weights_of_a_wrong_scale_are_refused(served):
  cfg, flat = served
  ref = weight_checks.rms(flat)
  rng = np.random.default_rng(1)
  big = {k: rng.standard_normal(v.shape).astype(np.float32) * 1e3 for k, v in flat.items()}
  with pytest.raises(ValueError, match=r"RMS .*x the served"):
    weight_checks.check(big, cfg, ref)
  with pytest.raises(ValueError, match="above 100"):  # no reference: the absolute bound
    weight_checks.check(big, cfg)
  tiny = dict(flat)
  tiny["embed"] = flat["embed"] * np.float32(1e-3)
  with pytest.raises(ValueError, match=r"weight embed has RMS .*0\.001x the served"):
    weight_checks.check(tiny, cfg, ref)
  huge = dict(flat)
  huge["final_norm/scale"] = np.full_like(flat["final_norm/scale"], 1e30)  # squares overflow
  with pytest.raises(ValueError, match="final_norm/scale has values of magnitude up to 1e"):
    weight_checks.check(huge, cfg, ref)


def test_bad_served_weights_do_not_block_the_swap_that_replaces_them(served):
  cfg, flat = served
  nan = {k: np.full_like(v, np.nan) for k, v in flat.items()}
  ref = weight_checks.rms(nan)
  assert all(r is None for r in ref.values())
  weight_checks.check(flat, cfg, ref)


def test_names_and_shapes_are_checked_first(served):
  cfg, flat = served
  with pytest.raises(ValueError, match="embed has shape"):
    weight_checks.check({**flat, "embed": np.zeros((3, 3), np.float32)}, cfg)


def test_a_100m_parameter_check_takes_about_a_second_at_most():
  """One pass per tensor: bounded generously for a loaded 2-core machine (measured ~0.04 s)."""
  rng = np.random.default_rng(2)
  flat = {f"t{i}": rng.standard_normal(10_000_000, dtype=np.float32) * 0.02 for i in range(10)}
  ref = weight_checks.rms(flat)
  t0 = time.perf_counter()
  for name, v in flat.items():
    weight_checks._tensor_rms(name, v)  # pylint: disable=protected-access
  elapsed = time.perf_counter() - t0
  print(f"100M float32 parameters: {elapsed:.3f} s")
  assert elapsed < 10.0
  assert all(abs(r - 0.02) < 1e-4 for r in ref.values())


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
