"""Tests for the scenario builders: hardware arithmetic, the sync.fanout_sim adapter, the table.

Tolerance policy: closed-form arithmetic is compared with pytest.approx at its default relative
1e-6.
"""

import dataclasses
import math
import statistics
import sys

import pytest

from pipeline import sim_scenarios as sc
from sync import fanout_sim


def test_decode_pool_arithmetic():
  pool = sc.decode_pool(3, 2, 8, weight_bytes=96e9, active_params=1e9, kv_bytes_per_token=1e3,
                        mean_context_tokens=1000, peak_flops=1e15, hbm_Bps=4e12, decode_mfu=0.5,
                        prefill_mfu=0.25)
  assert pool.step_s == pytest.approx(96e9 / 8e12)
  assert pool.step_per_seq_s == pytest.approx(2e9 / 1e15 + 1e6 / 8e12)
  assert pool.prefill_s_per_token == pytest.approx(2e9 / 5e14)
  assert (pool.samplers, pool.slots) == (3, 8)


def test_sync_from_fanout_matches_sync_sim():
  ws = sc.sync_from_fanout(6, 16, 64, model_bytes=2e9)
  assert len(ws.ready_s) == len(ws.pause_s) == 6
  assert min(ws.pause_s) > 0 and min(ws.ready_s) > 0
  counts = [2, 2, 1, 1]  # 6 samplers round-robin over four clusters
  cfg = fanout_sim.terabyte_four_clusters(0.54e9, 0.79e9, 20.7, learner_hosts=8, replicas=2,
                                        hosts_per_replica=2, apply_delta_only=True)
  cfg = dataclasses.replace(cfg, model_bytes=2e9, clusters=[
      dataclasses.replace(c, replicas=n, relays=n) for c, n in zip(cfg.clusters, counts)])
  ref = fanout_sim.simulate(cfg)
  assert ws.end_to_end_s == pytest.approx(ref.end_to_end_s)
  assert ws.max_pause_s == pytest.approx(ref.max_pause_s)


CAL = dict(decode_step_s=0.004, decode_step_per_seq_s=0.0002, train_step_s=0.5, publish_s=0.05,
           sync_s=0.2, sync_pause_s=0.01, group_grade_s={"median": 4.0, "p99": 12.0},
           response_tokens={"median": 30.0, "p99": 40.0}, prompt_tokens=120.0, prompts=4,
           attempts=8, max_new_tokens=40, grade_workers=8, slots=32)


def test_episode_env_from_group_matches_group_quantiles():
  med, p99 = sc.episode_env_from_group(4.0, 12.0, 8)
  assert med < 4.0 and p99 < 12.0
  sigma = (math.log(p99) - math.log(med)) / statistics.NormalDist().inv_cdf(0.99)
  nd = statistics.NormalDist(math.log(med), sigma)
  for g, q in ((4.0, 0.5), (12.0, 0.99)):  # P(max of 8 <= g) = cdf(g) ** 8
    assert nd.cdf(math.log(g)) ** 8 == pytest.approx(q)
  assert sc.episode_env_from_group(4.0, 12.0, 1) == pytest.approx((4.0, 12.0))
  with pytest.raises(ValueError):
    sc.episode_env_from_group(2.0, 1.0, 8)


def test_calibration_from_bench_carries_every_figure():
  scn = sc.calibration_from_bench(CAL)
  assert scn.shared_compute and scn.env_workers == 64
  assert (scn.inference.slots, scn.inference.step_s) == (32, 0.004)
  assert scn.inference.step_per_seq_s == 0.0002
  assert scn.training.step_time(1e6) == 0.5  # fixed-shape batch: no per-token term
  assert scn.sync.end_to_end_s == pytest.approx(0.2) and scn.sync.max_pause_s == 0.01
  w = scn.workload
  assert (w.prompts_per_step, w.attempts, w.prompt_tokens, w.max_tokens) == (4, 8, 120, 40)
  assert (w.env_median_s, w.env_p99_s) == pytest.approx(sc.episode_env_from_group(4.0, 12.0, 8))


def test_calibration_scenario_async_beats_sync_and_table():
  scn = sc.calibration_from_bench(CAL)
  rows = sc.compare(scn, [4], steps=6)
  assert [k for k, _ in rows] == [0, 4]
  sync, async4 = rows[0][1], rows[1][1]
  assert async4.wall_s < sync.wall_s
  text = sc.table(rows, sync)
  assert "| sync |" in text and "(1.00x)" in text
  assert f"({sync.wall_s / async4.wall_s:.2f}x)" in text
  assert f"({sync.mid_step_s / async4.mid_step_s:.2f}x)" in text


def test_at_scale_scenario_shapes():
  scn = sc.at_scale_scenario(inference_frac=1 / 3, accelerators=512)
  assert scn.inference.samplers == 10  # round(512 / 3) // 16
  assert scn.sync.end_to_end_s > scn.sync.max_pause_s > 0
  assert any("1000B total / 32B active" in a for a in scn.assumptions)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
