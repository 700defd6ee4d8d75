"""A discrete-event simulator of weight-sync fan-out from one learner to many clusters.

What: `simulate(Config)` pushes one update through the pipeline the code implements: the
learner encodes the delta chunk by chunk; each chunk leaves the origin's uplink, crosses each
cluster's WAN link to that cluster's relay (once), and leaves the relay over the cluster
network to the sampler hosts that own it (each sampler replica is sharded over
`hosts_per_replica` hosts, which fetch only their shard); each host decodes its chunks, and
when its shard is complete it pauses to swap the weights in. Every link and every CPU stage is
a FIFO server (bandwidth + per-hop latency), chunks pipeline through them (store-and-forward
per chunk), and events run in time order from a heap. `Result` has, per host, the time from
the learner's step to serving the new weights and the pause it saw.

Why: the real system (1 TB model, four clusters, thousands of hosts) cannot run here; the
per-byte costs (encode/decode bytes per second per core, compression ratio) are measured on
this machine by `sync.bench` and plugged in, and the rest (link speeds, topology) are stated
assumptions. Small cases have answers computable by hand (see fanout_sim_test).
"""

import dataclasses
import heapq
import math


@dataclasses.dataclass
class Cluster:
  name: str
  wan_Bps: float  # bytes/s from the origin to this cluster's relay
  wan_latency_s: float
  relay_egress_Bps: float  # the relay's NIC towards the hosts
  lan_latency_s: float
  host_ingress_Bps: float
  replicas: int  # sampler replicas in the cluster
  hosts_per_replica: int = 1
  relays: int = 1  # relay hosts in the cluster, in a tree under the one that crosses the WAN
  relay_fanout: int = 2  # children per relay in that tree


@dataclasses.dataclass
class Config:
  model_bytes: float  # the sampler's weights (e.g. bf16)
  ratio: float  # delta compression ratio (model bytes / delta bytes)
  encode_Bps: float  # learner encode throughput, model bytes/s, all learner hosts together
  decode_Bps: float  # decode throughput per sampler host, model bytes/s
  apply_Bps: float  # swap into the serving weights (e.g. host->device copy) per host
  apply_fixed_s: float = 0.0  # per-swap fixed cost (synchronisation, allocator)
  apply_delta_only: bool = False  # swap moves only the delta (scatter on device), not the shard
  origin_egress_Bps: float = 100e9 / 8
  chunk_bytes: float = 64e6  # delta bytes per transfer unit
  clusters: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HostResult:
  cluster: str
  replica: int
  host: int
  serving_s: float  # learner step -> serving the new weights
  pause_s: float


@dataclasses.dataclass
class Result:
  delta_bytes: float
  chunks: int
  hosts: list

  @property
  def end_to_end_s(self) -> float:
    return max(h.serving_s for h in self.hosts)

  @property
  def max_pause_s(self) -> float:
    return max(h.pause_s for h in self.hosts)

  def per_cluster(self) -> dict:
    out = {}
    for h in self.hosts:
      first, last = out.get(h.cluster, (math.inf, 0.0))
      out[h.cluster] = (min(first, h.serving_s), max(last, h.serving_s))
    return out


class _Server:
  """A FIFO server: a job of `work` units takes work/rate seconds, then `latency` to arrive."""

  def __init__(self, rate: float, latency: float = 0.0):
    self.rate, self.latency = rate, latency
    self.free_at = 0.0

  def serve(self, arrival: float, work: float) -> float:
    start = max(arrival, self.free_at)
    self.free_at = start + work / self.rate
    return self.free_at + self.latency


class _Sim:
  """Event loop: (time, seq, fn, args) in a heap, run in time order; fn(t, *args)."""

  def __init__(self):
    self._q = []
    self._seq = 0

  def at(self, t, fn, *args):
    heapq.heappush(self._q, (t, self._seq, fn, args))
    self._seq += 1

  def run(self):
    while self._q:
      t, _, fn, args = heapq.heappop(self._q)
      fn(t, *args)


@dataclasses.dataclass
class _Host:
  ingress: _Server
  decode: _Server
  left: int
  shard_raw: float
  result: HostResult


@dataclasses.dataclass
class _Relay:
  egress: _Server
  children: list  # child relays
  owners: list  # owners[h] = this relay's hosts (one per replica) that hold shard h


