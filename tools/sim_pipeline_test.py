"""sim_pipeline: scenario (a) from a bench_async JSON, predicted beside measured."""

import json
import sys

import pytest

from pipeline import sim_scenarios as sc
from tools import sim_pipeline

# A bench_async `calibration` entry (the shape tools.bench_async.calibration writes).
CAL = dict(decode_step_s=0.004, decode_step_per_seq_s=0.0002, train_step_s=0.5, publish_s=0.05,
           sync_s=0.2, sync_pause_s=0.01, group_grade_s={"median": 4.0, "p99": 12.0},
           response_tokens={"median": 30.0, "p99": 40.0}, prompt_tokens=120.0, prompts=4,
           attempts=8, max_new_tokens=40, grade_workers=8, slots=32)


def _report():
  summary = {"sync": {"wall_s": 30.0, "wall_min_s": 28.0, "wall_max_s": 33.0},
             "async": {"wall_s": 15.0, "wall_min_s": 14.0, "wall_max_s": 16.0}, "speedup": 2.0}
  return {"args": {"staleness": 4, "steps": 4},
          "machine_before": {"cpu": "test cpu", "cores_usable": 2},
          "calibration": {"slow": CAL}, "summary": {"slow": summary}}


def test_predicted_vs_measured_simulates_the_measured_figures():
  rows = sim_pipeline.predicted_vs_measured(_report())
  (r,) = rows
  scn = sc.calibration_from_bench(CAL)
  assert r["predicted_sync_s"] == pytest.approx(scn.run(0, 4).wall_s)
  assert r["predicted_async_s"] == pytest.approx(scn.run(4, 4).wall_s)
  assert r["measured_speedup"] == 2.0
  text = sim_pipeline.predicted_vs_measured_table(rows)
  assert f"| slow | sync | {r['predicted_sync_s']:.1f} | 30.0 (28.0-33.0) |" in text
  assert f"| slow | speedup | {r['predicted_speedup']:.2f}x | 2.00x |" in text


def test_cli_measured_only(tmp_path, capsys):
  src, out = tmp_path / "bench.json", tmp_path / "sim.json"
  src.write_text(json.dumps(_report()))
  assert sim_pipeline.main(["--measured", str(src), "--only_measured", "--steps", "4",
                            "--ks", "4", "--json", str(out)]) == 0
  got = json.loads(out.read_text())
  assert [r["workload"] for r in got["predicted_vs_measured"]] == ["slow"]
  assert "a: calibration (this machine, shared cores)" in got
  assert "predicted vs measured" in capsys.readouterr().out


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
