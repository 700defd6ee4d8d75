"""Tests for the pipeline simulator on cases small enough to work out by hand.

Tolerance policy: the simulator is exact arithmetic on event times apart from float rounding of
the per-sampler token clock, so hand-computed times are compared with pytest.approx at its
default relative 1e-6; orderings (monotonicity) are compared with a 1e-9 relative slack.
"""

import math
import sys

import numpy as np
import pytest

from pipeline import simulator as sm


def _w(prompts=1, attempts=1, length=100, p99=None, **kw):
  return sm.Workload(prompts, attempts, kw.pop("prompt_tokens", 0), length, p99 or length,
                     kw.pop("max_tokens", max(length, p99 or length)), **kw)


def _run(w=None, *, samplers=1, slots=1, step_s=0.01, per_seq=0.0, prefill=0.0, train=2.0,
         per_token=0.0, sync_s=0.5, pause=0.0, steps=5, k=0, **kw):
  inf = sm.InferencePool(samplers, slots, step_s, per_seq, prefill)
  return sm.simulate(w or _w(), inf, sm.TrainingPool(train, per_token),
                     sm.WeightSync.constant(samplers, sync_s, pause), steps=steps,
                     max_staleness=k, **kw)


def test_sync_is_the_sum_of_the_phases():
  # G = 100 tokens x 0.01 s = 1 s, T = 2 s, Y = 0.5 s: S * (G + T + Y).
  r = _run()
  assert r.wall_s == pytest.approx(5 * 3.5)
  assert r.staleness_max == 0 and r.swapped_midflight_frac == 0 and r.dropped_groups == 0
  assert r.train_busy_frac == pytest.approx(10 / 17.5)
  assert r.inference_idle_frac == pytest.approx(1 - 5 / 17.5)
  assert r.shares["weight sync"] == pytest.approx(2.5 / 17.5)
  assert r.bottleneck == "training"
  assert r.served_at == pytest.approx([3.5 * (v + 1) for v in range(5)])
  assert r.mid_step_s == pytest.approx(3.5)
  assert r.mid_shares["training"] == pytest.approx(2 / 3.5)


def test_sync_phases_with_prefill_env_turns_and_tokens():
  # Two turns of 50 tokens: prefill 10 prompt tokens (0.1 s), 50 steps (0.5 s), env 0.3 s,
  # prefill 4 tool tokens (0.04 s), 50 steps (0.5 s), env 0.3 s = 1.74 s; the learner trains on
  # 10 + 4 + 100 = 114 tokens: 1 + 114 * 0.01 = 2.14 s; sync 0.5 s.
  w = _w(length=100, prompt_tokens=10, turns=2, obs_tokens=4, env_median_s=0.3, env_p99_s=0.3)
  r = _run(w, prefill=0.01, train=1.0, per_token=0.01, steps=3)
  assert r.wall_s == pytest.approx(3 * (1.74 + 2.14 + 0.5))


def test_sync_attempts_share_slots_and_step_time_grows_with_occupancy():
  # 4 attempts, 2 slots: two rounds of 100 steps at 0.01 + 2 * 0.001 s.
  r = _run(_w(attempts=4), slots=2, per_seq=0.001, steps=2)
  assert r.wall_s == pytest.approx(2 * (2 * 100 * 0.012 + 2.0 + 0.5))
  assert r.slot_occupancy == pytest.approx(2 * 2.4 / r.wall_s)  # 2 slots full 2 x 2.4 s


def test_env_workers_queue():
  # 2 attempts on 2 slots finish together; one env worker runs their 0.3 s tests in turn.
  w = _w(attempts=2, env_median_s=0.3, env_p99_s=0.3)
  assert _run(w, slots=2, steps=2).wall_s == pytest.approx(2 * (1 + 0.3 + 2.5))
  assert _run(w, slots=2, steps=2, env_workers=1).wall_s == pytest.approx(2 * (1 + 0.6 + 2.5))


def test_async_overlaps_training_bound():
  # k=1, T > G: G (first batch) + S * T + Y (last sync); sync would be S * (G + T + Y).
  r = _run(k=1)
  assert r.wall_s == pytest.approx(1 + 5 * 2 + 0.5)
  assert r.mid_step_s == pytest.approx(2.0)  # versions 1..3 are served T apart
  assert r.mid_shares["training"] == pytest.approx(1.0)
  assert r.bottleneck == "training" and r.binding_utilisation == pytest.approx(1.0)
  assert r.staleness_max == 1


def test_async_overlaps_inference_bound():
  # k=1, G = 1 > T + Y = 0.8: S * G + T + Y.
  r = _run(train=0.3, k=1)
  assert r.wall_s == pytest.approx(5 * 1 + 0.3 + 0.5)
  assert _run(train=0.3, k=0).wall_s == pytest.approx(5 * 1.8)
  assert r.bottleneck == "long tail"  # one slot, nothing queued: waiting on the one episode


def test_queued_work_is_inference_bound():
  r = _run(_w(prompts=4), train=0.3, k=2, steps=4)
  assert r.bottleneck == "inference"
  assert r.slot_occupancy > 0.9


def test_slow_sync_is_sync_bound():
  r = _run(train=0.1, sync_s=5.0, k=1)
  assert r.bottleneck == "weight sync"


