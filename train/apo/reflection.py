"""The reflection model: any OpenAI-compatible chat endpoint, as the callable GEPA asks for new instructions.

GEPA renders a prompt (the current instruction, the reflective dataset, the request for a better instruction in a
``` block) and calls the model with it; the answer's block becomes the new text. By default the served policy
itself reflects, straight through the engine (no gateway, so its calls are no rollout's): weak for a small model,
but the path is the same as with a strong one. Every answer is kept in the run folder (`reflections.jsonl`, by
the prompt's hash), so a rerun after a stop asks nothing twice and proposes the same texts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)


class ReflectionModel:
    """gepa's LanguageModel protocol: `model(prompt) -> text`, over an OpenAI-compatible endpoint."""

    def __init__(self, base_url: str, model: str = "", api_key: str | None = None, max_tokens: int = 512,
                 temperature: float = 0.7, cache: Path | None = None, timeout_s: float = 600.0):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=1)
        self.base_url, self.model = base_url, model
        self.max_tokens, self.temperature = max_tokens, temperature
        self.cache_path = cache
        self.answers: dict[str, str] = {}
        self.calls = 0  # calls this process made (not read back)
        self._lock = threading.Lock()
        if cache is not None and cache.is_file():
            for line in cache.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line a kill cut short
                self.answers[row["prompt_sha256"]] = row["answer"]

    def _model_name(self) -> str:
        if not self.model:
            try:
                listed = self.client.models.list().data
            except Exception as exc:  # noqa: BLE001 - any failure here is the endpoint's, said plainly
                raise UserError(f"reflection endpoint {self.base_url}: cannot list its models ({exc}); give "
                                f"reflection_model") from None
            if not listed:
                raise UserError(f"reflection endpoint {self.base_url} serves no model; give reflection_model")
            self.model = listed[0].id
        return self.model

    def __call__(self, prompt: str | list[dict[str, Any]]) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        if digest in self.answers:
            return self.answers[digest]
        try:
            reply = self.client.chat.completions.create(model=self._model_name(), messages=messages,
                                                        max_tokens=self.max_tokens, temperature=self.temperature)
        except UserError:
            raise
        except Exception as exc:  # GEPA skips the step; say why here, where people look
            log.warning("reflection model %s at %s failed (%s): this step proposes nothing", self.model,
                        self.base_url, exc)
            raise
        answer = reply.choices[0].message.content or ""
        with self._lock:
            self.calls += 1
            self.answers[digest] = answer
            if self.cache_path is not None:
                with self.cache_path.open("a") as f:
                    f.write(json.dumps({"prompt_sha256": digest, "model": self.model, "answer": answer}) + "\n")
        log.info("reflection (%s): %d characters back", self.model, len(answer))
        return answer


def reflection_model(url: str, model: str, api_key_env: str, max_tokens: int, temperature: float,
                     cache: Path) -> ReflectionModel:
    """The configured endpoint; its key from the environment variable `api_key_env` (none needed locally)."""
    return ReflectionModel(url, model, os.environ.get(api_key_env) if api_key_env else None, max_tokens,
                           temperature, cache)


__all__ = ["ReflectionModel", "reflection_model"]
