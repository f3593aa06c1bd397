"""An agent function and rewards for tests/test_optimize.py: one model call with a fixed system message, whose
answer a reward can judge by a word the instruction asks for."""
from __future__ import annotations

from tests.helpers.loopback import LoopbackServer, QuietHandler

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


class StandInReflector:
    """A tiny OpenAI-compatible chat server on 127.0.0.1 that answers every reflection prompt with one fixed
    instruction (a strong reflection model cannot run here; tests/test_optimize.py says why)."""

    def __init__(self, answer: str):
        self.prompts: list[str] = []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = self.json_body()
                outer.prompts.append(body["messages"][-1]["content"])
                self.answer(200, {"id": "r", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                      "role": "assistant", "content": f"Here it is:\n```\n{answer}\n```"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = LoopbackServer(Handler, "/v1")
        self.url = self.server.url

    def close(self):
        self.server.close()
