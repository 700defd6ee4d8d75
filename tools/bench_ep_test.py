"""tools/bench_ep: the HLO collective byte count, and one benchmark row on 8 CPU devices."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import pytest  # noqa: E402

from moe.config import ModelConfig  # noqa: E402
from tools import bench_ep  # noqa: E402

HLO = """
  %all-to-all.1 = (f32[64,128]{1,0}, f32[64,128]{1,0}) all-to-all(%a, %b), channel_id=1, replica_groups={{0,1},{2,3}}, metadata={}
  %all-reduce.2 = (f32[2,128,128]{2,1,0}, f32[32,128]{1,0}) all-reduce(%c, %d), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %all-gather = f32[128,8]{1,0} all-gather(%e), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %fusion = f32[8]{0} fusion(%all-gather), kind=kLoop
"""  # noqa: E501


def test_collective_bytes_reads_each_form_of_replica_groups():
  got = bench_ep.collective_bytes(HLO, param_shapes=frozenset({(2, 128, 128)}))
  a2a = 2 * 64 * 128 * 4  # two [64, 128] f32 parts, a group of 2
  grad, act = 2 * 128 * 128 * 4, 32 * 128 * 4  # one all-reduce, a group of 4
  gathered = 128 * 8 * 4  # the result, gathered over a group of 4
  assert got["by_op"] == {"all-to-all": (1, a2a), "all-reduce": (1, grad + act),
                          "all-gather": (1, gathered / 4)}
  assert got["operand"] == a2a + grad + act + gathered / 4
  assert got["sent"] == pytest.approx(a2a / 2 + 2 * (grad + act) * 3 / 4 + gathered * 3 / 4)
  assert got["grad_sent"] == pytest.approx(2 * grad * 3 / 4)
  with pytest.raises(ValueError, match="asynchronous"):
    bench_ep.collective_bytes("  %s = f32[4]{0} all-reduce-start(%x), replica_groups={{0,1}}")


def test_one_row_times_both_forms_on_the_same_tokens():
  cfg = ModelConfig(hidden_size=32, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2)
  rows = bench_ep.bench(cfg, expert_shards=(4,), capacity_factors=(None,), batch_rows=2,
                        seq_len=16, repeats=1, warmup=0)
  (row,) = rows
  a, p = row["all_to_all"], row["psum"]
  assert row["mesh"] == [2, 1, 4, 1] and row["tokens"] == 32
  # Dropless, both forms compute the same function.
  assert a["loss"] == pytest.approx(p["loss"], rel=1e-5)
  assert "all-to-all" in a["collectives"] and "all-to-all" not in p["collectives"]
  assert a["step_ms"] > 0 and p["temp_bytes"] > 0
  assert 0 < a["activation_sent_bytes_per_token"] <= a["sent_bytes_per_token"]
  table = bench_ep.markdown(rows)
  assert table.splitlines()[2].startswith("| none (dropless) | 4 (2,1,4,1) |")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
