"""Smoke run of the sampler benchmark: it runs end to end, and its checks hold on a tiny model
(greedy tokens equal transformers', logprobs agree with the learner's forward). Two CPU devices,
for the replicas run (the other runs use the default device alone)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import json  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from tools import bench_sampler  # noqa: E402


def test_quick_run(tmp_path):
  out = tmp_path / "r.json"
  assert bench_sampler.main(["--quick", "--batches", "1,2", "--new_tokens", "6",
                             "--prompt_len", "8", "--repeats", "1", "--decode_steps", "4",
                             "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert [r["batch"] for r in report["throughput"]] == [1, 2]
  for row in report["throughput"]:
    assert row["ours_greedy_match_seqs"] == 1.0
    assert row["ours_deterministic_greedy_match_seqs"] == 1.0
    assert row["ours_tok_s"] > 0 and row["transformers_tok_s"] > 0
  for stats in report["agreement"].values():
    assert stats["max_abs_dlogprob"] < 1e-5 and stats["routing_agreement"] == 1.0
  swap = report["swap"][0]
  assert swap["versions_seen"] == [0, 1] and swap["swap_pause_s"] < swap["reload_s"]
  # The swap landed after steady decode calls of the same shapes, and the first call after it
  # was measured with the release of the old weights inside it.
  assert swap["steady_call_s"] > 0 and swap["first_call_s"] >= swap["swap_free_s"] >= 0
  assert swap["first_call_extra_s"] == swap["first_call_s"] - swap["steady_call_s"]
  for row in report["throughput"]:
    assert row["transformers_threads"] in (1, 2) and row["xla_threads"] >= 1
  assert [r["m"] for r in report["matmul"]] == [4, 8]
  for row in report["matmul"]:
    assert row["xla_gflops"] > 0 and row["torch_1_gflops"] > 0 and row["torch_2_gflops"] > 0


def test_shape_bucket_rows(tmp_path):
  """Both engines ran the same prompts warm: decode rates, their ratio, the program counts. One
  batch size: the loop over batch sizes is test_quick_run's."""
  out = tmp_path / "s.json"
  assert bench_sampler.main(["--quick", "--only_shape_buckets", "--batches", "4",
                             "--new_tokens", "40", "--prompt_len", "8", "--repeats", "2",
                             "--decode_steps", "4", "--length_bucket", "16",
                             "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["engine"]["max_len"] == 48 and "throughput" not in report
  rows = report["shape_buckets"]
  assert [r["batch"] for r in rows] == [4]
  for r in rows:
    assert len(r["coarse_all_decode_tok_s"]) == len(r["fine_all_decode_tok_s"]) == 2
    assert r["coarse_decode_tok_s"] == max(r["coarse_all_decode_tok_s"]) > 0
    assert r["decode_ratio"] == r["coarse_decode_tok_s"] / r["fine_decode_tok_s"]
    assert r["coarse_programs"] < r["fine_programs"]
    assert r["compiled_while_timed"] == 0


def test_replica_rows(tmp_path):
  """One engine and two replicas ran the same prompts warm; both replicas served requests."""
  out = tmp_path / "r.json"
  assert bench_sampler.main(["--quick", "--only_replicas", "--batches", "4", "--new_tokens", "8",
                             "--prompt_len", "8", "--repeats", "2", "--decode_steps", "4",
                             "--length_bucket", "16", "--json", str(out)]) == 0
  (row,) = json.loads(out.read_text())["replicas"]
  assert row["batch"] == 4 and len(row["one_all_tok_s"]) == len(row["two_all_tok_s"]) == 2
  assert row["two_tok_s"] == max(row["two_all_tok_s"]) > 0
  assert row["ratio"] == row["two_tok_s"] / row["one_tok_s"]
  assert len(row["replica_share"]) == 2 and min(row["replica_share"]) > 0
  assert sum(row["replica_share"]) == pytest.approx(1.0)
  assert row["compiled_while_timed"] == 0 and row["same_greedy_tokens"] == 1.0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