def test_pause_costs_async_not_sync():
  # Synchronously the pause is inside the sync time; asynchronously it stalls decoding.
  assert _run(pause=0.4).wall_s == pytest.approx(_run(pause=0.0).wall_s)
  w = _w(prompts=3, length=100, p99=800)
  fast = _run(w, slots=2, train=0.3, k=2, pause=0.0)
  slow = _run(w, slots=2, train=0.3, k=2, pause=0.4)
  assert slow.wall_s > fast.wall_s
  assert slow.swapped_midflight_frac > 0


def test_shared_compute_stalls_sampler():
  assert _run(shared_compute=True).wall_s == pytest.approx(_run().wall_s)
  assert _run(k=1, shared_compute=True).wall_s > _run(k=1).wall_s


_TAIL = dict(prompts=4, attempts=4, length=50, p99=600, env_median_s=0.2, env_p99_s=2.0)


@pytest.mark.parametrize("consume", ["release", "completion"])
def test_staleness_bounded_and_more_staleness_never_slower(consume):
  for seed in range(3):
    walls = []
    for k in range(6):
      r = _run(_w(**_TAIL), slots=4, train=0.5, per_token=1e-3, steps=8, k=k, seed=seed,
               consume=consume)
      assert r.staleness_max <= k
      walls.append(r.wall_s)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(walls, walls[1:])), walls
    assert walls[-1] < walls[0] / 1.5


def test_release_order_loses_nothing_completion_order_drops_stragglers():
  kw = dict(slots=4, train=0.5, per_token=1e-3, steps=8, k=1)
  rel = _run(_w(**_TAIL), consume="release", **kw)
  comp = _run(_w(**_TAIL), consume="completion", **kw)
  assert rel.dropped_groups == 0 and rel.wasted_token_frac == 0
  assert comp.dropped_groups > 0 and 0 < comp.wasted_token_frac < 1


def test_more_slots_never_slower_when_inference_bound():
  walls = [_run(_w(**_TAIL), slots=s, train=0.1, steps=6, k=2).wall_s for s in (1, 2, 4, 8, 16)]
  assert all(b <= a * (1 + 1e-9) for a, b in zip(walls, walls[1:])), walls
  assert walls[-1] < walls[0] / 4


def test_deterministic_with_seed():
  a = _run(_w(**_TAIL), slots=4, k=2, seed=7)
  b = _run(_w(**_TAIL), slots=4, k=2, seed=7)
  c = _run(_w(**_TAIL), slots=4, k=2, seed=8)
  assert a == b
  assert a.wall_s != c.wall_s


def test_draws_match_median_p99_and_clip():
  w = _w(attempts=16, length=400, p99=3200, max_tokens=6000, env_median_s=2.0, env_p99_s=20.0,
         turns=2)
  draws = [sm.draw_group(w, 0, g) for g in range(500)]
  lengths = np.concatenate([d[0] for d in draws])
  envs = np.concatenate([d[1].ravel() for d in draws])
  # 8,000 draws: the sample median and p99 are within a few percent (5% and 15% allowed).
  assert np.median(lengths) == pytest.approx(400, rel=0.05)
  assert np.quantile(lengths, 0.99) == pytest.approx(3200, rel=0.15)
  assert lengths.max() <= 6000 and lengths.min() >= 2
  assert np.median(envs) == pytest.approx(2.0, rel=0.05)
  np.testing.assert_array_equal(sm.draw_group(w, 0, 3)[0], draws[3][0])
  assert not np.array_equal(sm.draw_group(w, 1, 3)[0], draws[3][0])


def test_hardware_training_pool():
  tp = sm.TrainingPool.from_hardware(10, 1e9, 1e15, 0.5)
  assert tp.step_time(1000) == pytest.approx(1000 * 6e9 / 5e15)
  assert sm.InferencePool(2, 4, 0.01, 0.0025).tokens_per_s() == pytest.approx(2 * 4 / 0.02)


@pytest.mark.parametrize("bad, match", [
    (dict(slots=0), "slots"),
    (dict(k=-1), "max_staleness"),
    (dict(steps=0), "steps"),
    (dict(step_s=0.0), "step_s"),
    (dict(consume="random"), "consume"),
    (dict(env_workers=-1), "env_workers"),
])
def test_bad_parameters_raise(bad, match):
  with pytest.raises(ValueError, match=match):
    _run(**bad)


def test_bad_workload_and_sync_raise():
  with pytest.raises(ValueError, match="response_p99"):
    _run(_w(length=100, p99=50))
  with pytest.raises(ValueError, match="attempts"):
    _run(_w(attempts=0))
  with pytest.raises(ValueError, match="env_p99_s"):
    _run(_w(env_median_s=2.0, env_p99_s=1.0))
  with pytest.raises(ValueError, match="pause_s"):
    sm.WeightSync.constant(1, 0.5, 1.0)
  with pytest.raises(ValueError, match="entries"):
    sm.simulate(_w(), sm.InferencePool(2, 1, 0.01), sm.TrainingPool(1.0),
                sm.WeightSync.constant(1, 0.5), steps=1, max_staleness=0)
  with pytest.raises(ValueError, match="mfu"):
    sm.TrainingPool.from_hardware(1, 1e9, 1e15, 1.5)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
