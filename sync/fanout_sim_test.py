"""Tests for the fan-out simulator on cases small enough to work out by hand."""

import sys

import pytest

from sync import fanout_sim

FAST = 1e15  # a stage too fast to matter


def _cfg(model=100.0, ratio=10.0, chunk=10.0, **kw):
  cluster = dict(name="c", wan_Bps=FAST, wan_latency_s=0.0, relay_egress_Bps=FAST,
                 lan_latency_s=0.0, host_ingress_Bps=FAST, replicas=1)
  cluster.update(kw.pop("cluster", {}))
  n_clusters = kw.pop("n_clusters", 1)
  base = dict(model_bytes=model, ratio=ratio, encode_Bps=FAST, decode_Bps=FAST,
              apply_Bps=FAST, origin_egress_Bps=FAST, chunk_bytes=chunk)
  base.update(kw)
  clusters = [fanout_sim.Cluster(**dict(cluster, name=f"c{k}")) for k in range(n_clusters)]
  return fanout_sim.Config(clusters=clusters, **base)


def test_one_chunk_sums_every_stage():
  # delta = 100/10 = 10 bytes, one chunk: encode 100/100=1, origin 10/10=1, WAN 10/5=2 + 0.5,
  # relay 10/10=1 + 0.1, host NIC 10/10=1, decode 100/50=2, swap 0.2 + 100/100=1.2.
  cfg = _cfg(encode_Bps=100, origin_egress_Bps=10, decode_Bps=50, apply_Bps=100,
             apply_fixed_s=0.2,
             cluster=dict(wan_Bps=5, wan_latency_s=0.5, relay_egress_Bps=10, lan_latency_s=0.1,
                          host_ingress_Bps=10))
  r = fanout_sim.simulate(cfg)
  assert r.chunks == 1 and r.delta_bytes == 10
  assert r.end_to_end_s == pytest.approx(9.8)
  assert r.max_pause_s == pytest.approx(1.2)
  cfg.apply_delta_only = True  # swap moves 10 bytes instead of 100
  assert fanout_sim.simulate(cfg).max_pause_s == pytest.approx(0.3)


def test_chunks_pipeline_through_the_bottleneck():
  # 10 chunks of 10 bytes; WAN at 10 B/s is the only slow stage: 10 s; decode (1000 B/s over
  # 100 model bytes per chunk = 0.1 s) overlaps except for the last chunk.
  r = fanout_sim.simulate(_cfg(model=1000, chunk=10, decode_Bps=1000, cluster=dict(wan_Bps=10)))
  assert r.chunks == 10
  assert r.end_to_end_s == pytest.approx(10.1)


def test_relay_egress_is_shared_by_its_hosts_and_a_tree_spreads_it():
  flat = fanout_sim.simulate(_cfg(cluster=dict(relay_egress_Bps=10, replicas=6)))
  assert sorted(h.serving_s for h in flat.hosts) == pytest.approx([1, 2, 3, 4, 5, 6])
  # Three relays in a binary tree: the head sends to its 2 children (t=1,2) then its own 2
  # replicas (3,4); child 1 serves 2 replicas at 2,3; child 2 at 3,4.
  tree = fanout_sim.simulate(_cfg(cluster=dict(relay_egress_Bps=10, replicas=6, relays=3)))
  assert sorted(h.serving_s for h in tree.hosts) == pytest.approx([2, 3, 3, 3, 4, 4])


def test_hosts_fetch_only_their_shard():
  # 2 chunks, replicas sharded over 2 hosts: each host gets one chunk (10 bytes at 10 B/s) and
  # swaps half of the model (50 bytes at 50 B/s).
  r = fanout_sim.simulate(_cfg(chunk=5, apply_Bps=50,
                        cluster=dict(host_ingress_Bps=5, hosts_per_replica=2)))
  assert r.chunks == 2 and len(r.hosts) == 2
  assert [h.serving_s for h in r.hosts] == pytest.approx([2.0, 2.0])
  assert r.max_pause_s == pytest.approx(1.0)


def test_origin_uplink_is_shared_by_clusters():
  r = fanout_sim.simulate(_cfg(origin_egress_Bps=10, n_clusters=2))
  assert sorted(h.serving_s for h in r.hosts) == pytest.approx([1.0, 2.0])
  assert r.per_cluster() == {"c0": pytest.approx((1.0, 1.0)), "c1": pytest.approx((2.0, 2.0))}


def test_terabyte_scenario_runs_and_scales_with_ratio():
  fast = fanout_sim.simulate(fanout_sim.terabyte_four_clusters(1e9, 2e9, 50))
  slow = fanout_sim.simulate(fanout_sim.terabyte_four_clusters(1e9, 2e9, 10))
  assert len(fast.hosts) == 4 * 16 * 16
  assert fast.end_to_end_s < slow.end_to_end_s
  assert fast.delta_bytes == pytest.approx(20e9)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
