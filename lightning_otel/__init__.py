"""lightning-otel: reinforcement learning for existing LLM agents, from their OpenTelemetry traces.

This core module is what an agent process may import: it must stay light (no duckdb, no torch).
"""
__version__ = "0.1.0"
