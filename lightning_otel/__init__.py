"""lightning-otel: reinforcement learning for existing LLM agents, from their OpenTelemetry traces.

This core module is what an agent process may import: it must stay light (no duckdb, no torch).
"""
from lightning_otel.capture.agent_fn import LLM
from lightning_otel.capture.context import emit_reward, rollout

__version__ = "0.1.0"
__all__ = ["LLM", "emit_reward", "rollout", "__version__"]
