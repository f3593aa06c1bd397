"""Serving a trained policy behind the gateway (exporting it is lightning_otel.train.checkpoints).

    lightning-otel serve runs/sql --port 8000 [--db traces.duckdb]

`--model`-style values are resolved by lightning_otel.serve.policy (a run folder means its best checkpoint).
Serve starts vLLM on the base model with the adapter hot-loaded and the OpenAI-compatible gateway in front
of it; every call keeps being recorded as a `lightning.generate` span in the store, so traffic from the
user's own agents can train the next version (`lightning-otel train --offline`).
"""
from __future__ import annotations

import json
import logging
import threading
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Callable

from lightning_otel.errors import UserError
from lightning_otel.serve.engine import EngineConfig, EngineError, PolicyEngine, VLLMEngine, default_engine_python
from lightning_otel.serve.policy import Policy, resolve_policy

log = logging.getLogger(__name__)


def adapter_rank(adapter: Path) -> int:
    return int(json.loads((adapter / "adapter_config.json").read_text()).get("r", 8))


def engine_for_policy(policy: Policy, engine: PolicyEngine | None, owned: ExitStack, python: str | None = None,
                      log_path: Path | None = None) -> PolicyEngine:
    """The engine serving `policy` (eval, rollout, serve): the one given (switched to the policy, back on its
    own base model when a trainer left it on merged weights, its policy restored when `owned` closes), or one
    started here on the policy's base model and stopped when `owned` closes."""
    adapters = [policy.adapter] if policy.adapter else list(policy.adapters.values())
    rank = max([adapter_rank(a) for a in adapters] or [8])
    if engine is None:
        engine = VLLMEngine(EngineConfig(model_dir=policy.base_model, python=python or default_engine_python(),
                                         max_lora_rank=max(16, rank), log_path=log_path,
                                         max_loras=max(1, len(policy.adapters))))
        log.info("starting the vLLM engine on %s (about a minute on CPU)", policy.base_model)
        engine.start()
        owned.callback(engine.stop)
    else:
        wanted = policy.base_model.resolve()
        if policy.merged is not None and Path(engine.config.model_dir).resolve() == policy.merged:
            # The trainer left the engine on this checkpoint's merged weights: the same function as base +
            # adapter, and faster to decode on CPU than LoRA.
            engine.model_name, engine.policy_version = engine.base_name, policy.version
            return engine
        if Path(engine.config.model_dir).resolve() != wanted and \
                Path(engine.base_dir).resolve() == wanted:
            engine.use_base()  # a trainer moved it to merged weights (serve_merged): back to its base model
        served = Path(engine.config.model_dir).resolve()
        if served != wanted:
            raise UserError(f"the running engine serves {served}, but policy {policy.label} needs model "
                            f"{policy.base_model}; let the command start its own engine (or load_model() it first)")
        if adapters and rank > engine.config.max_lora_rank:
            raise UserError(f"policy {policy.label} has an adapter of rank {rank}, above the running engine's "
                            f"max_lora_rank {engine.config.max_lora_rank}")
        previous = (engine.model_name, engine.policy_version, engine.adapters)

        def restore() -> None:
            if Path(engine.config.model_dir).resolve() == served:
                engine.model_name, engine.policy_version, engine.adapters = previous

        owned.callback(restore)
    if policy.adapters:
        try:
            engine.update_adapters(policy.adapters, policy.version)
        except EngineError as exc:
            raise UserError(f"the engine could not load the adapters {sorted(policy.adapters)} of {policy.label} "
                            f"as policy version {policy.version}: {exc}") from None
    elif policy.adapter is not None:
        try:
            engine.update_weights(policy.adapter, policy.version)
        except EngineError as exc:
            raise UserError(f"the engine could not load the LoRA adapter {policy.adapter} as policy version "
                            f"{policy.version}: {exc}") from None
    else:  # the weights the engine runs, as they are (no adapter)
        engine.model_name, engine.policy_version = engine.base_name, policy.version
    return engine


def serve_policy(spec: str, port: int = 8000, db: Path | None = None, python: str | None = None,
                 ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
                 engine: PolicyEngine | None = None, chat_template: Path | None = None, host: str = "127.0.0.1",
                 api_key: str | None = None, insecure_no_auth: bool = False, tool_format: str | None = None,
                 prompt: Path | None = None, base_url: str | None = None, base_model: str | None = None,
                 api_key_env: str | None = None) -> None:
    """Serve until `stop` is set (or forever): vLLM + the policy + the gateway on host:port. An engine
    already running on the policy's base model may be given instead of starting one. `chat_template`: a Jinja
    file the gateway renders prompts with instead of the model's own template. `tool_format`: the call syntax
    (toolcalls.FORMATS; None: detected from the template). `api_key`: the key requests must send; a host other
    machines reach needs one (or `insecure_no_auth`), which is checked before anything starts. `prompt`: a prompt
    patch file (prompts.py) applied to the calls of the agents it targets. `base_url`: no policy and no engine:
    every call goes to that outside OpenAI-compatible endpoint (a closed model) with the patch applied and is
    recorded as text (forward.py); `base_model` names its model, `api_key_env` the variable holding its key."""
    from lightning_otel.serve.chat_tools import read_chat_template, template_tools
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.serve.prompts import load_patches
    from lightning_otel.span_store import discovery
    from lightning_otel.span_store.collector import Collector, private_config

    python = python or default_engine_python()
    template = read_chat_template(chat_template) if chat_template is not None else None
    # checked before anything starts
    settings = GatewayConfig(host=host, port=port, api_key=api_key, insecure_no_auth=insecure_no_auth,
                             chat_template=template, tool_format=tool_format,
                             prompts=load_patches(prompt) if prompt is not None else None,
                             forward_url=base_url, forward_model=base_model, forward_api_key_env=api_key_env)
    if base_url is not None and (spec or engine is not None or tool_format is not None):
        raise UserError("--base-url serves an outside endpoint: give no policy, engine or --tool-format with it")
    if base_url is None and not spec:
        raise UserError("give the policy to serve (base, a run folder, a checkpoint, a model folder or a hub id), "
                        "or --base-url for an outside endpoint")
    if base_url is None and (base_model is not None or api_key_env is not None):
        raise UserError("--base-model and --api-key-env are for an outside endpoint: give --base-url with them")
    policy: Policy | None = resolve_policy(spec, python) if base_url is None else None
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
        settings = replace(settings, collector_url=collector_url, collector_token=collector_token)
        if policy is None:
            gateway = Gateway(None, settings)
        else:
            engine = engine_for_policy(policy, engine, owned, python)
            tools = template_tools(policy.base_model, template, tool_format)
            gateway = Gateway(engine, replace(settings, native_tools=tools.native, tool_format=tools.format,
                                              adapters=dict(policy.routes)), engine.gate)
        gateway.start()
        owned.callback(gateway.close)
        if ready:
            ready(gateway.base_url(None))
        (stop or threading.Event()).wait()
