"""The agent harness: what stands between a policy and a task's sandbox.

Modules: `agent_loop` (multi-turn episodes), `single_turn` (one completion per sample),
`toolcall` (the tool-call text format), `agent_tools` (the agent's tools, run in its sandbox),
`policy` and its backends (`inprocess_policy`, `openai_policy`), `trajectory` (what an episode
produced), `fleet_jobs` (episodes as fleet jobs), and test doubles (`replay_server`, a scripted
HTTP server; `scripted_sampler`, a scripted `generate`). See envs/README.md.
"""
