"""Tests for the scenario builders: hardware arithmetic, the sync.sim adapter, the table.

Tolerance policy: closed-form arithmetic is compared with pytest.approx at its default relative
1e-6.
"""

import dataclasses
import sys

import pytest

from pipeline import sim_scenarios as sc
from sync import sim as sync_sim


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
  cfg = sync_sim.terabyte_four_clusters(0.54e9, 0.79e9, 20.7, learner_hosts=8, replicas=2,
                                        hosts_per_replica=2, apply_delta_only=True)
  cfg = dataclasses.replace(cfg, model_bytes=2e9, clusters=[
      dataclasses.replace(c, replicas=n, relays=n) for c, n in zip(cfg.clusters, counts)])
  ref = sync_sim.simulate(cfg)
  assert ws.end_to_end_s == pytest.approx(ref.end_to_end_s)
  assert ws.max_pause_s == pytest.approx(ref.max_pause_s)


def test_calibration_scenario_async_beats_sync_and_table():
  scn = sc.calibration_scenario(train_step_s=0.5, prompts=4)
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
