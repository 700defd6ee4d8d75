"""rollout: the JAX sampling server (see rollout/README.md).

Entry points: `rollout.engine.Engine` (in-process `generate` / `submit`, weight swaps),
`rollout.server.Server` (OpenAI-compatible HTTP), `rollout.loading.load_engine` (what the
`//tools:serve` binary runs: entry points and gin live in tools/).
"""
