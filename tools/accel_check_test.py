"""tools/accel_check on the CPU with tiny shapes: every measurement is there and sane.

One run of `main` (8 CPU devices, a one-layer tiny model, a few tokens: ~1 minute on the shared
2-core machine) is shared by the checks below. Sanity bounds: rates positive; MFU in (0, 1] and
equal to the model FLOP rate over the stated peak; router replay in float32 on the CPU is the
same arithmetic in sampler and learner, so the learner's free routing picks the sampler's experts
everywhere (agreement exactly 1.0) and logprobs agree to float32 rounding (< 1e-5, the bound
tools/bench_sampler_test uses).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from rl import flops  # noqa: E402
from tools import accel_check  # noqa: E402
from tools import bench_ep  # noqa: E402

TINY_FLAGS = [
    "--tiny_only", "--gin.ModelConfig.num_layers=1", "--gin.ModelConfig.hidden_size=64",
    "--gin.ModelConfig.moe_intermediate_size=64",
    "--batches=1,4", "--prompt_len=8", "--new_tokens=8", "--repeats=1", "--decode_steps=4",
    "--length_bucket=16",
    "--seq_len=32", "--batch_rows=2", "--steps=2", "--warmup=1", "--matmul_sizes=128,256",
    "--ep_batch_rows=2", "--ep_seq_len=16", "--expert_shards=8", "--capacity_factors=1.25",
    "--ep_repeats=1", "--ep_warmup=1",
    "--replay_batch=2", "--replay_new_tokens=6",
]
# The same model overrides as gin bindings, for building the config the run measured.
TINY_FLAGS_BINDINGS = [f[len("--gin."):].replace("=", " = ") for f in TINY_FLAGS
                       if f.startswith("--gin.")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(exit status, JSON report, printed output) of one tiny CPU run."""
  path = tmp_path_factory.mktemp("accel") / "report.json"
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = accel_check.main(TINY_FLAGS + [f"--json={path}"])
  return rc, json.loads(path.read_text()), out.getvalue()


def test_run_succeeds_with_every_section(run):
  rc, report, printed = run
  assert rc == 0 and report["errors"] == {}
  assert set(report["seconds"]) == set(accel_check.SECTIONS)
  assert report["machine"]["backend"] == "cpu" and report["machine"]["devices"] == 8
  assert report["main_model"] == "tiny" and "1b" not in report["models"]
  assert "bfloat16" in report["note"]  # why the CPU run is float32 only
  for header in ("Sampler (float32)", "Learner (one device)", "Expert dispatch",
                 "Router replay (tiny)"):
    assert header in printed


def test_sampler_tokens_per_second(run):
  _, report, _ = run
  rows = report["sampler"]["rows"]
  assert report["sampler"]["dtype"] == "float32"
  assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 4)]
  for r in rows:
    assert r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert 0 < r["ttft_s"] <= r["latency_s"]
    assert r["tokens_per_s"] == max(r["all_tokens_per_s"])
    assert r["compiled_while_timed"] == 0  # the warm-up runs compiled every program timed


def test_learner_mfu(run):
  _, report, _ = run
  r = report["learner"]
  cfg = accel_check.load_model("moe/configs/tiny.gin", TINY_FLAGS_BINDINGS).replace(
      param_dtype="float32", dtype="bfloat16")
  assert (r["dtype"], r["param_dtype"], r["batch_rows"], r["seq_len"]) == (
      "bfloat16", "float32", 2, 32)
  assert r["train_flops_per_token"] == flops.train_flops_per_token(cfg, 32)
  assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_time_s"])
  assert r["model_tflops_per_s"] == pytest.approx(
      r["tokens_per_s"] * r["train_flops_per_token"] / 1e12)
  # No datasheet peak for a CPU: MFU is against the bf16 matmul rate measured in the same run.
  assert r["peak_source"].startswith("best measured bfloat16 matmul here")
  assert r["peak_tflops"] == pytest.approx(r["matmul_peak_tflops"])
  assert 0 < r["mfu"] <= 1
  assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / r["peak_tflops"])


def test_expert_dispatch_all_to_all_against_psum(run):
  _, report, _ = run
  d = report["dispatch"]
  assert d["devices"] == 8
  (row,) = d["rows"]
  assert (row["expert_shards"], row["capacity_factor"], row["mesh"]) == (8, 1.25, [1, 1, 8, 1])
  a, p = row["all_to_all"], row["psum"]
  assert "all-to-all" in a["collectives"] and "all-to-all" not in p["collectives"]
  assert a["step_ms"] > 0 and p["step_ms"] > 0
  assert 0 < a["activation_sent_bytes_per_token"] <= a["sent_bytes_per_token"]


def test_router_replay_agrees_exactly_in_float32_on_the_cpu(run):
  _, report, _ = run
  rep = report["replay"]
  assert rep["model"] == "tiny" and set(rep) == {"model", "float32"}
  r = rep["float32"]
  assert r["tokens"] == 2 * 6
  assert 0 <= r["routing_agreement"] <= 1 and r["routing_agreement"] == 1.0
  assert r["max_abs_dlogprob"] < 1e-5 and r["max_abs_dlogprob_free_routing"] < 1e-5


def test_one_device_dispatch_is_the_block_step(monkeypatch):
  """With fewer devices than bench_ep's 8 (one GPU) there is no exchange: the row is one MoE
  block's compiled forward and backward on one device."""
  monkeypatch.setattr(bench_ep, "DEVICES", 16)  # more than this process has
  cfg = accel_check.load_model("moe/configs/tiny.gin", TINY_FLAGS_BINDINGS)
  d = accel_check.dispatch_rows(cfg, batch_rows=2, seq_len=8, expert_shards=[2],
                                capacity_factors=[None], repeats=2, warmup=1)
  assert d["devices"] == 1 and d["rows"] == []
  s = d["single_device"]
  assert s["tokens"] == 16 and s["step_ms"] > 0 and s["temp_bytes"] > 0
  assert "no all-to-all" in s["note"]


def test_device_peaks_by_kind():
  peak, source = accel_check.device_peak("NVIDIA H200")
  assert peak == 989e12 and "datasheet" in source
  assert accel_check.device_peak("NVIDIA H100 PCIe")[0] == 756e12  # not the SXM part's 989
  assert accel_check.device_peak("TPU v5 lite")[0] == 197e12
  peak, source = accel_check.device_peak("NVIDIA H200 NVL")  # not in the table: no guess
  assert peak is None and "--peak_tflops" in source
  assert accel_check.device_peak("cpu", 2.5) == (2.5e12, "--peak_tflops 2.5")
  with pytest.raises(ValueError, match="must be positive"):
    accel_check.device_peak("NVIDIA H200", 0.0)


@pytest.mark.parametrize("flags,message", [
    (["--replay_new_tokens=200"], "must be <= --new_tokens"),
    (["--sections=sampler,bogus"], "unknown --sections"),
    (["--replay_dtypes=float16"], "float32 or bfloat16"),
    (["--gin_file=moe/configs/tiny.gin"], "--tiny_gin"),
    (["--batches=0"], "must be positive"),
    (["--peak_tflops=-1"], "must be positive"),
])
def test_bad_flags_fail_before_any_work(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    accel_check.parse_args(flags)
  assert e.value.code == 2 and message in capsys.readouterr().err



if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
