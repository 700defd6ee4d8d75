"""Smoke test for the sandbox benchmark: --quick runs end to end and reports every row."""

import json
import sys

import pytest

from tools import bench_sandbox


def test_quick_run(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert bench_sandbox.main(["--quick", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  for row in ("start latency p50", "burst of 10: episodes/s", "memory per idle sandbox"):
    assert row in text
  res = json.loads(out.read_text())
  assert res["latency_ms"]["sandbox_p50"] > 0 and res["idle"]["pss_mib"] > 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
