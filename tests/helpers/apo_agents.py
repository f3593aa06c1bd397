"""An agent function and rewards for tests/test_optimize.py: one model call with a fixed system message, whose
answer a reward can judge by a word the instruction asks for."""
from __future__ import annotations

SYSTEM = "You are a helpful assistant. Answer the question briefly."


def answer(task: dict, llm) -> str:
    """One chat call with the agent's own system message; the final output is the answer on one line."""
    reply = llm.openai().chat.completions.create(
        model=llm.model, max_tokens=12,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}])
    return " ".join((reply.choices[0].message.content or "").split())


def says_banana(task: dict, rollout: dict) -> float:
    """1 when the final answer contains the word banana (any case): easy to get by asking for it."""
    return float("banana" in (rollout.get("final_output") or "").lower())
