"""bench_async: run order, summary, decode fit, calibration, and one tiny end-to-end run.

Tolerance policy: closed-form arithmetic is compared with pytest.approx at its default relative
1e-6.
"""

import json
import sys

import pytest

from rl import testing as rl_testing
from tools import bench_async


def _run(mode, repeat, wall, **kw):
  base = dict(mode=mode, repeat=repeat, wall_s=wall, learner_idle_frac=0.5,
              sampler_idle_frac=0.4, slot_occupancy=0.1, mean_reward=0.5, max_lag=0)
  base.update(kw)
  return base


def test_run_order_alternates_and_balances_first_place():
  assert bench_async.run_order(1) == ["sync", "async"]
  order = bench_async.run_order(4)
  assert order == ["sync", "async", "async", "sync", "sync", "async", "async", "sync"]
  firsts = [order[i] for i in range(0, len(order), 2)]
  assert firsts.count("sync") == firsts.count("async")
  with pytest.raises(ValueError):
    bench_async.run_order(0)


def test_summarize_medians_ranges_and_pair_ratios():
  runs = [_run("sync", 0, 10.0), _run("async", 0, 5.0, max_lag=3),
          _run("async", 1, 4.0, max_lag=4), _run("sync", 1, 12.0),
          _run("sync", 2, 11.0), _run("async", 2, 8.0)]
  s = bench_async.summarize(runs)
  assert s["sync"]["wall_s"] == 11.0 and s["async"]["wall_s"] == 5.0
  assert (s["sync"]["wall_min_s"], s["sync"]["wall_max_s"]) == (10.0, 12.0)
  assert s["async"]["n"] == 3 and s["async"]["max_lag"] == 4
  assert s["speedup"] == pytest.approx(11.0 / 5.0)
  assert s["pair_speedups"] == pytest.approx([2.0, 3.0, 11.0 / 8.0])
  with pytest.raises(ValueError, match="no async"):
    bench_async.summarize([_run("sync", 0, 1.0)])


def test_fit_decode_recovers_a_line_and_stays_valid_on_noise():
  step, per = bench_async.fit_decode([(1, 0.011), (8, 0.018), (64, 0.074)])
  assert step == pytest.approx(0.010) and per == pytest.approx(0.001)
  step, per = bench_async.fit_decode([(1, 0.010), (64, 0.009)])  # decreasing: noise
  assert per == 0.0 and step > 0
  with pytest.raises(ValueError):
    bench_async.fit_decode([(8, 0.01), (8, 0.02)])


def test_calibration_uses_sync_runs_for_learner_and_sync_times():
  swap = dict(fetch_s=0.1, decode_s=0.05, pause_s=0.05)
  runs = [_run("sync", 0, 10.0, steps=4, learner_train_s=4.0, learner_publish_s=0.4,
               swaps=[swap] * 4, grade_s=[1.0, 2.0, 3.0], response_tokens=[10, 20, 30],
               prompt_tokens=[50, 50, 50]),
          _run("async", 0, 5.0, steps=4, learner_train_s=20.0, learner_publish_s=4.0,
               swaps=[dict(fetch_s=9, decode_s=9, pause_s=9)], grade_s=[4.0],
               response_tokens=[40], prompt_tokens=[60])]
  c = bench_async.calibration(runs, [(1, 0.011), (8, 0.018)], prompts=2, attempts=8,
                              max_new_tokens=40, grade_workers=4, sync_interval_s=0.02)
  assert c["train_step_s"] == pytest.approx(1.0)  # the contended async learner is ignored
  assert c["sync_s"] == pytest.approx(0.1 + 0.01 + 0.2)
  assert c["sync_pause_s"] == pytest.approx(0.05)
  assert c["group_grade_s"]["median"] == pytest.approx(2.5)
  assert c["response_tokens"]["n"] == 4 and c["slots"] == 16
  assert c["decode_step_per_seq_s"] == pytest.approx(0.001)


def test_markdown_names_both_modes_and_spread():
  runs = [_run("sync", 0, 10.0), _run("async", 0, 5.0), _run("async", 1, 4.0),
          _run("sync", 1, 12.0)]
  text = bench_async.markdown({"args": {"staleness": 4},
                               "summary": {"slow": bench_async.summarize(runs)}})
  assert "| slow | 11.0 (10.0-12.0) | 4.5 (4.0-5.0) | 2.44x (2.00-3.00) |" in text
  assert "async k=4" in text


def test_end_to_end_tiny(tmp_path):
  """Both modes on a tiny model, one step each (warm-up off for speed). One repeat: the
  alternating order of more repeats and their summary are the unit tests above."""
  from moe import build
  from moe import checkpoint as moe_checkpoint
  from pipeline import testing
  ckpt = str(tmp_path / "model")
  moe_checkpoint.save_params(build.create(testing.MODEL, seed=0), ckpt)
  out = tmp_path / "r.json"
  assert bench_async.main([
      "--init_checkpoint", ckpt, "--steps", "1", "--warmup_steps", "0", "--repeats", "1",
      "--envs", "light", "--prompts", "2", "--attempts", "2", "--max_new_tokens", "8",
      "--seq_len", "128", "--batch_rows", "4", "--grade_workers", "2", "--json", str(out)]) == 0
  r = json.loads(out.read_text())
  runs = r["runs"]["light"]
  assert [x["mode"] for x in runs] == ["sync", "async"]
  assert all(x["steps"] == 1 and x["wall_s"] > 0 for x in runs)
  # Each timed run trained its 2 prompts x 2 attempts: runs that trained nothing would make the
  # comparison time nothing.
  for x in runs:
    rl_testing.assert_steps_trained(x["learner_steps"], steps=1, episodes_per_step=4)
  assert len(r["summary"]["light"]["pair_speedups"]) == 1
  c = r["calibration"]["light"]
  assert [p[0] for p in c["decode_points"]] == [1, 2, 4]
  assert c["decode_step_s"] > 0 and c["train_step_s"] > 0
  assert c["group_grade_s"]["n"] >= 4 and 1 <= c["response_tokens"]["median"] <= 8
  assert r["machine_before"]["cores_usable"] >= 1


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
