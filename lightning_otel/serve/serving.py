"""Serving a trained policy behind the gateway (exporting it is lightning_otel.train.checkpoints).

    lightning-otel serve runs/sql --port 8000 [--db traces.duckdb]

`--model`-style values are resolved by lightning_otel.serve.policy (a run folder means its best checkpoint).
Serve starts vLLM on the base model with the adapter hot-loaded and the OpenAI-compatible gateway in front
of it; every call keeps being recorded as a `lightning.generate` span in the store, so traffic from the
user's own agents can train the next version (`lightning-otel train --offline`).
"""
from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.serve.policy import Policy, resolve_policy

log = logging.getLogger(__name__)


def serve_policy(spec: str, port: int = 8000, db: Path | None = None, python: str | None = None,
                 ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
                 engine: PolicyEngine | None = None) -> None:
    """Serve until `stop` is set (or forever): vLLM + the policy + the gateway on 127.0.0.1:port. An engine
    already running on the policy's base model may be given instead of starting one."""
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.gateway import Gateway, GatewayConfig, template_renders_tools
    from lightning_otel.span_store import discovery
    from lightning_otel.span_store.collector import Collector, private_config

    python = python or default_engine_python()
    policy: Policy = resolve_policy(spec, python)
    with ExitStack() as owned:
        collector_url = collector_token = None
        if db is not None:
            info = discovery.find_collector(db)
            if info is None:
                collector = Collector(private_config(db))
                collector.start()
                owned.callback(collector.close)
                info = collector.info
            collector_url, collector_token = info.url, info.ingest_token
        if engine is None:
            engine = VLLMEngine(EngineConfig(model_dir=policy.base_model, python=python))
            log.info("starting the vLLM engine on %s", policy.base_model)
            engine.start()
            owned.callback(engine.stop)
        if policy.adapter is not None:
            engine.update_weights(policy.adapter, max(policy.version, 1))
        gateway = Gateway(engine, GatewayConfig(port=port, collector_url=collector_url, collector_token=collector_token,
                                                native_tools=template_renders_tools(policy.base_model)))
        gateway.start()
        owned.callback(gateway.close)
        if ready:
            ready(gateway.base_url(None))
        (stop or threading.Event()).wait()