def simulate(cfg: Config) -> Result:
  """Runs one update through the topology; see module docstring."""
  delta_bytes = cfg.model_bytes / cfg.ratio
  n = max(1, math.ceil(delta_bytes / cfg.chunk_bytes))
  size = delta_bytes / n  # delta bytes per chunk
  raw = cfg.model_bytes / n  # model bytes per chunk
  sim = _Sim()
  encoder = _Server(cfg.encode_Bps)
  origin = _Server(cfg.origin_egress_Bps)
  hosts, heads = [], []
  for c in cfg.clusters:
    relays = [_Relay(_Server(c.relay_egress_Bps, c.lan_latency_s), [],
                     [[] for _ in range(c.hosts_per_replica)]) for _ in range(c.relays)]
    for j in range(1, c.relays):
      relays[(j - 1) // c.relay_fanout].children.append(relays[j])
    for r in range(c.replicas):
      for h in range(c.hosts_per_replica):
        owned = len(range(h, n, c.hosts_per_replica))
        host = _Host(_Server(c.host_ingress_Bps), _Server(cfg.decode_Bps), owned, raw * owned,
                     HostResult(c.name, r, h, 0.0, 0.0))
        hosts.append(host)
        relays[r % c.relays].owners[h].append(host)
    heads.append((_Server(c.wan_Bps, c.wan_latency_s), relays[0]))

  def encoded(t, i):
    for wan, head in heads:  # the origin uploads one copy per cluster
      sim.at(origin.serve(t, size), left_origin, wan, head, i)

  def left_origin(t, wan, head, i):
    sim.at(wan.serve(t, size), at_relay, head, i)

  def at_relay(t, relay, i):
    for child in relay.children:  # forward down the in-cluster tree first
      sim.at(relay.egress.serve(t, size), at_relay, child, i)
    for host in relay.owners[i % len(relay.owners)]:
      sim.at(relay.egress.serve(t, size), at_host, host)

  def at_host(t, host):
    sim.at(host.ingress.serve(t, size), received, host)

  def received(t, host):
    done = host.decode.serve(t, raw)
    host.left -= 1
    if host.left == 0:  # FIFO decode: this chunk finishes last
      moved = host.shard_raw / cfg.ratio if cfg.apply_delta_only else host.shard_raw
      pause = cfg.apply_fixed_s + moved / cfg.apply_Bps
      host.result.serving_s = done + pause
      host.result.pause_s = pause

  for i in range(n):
    sim.at(encoder.serve(0.0, raw), encoded, i)
  sim.run()
  return Result(delta_bytes, n, [h.result for h in hosts if h.shard_raw > 0])


def terabyte_four_clusters(encode_Bps_per_core: float, decode_Bps_per_core: float,
                           ratio: float, *, learner_hosts: int = 64, cores_per_host: int = 32,
                           replicas: int = 16, hosts_per_replica: int = 16,
                           relays: int = 16, relay_fanout: int = 2,
                           apply_Bps: float = 20e9, apply_delta_only: bool = False, wan_Gbps=(400, 200, 200, 100),
                           wan_latency_s=(0.001, 0.03, 0.08, 0.15)) -> Config:
  """The 1 TB / four-cluster scenario, from per-core rates measured here.

  Assumptions (stated, not measured): the learner's 64 hosts each encode their own shard with
  32 cores; a sampler replica is 16 hosts (each holds 1/16 of the model, fetches and decodes
  only that shard with 32 cores, and swaps it onto its GPUs at `apply_Bps`, PCIe-class host to
  device, the whole shard or with `apply_delta_only` just the delta, scattered on device);
  16 replicas per cluster; one relay per replica (a host of it), in a binary tree under the
  cluster's WAN relay; 100 Gb/s relay and host NICs; the origin has 400 Gb/s up; the WAN links
  to the four clusters are 400/200/200/100 Gb/s with 1-150 ms latency.
  """
  gbps = 1e9 / 8
  clusters = [Cluster(f"cluster{k}", wan_Gbps[k] * gbps, wan_latency_s[k], 100 * gbps, 50e-6,
                      100 * gbps, replicas, hosts_per_replica, relays, relay_fanout)
              for k in range(4)]
  return Config(model_bytes=1e12, ratio=ratio,
                encode_Bps=encode_Bps_per_core * cores_per_host * learner_hosts,
                decode_Bps=decode_Bps_per_core * cores_per_host, apply_Bps=apply_Bps,
                apply_fixed_s=0.05, apply_delta_only=apply_delta_only, origin_egress_Bps=400 * gbps, chunk_bytes=64e6,
                clusters=clusters)
