"""The calculator agent of examples/openai_agents_math, its code unchanged, on the Agents SDK's Chat Completions
provider: the provider its GRPO run recorded in benchmarks/RESULTS.md (2026-12-03) used, before the example
moved to the SDK's default (the Responses API). apo_vs_grpo's math task runs it, so that its arms and that
recorded run see the same requests.

    --agent benchmarks/learning/math_chat_agent.py:run

It only sets the SDK's default API (agents.set_default_openai_api) before the example's `run` builds its
provider; the agent's instructions, tool and settings are the example's.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from agents import set_default_openai_api

AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai_agents_math" / "agent.py"

set_default_openai_api("chat_completions")
_spec = importlib.util.spec_from_file_location("openai_agents_math_agent", AGENT)
agent = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)
run = agent.run
