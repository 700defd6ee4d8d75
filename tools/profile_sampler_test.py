"""Tests for tools/profile_sampler: HLO scope parsing, the per-step table, and a real profile."""

import json
import os
import subprocess
import sys

import pytest

from tools import profile_sampler

HLO = '''
  %ynn_fusion.3 = f32[8,24,1024]{2,1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(decode_chunk)/while/body/closed_call/ffn/experts/cond/branch_5_fun/ecd,edi->eci/dot_general"}
  %fusion.7 = f32[64,4,2,160]{3,2,1,0} fusion(%q, %k), kind=kLoop, metadata={op_name="jit(decode_chunk)/while/body/closed_call/attention/reduce_sum"}
  ROOT %dot.2 = f32[64,1024]{1,0} dot(%h, %w), metadata={op_name="jit(decode_chunk)/while/body/lm_head/dot_general"}
  %copy.1 = f32[64]{0} copy(%x), metadata={op_name="jit(decode_chunk)/while/body/add"}
  %param.0 = f32[64]{0} parameter(0)
'''


def test_op_scopes_takes_the_innermost_known_scope_and_spots_matmuls():
  scopes = profile_sampler.op_scopes(HLO)
  assert scopes == {"ynn_fusion.3": ("experts", True), "fusion.7": ("attention", False),
                    "dot.2": ("lm_head", True), "copy.1": ("other", False)}


def test_breakdown_sums_per_step_and_skips_spans_that_are_not_operations():
  scopes = profile_sampler.op_scopes(HLO)
  events = {"ynn_fusion.3": 6e6, "fusion.7": 2e6, "dot.2": 1e6, "cond.9.clone": 9e6,
            "ThunkExecutor::Execute": 50e6, "SlinkyThreadPool::Await": 3e6, "mystery.1": 4e6}
  report = profile_sampler.breakdown(events, scopes, steps=2)
  assert report["by_scope"] == {"experts/matmul": 3.0, "attention/other": 1.0,
                                "lm_head/matmul": 0.5}
  assert report["total_ms"] == 4.5 and report["unattributed_ms"] == 2.0


def test_refuses_to_run_inside_a_process_where_jax_started_without_tracing(monkeypatch):
  import jax  # noqa: F401  (the point: JAX is imported already)
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(SystemExit):
    profile_sampler.main(["--quick"])


def test_a_real_profile_attributes_the_step_to_the_model_parts(tmp_path):
  out = tmp_path / "report.json"
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-m", "tools.profile_sampler", "--quick", "--batch", "8",
                  "--cache_len", "32", "--position", "8", "--steps", "4", "--repeats", "1",
                  "--json", str(out)], check=True, env=env, timeout=300,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  report = json.loads(out.read_text())
  parts = report["by_scope"]
  for key in ("experts/matmul", "qkv/matmul", "attention/other", "lm_head/matmul"):
    assert parts.get(key, 0) > 0, (key, parts)
  assert report["total_ms"] == pytest.approx(sum(parts.values()), abs=1e-3)
  assert report["wall_ms_per_step_untraced"] > 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
