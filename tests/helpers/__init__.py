"""What several tests share, imported as `tests.helpers.<module>` (pyproject.toml's pytest `pythonpath` puts the
repository root on sys.path; a bare `helpers` would stand for any test's own helpers module):

- sdk: real OpenTelemetry SDK pipelines pointed at a collector;
- otlp_json: OTLP protobuf requests as OTLP/JSON;
- inprocess_agents: agent functions for the runner's worker (by file, or `tests.helpers.inprocess_agents:NAME`);
- train_rewards: rewards and a task pack for the trainer and runner tests (`tests.helpers.train_rewards:NAME`);
- examples: the repository's examples as modules;
- streams: stand-in engine streams (vLLM's chat chunks, slow or held at a gate) for the gateway's streaming;
- no_engine_python: the engine's Python under `make test-fast`, a stub that fails.
"""
