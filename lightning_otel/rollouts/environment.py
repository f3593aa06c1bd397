"""The environment an agent process gets, in one place: `lightning-otel run` (one command by hand) and the
rollout runner (one process or worker per rollout) build it here, so both select our distro the same way and
encode the rollout's resource attributes the same way.

What an agent gets (docs/design.md, contracts): our distro selected explicitly (OTEL_PYTHON_DISTRO and
OTEL_PYTHON_CONFIGURATOR, in case another distro is installed), the collector's address and token, and
OTEL_RESOURCE_ATTRIBUTES carrying lightning.rollout.id, lightning.task.id and lightning.attempt, with values
percent-encoded as the OpenTelemetry specification says (a task id such as `a,b` or `x=y` survives). The
runner adds the gateway's per-rollout OPENAI_BASE_URL, an API key and LIGHTNING_MODEL.
"""
from __future__ import annotations

import json
import os
import urllib.parse
from typing import Mapping

DISTRO = {"OTEL_PYTHON_DISTRO": "lightning_otel", "OTEL_PYTHON_CONFIGURATOR": "lightning_otel"}


def resource_attributes(existing: str | None, extra: Mapping[str, str | None]) -> str:
    """OTEL_RESOURCE_ATTRIBUTES with ours added (values percent-encoded; None values left out)."""
    ours = ",".join(f"{k}={urllib.parse.quote(v, safe='')}" for k, v in extra.items() if v is not None)
    return ",".join(filter(None, [existing, ours]))


def rollout_attributes(rollout_id: str | None, task_id: str | None, attempt: int | None) -> dict[str, str | None]:
    return {"lightning.rollout.id": rollout_id, "lightning.task.id": task_id,
            "lightning.attempt": None if attempt is None else str(attempt)}


def capture_environment(base: Mapping[str, str], endpoint: str | None = None, token: str | None = None, *,
                        redact: list[str] | None = None, service_name: str | None = None,
                        rollout_id: str | None = None, task_id: str | None = None,
                        attempt: int | None = None) -> dict[str, str]:
    """`base` with our distro selected, spans sent to `endpoint` with `token`, and the rollout's ids as resource
    attributes. A token already in `base` is kept only when no `token` is given."""
    env = dict(base)
    env.update(DISTRO)
    if endpoint:
        env["LIGHTNING_OTEL_ENDPOINT"] = endpoint
    if token:
        env["LIGHTNING_OTEL_TOKEN"] = token
    if redact:
        env["LIGHTNING_OTEL_REDACT"] = json.dumps(redact)
    if service_name:
        env["OTEL_SERVICE_NAME"] = service_name
    attributes = resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES"),
                                     rollout_attributes(rollout_id, task_id, attempt))
    if attributes:
        env["OTEL_RESOURCE_ATTRIBUTES"] = attributes
    return env


def agent_environment(base_url: str, collector_url: str, collector_token: str | None, api_key: str | None,
                      model_name: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every agent process of a rollout run gets, less the per-rollout resource attributes.
    `collector_token` is the collector's ingest token (runner.agent_token()): with it an agent sends spans, and
    cannot query the store or write records such as its own reward; a token in the runner's own environment
    is not passed on."""
    env = dict(os.environ if base is None else base)
    env.pop("LIGHTNING_OTEL_TOKEN", None)
    env.update({
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key or env.get("OPENAI_API_KEY") or "lightning-otel",
        "LIGHTNING_MODEL": model_name,
    })
    return capture_environment(env, collector_url, collector_token)
