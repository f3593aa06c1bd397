"""Stand-in engine streams: vLLM's chat stream chunks for given answers, handed out one by one, slowly or
held at a gate, so tests can see what reaches the client before the engine has finished."""
from __future__ import annotations

import threading
import time
from typing import Iterator

PROMPT_IDS = [1, 2, 3]
TOKEN_BASE = 10  # a choice's k-th piece is token TOKEN_BASE + k


def engine_chunks(texts: list[str], piece: int = 3, finish: str = "stop", chunk_id: str = "chatcmpl-engine",
                  logprob: float = -0.5) -> list[dict]:
    """The chunks vLLM streams for one answer per text (choice i answers texts[i]), with return_token_ids,
    logprobs and include_usage: a role chunk per choice with the prompt ids, then one chunk per piece of
    `piece` characters, the choices interleaved, each choice's last piece with its finish reason, then usage."""
    def chunk(choice: dict, **extra) -> dict:
        return {"id": chunk_id, "object": "chat.completion.chunk", "created": 1, "model": "policy",
                "choices": [choice], **extra}

    chunks = [chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}, prompt_token_ids=PROMPT_IDS) for i in range(len(texts))]
    pieces = [[text[k:k + piece] for k in range(0, len(text), piece)] or [""] for text in texts]
    for step in range(max(len(p) for p in pieces)):
        for i, parts in enumerate(pieces):
            if step < len(parts):
                part = parts[step]
                chunks.append(chunk({"index": i, "delta": {"content": part}, "token_ids": [TOKEN_BASE + step],
                                     "logprobs": {"content": [{"token": part, "logprob": logprob,
                                                               "bytes": list(part.encode()), "top_logprobs": []}]},
                                     "finish_reason": finish if step == len(parts) - 1 else None}))
    tokens = sum(len(p) for p in pieces)
    chunks.append({"id": chunk_id, "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": [],
                   "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": tokens,
                             "total_tokens": len(PROMPT_IDS) + tokens}})
    return chunks


class ChunkList:
    """An engine stream over `chunks`, one every `delay_s`. With a `gate`, chunk `gate_at` (default: the last
    piece, before usage) is not produced until the gate is set or `gate_timeout_s` passes; `gate_opened` says
    which. `error` (an EngineError) is raised in place of chunk `error_at`. close() stops it."""

    def __init__(self, chunks: list[dict], delay_s: float = 0.0, gate: threading.Event | None = None,
                 gate_at: int | None = None, gate_timeout_s: float = 10.0, error: Exception | None = None,
                 error_at: int = 0):
        self.chunks, self.delay_s, self.gate, self.gate_timeout_s = chunks, delay_s, gate, gate_timeout_s
        self.gate_at = len(chunks) - 2 if gate_at is None else gate_at
        self.error, self.error_at = error, error_at
        self.gate_opened: bool | None = None
        self.produced = 0
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[dict]:
        for k, chunk in enumerate(self.chunks):
            if self.gate is not None and k == self.gate_at:
                self.gate_opened = self.gate.wait(self.gate_timeout_s)
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.closed.is_set():
                return
            if self.error is not None and k == self.error_at:
                raise self.error
            self.produced += 1
            yield chunk

    def close(self) -> None:
        self.closed.set()
