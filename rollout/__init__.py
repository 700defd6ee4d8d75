"""rollout: the JAX sampling server (see rollout/README.md).

Entry points: `rollout.engine.Engine` (in-process `generate` / `submit`, weight swaps),
`rollout.server.Server` (OpenAI-compatible HTTP), `//rollout:server` (the binary).
"""
