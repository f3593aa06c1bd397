"""Floor 0, the agent side: what runs inside the user's agent process.

The OpenTelemetry distro (`opentelemetry-instrument` picks it up), the rollout context (`rollout()`,
`emit_reward`), agent functions' `LLM` handle and the worker that calls them. It stays light: no duckdb,
no torch, nothing from a higher floor.
"""
