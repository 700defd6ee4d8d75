"""Prometheus text exposition of the engine's counters and gauges (`GET /metrics`).

What: `render(snapshot)` turns `Engine.metrics()` into the Prometheus text format (version 0.0.4)
with HELP/TYPE lines. Kept dependency-free: the format is a few lines and the set is fixed.
"""

from __future__ import annotations

# name in Engine.metrics() -> (metric name, type, help)
_METRICS = (
    ("queue_depth", "rollout_queue_depth", "gauge", "Requests waiting for a slot."),
    ("queued_completions", "rollout_queued_completions", "gauge",
     "Completions (sum of n) waiting for a slot."),
    ("active_slots", "rollout_active_slots", "gauge", "Slots generating now."),
    ("max_slots", "rollout_max_slots", "gauge", "Decode batch slots."),
    ("batch_occupancy", "rollout_batch_occupancy", "gauge", "active_slots / max_slots."),
    ("tokens_per_second", "rollout_tokens_per_second", "gauge",
     "Generated tokens per second over the last 10 s."),
    ("policy_version", "rollout_policy_version", "gauge", "Version of the served weights."),
    ("last_swap_pause_seconds", "rollout_last_swap_pause_seconds", "gauge",
     "Decode pause of the last weight swap."),
    ("swap_pending", "rollout_swap_pending", "gauge",
     "1 while a weight swap waits for the serving loop to apply it."),
    ("requests_total", "rollout_requests_total", "counter", "Requests accepted."),
    ("completions_total", "rollout_completions_total", "counter", "Completions returned."),
    ("generated_tokens_total", "rollout_generated_tokens_total", "counter", "Tokens generated."),
    ("prompt_tokens_total", "rollout_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    ("rejected_total", "rollout_rejected_total", "counter", "Requests refused: queue full."),
    ("timeout_total", "rollout_timeout_total", "counter", "Requests ended by their timeout."),
    ("cancelled_total", "rollout_cancelled_total", "counter", "Requests cancelled."),
    ("swaps_total", "rollout_swaps_total", "counter", "Weight swaps applied."),
    ("decode_calls_total", "rollout_decode_calls_total", "counter", "Decode device calls."),
    ("prefill_calls_total", "rollout_prefill_calls_total", "counter", "Prefill device calls."),
    ("decode_seconds_total", "rollout_decode_seconds_total", "counter",
     "Wall time in decode device calls."),
    ("prefill_seconds_total", "rollout_prefill_seconds_total", "counter",
     "Wall time in prefill device calls."),
    # Automatic prefix caching (rollout.prefix_reuse); all 0 when it is off.
    ("prefix_cache_lookups_total", "rollout_prefix_cache_lookups_total", "counter",
     "Prefills that looked up the prefix cache."),
    ("prefix_cache_lookup_tokens_total", "rollout_prefix_cache_lookup_tokens_total", "counter",
     "Prompt tokens of the prefills that looked up the prefix cache."),
    ("prefix_cache_hits_total", "rollout_prefix_cache_hits_total", "counter",
     "Prefills that found a cached prefix."),
    ("prefix_cache_hit_tokens_total", "rollout_prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens served from the prefix cache (not prefilled)."),
    ("prefix_cache_hit_rate", "rollout_prefix_cache_hit_rate", "gauge",
     "prefix_cache_hit_tokens_total / prefix_cache_lookup_tokens_total."),
    ("prefix_cache_blocks", "rollout_prefix_cache_blocks", "gauge", "Blocks in the prefix cache."),
    ("prefix_cache_capacity_blocks", "rollout_prefix_cache_capacity_blocks", "gauge",
     "Most blocks the prefix cache holds."),
    ("prefix_cache_inserted_blocks_total", "rollout_prefix_cache_inserted_blocks_total",
     "counter", "Blocks added to the prefix cache."),
    ("prefix_cache_evictions_total", "rollout_prefix_cache_evictions_total", "counter",
     "Blocks evicted from the prefix cache to make room (least recently used first)."),
    ("prefix_cache_invalidations_total", "rollout_prefix_cache_invalidations_total", "counter",
     "Cached blocks dropped because a weight swap made them stale."),
    ("prefix_cache_invalidation_events_total",
     "rollout_prefix_cache_invalidation_events_total", "counter",
     "Weight swaps that invalidated the prefix cache."),
)


def render(snapshot: dict, extra: dict | None = None) -> str:
  """Prometheus text for an `Engine.metrics()` snapshot (+ extra {name: (type, help, value)}).

  A replica set's snapshot (`rollout.replicas.ReplicaSet.metrics`) renders its combined figures
  under the usual names and each replica's under `rollout_replica_*{replica="i"}`: families of
  their own, so that summing a family never counts a replica twice.
  """
  lines = []
  for key, name, kind, help_ in _METRICS:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
              f"{name} {float(snapshot.get(key, 0)):g}"]
  replicas = snapshot.get("replicas") or []
  for key, name, kind, help_ in _METRICS if replicas else ():
    family = "rollout_replica_" + name[len("rollout_"):]
    lines += [f"# HELP {family} {help_} One series per replica.", f"# TYPE {family} {kind}"]
    lines += [f'{family}{{replica="{i}"}} {float(r.get(key, 0)):g}'
              for i, r in enumerate(replicas)]
  for name, (kind, help_, value) in (extra or {}).items():
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
  return "\n".join(lines) + "\n"
