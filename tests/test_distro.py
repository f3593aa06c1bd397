"""The distro under the real `opentelemetry-instrument`: scripts that know nothing of lightning-otel send
their spans to the collector with our defaults; rollouts, rewards, redaction, a second backend, and loud
instrumentor failures."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_otel.capture import distro
from lightning_otel.span_store import client

BIN = Path(sys.executable).parent
PLAIN_AGENT = textwrap.dedent("""
    # An agent script that knows nothing of lightning-otel: it only uses the OpenTelemetry API.
    import logging
    from opentelemetry import trace
    tracer = trace.get_tracer("my-agent")
    with tracer.start_as_current_span("invoke_agent sql_agent") as agent:
        agent.set_attribute("gen_ai.operation.name", "invoke_agent")
        agent.set_attribute("gen_ai.agent.name", "sql_agent")
        with tracer.start_as_current_span("openai.chat") as chat:
            chat.set_attribute("gen_ai.operation.name", "chat")
            chat.set_attribute("gen_ai.input.messages", '[{"role": "user", "content": "key sk-abc123 please"}]')
    logging.getLogger("agent").warning("done")
    print("SELECT 1")
""")


def run_instrumented(script: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LIGHTNING_OTEL_"))}
    full_env.update(env)
    return subprocess.run([str(BIN / "opentelemetry-instrument"), sys.executable, str(script)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def agent_script(tmp_path: Path) -> Path:
    path = tmp_path / "agent.py"
    path.write_text(PLAIN_AGENT)
    return path


def test_env_defaults_never_override_the_user():
    env = {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "otlp,console"}
    distro.apply_env_defaults(env)
    assert env["OTEL_METRICS_EXPORTER"] == "otlp"  # the user's choice stays
    assert env["OTEL_TRACES_EXPORTER"] == "otlp,console,lightning"  # ours is added beside theirs
    assert env["OTEL_LOGS_EXPORTER"] == "none" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["TRACELOOP_TRACE_CONTENT"] == "true"
    assert env["ENABLE_SENSITIVE_DATA"] == "true"
    fresh: dict[str, str] = {"OTEL_TRACES_EXPORTER": "none"}
    distro.apply_env_defaults(fresh)
    assert fresh["OTEL_TRACES_EXPORTER"] == "lightning"
    with pytest.raises(ValueError, match="LIGHTNING_OTEL_REDACT"):
        distro.redaction_patterns({"LIGHTNING_OTEL_REDACT": "[unclosed"})
    assert [p.pattern for p in distro.redaction_patterns({"LIGHTNING_OTEL_REDACT": '["a+", "b"]'})] == ["a+", "b"]


def test_unchanged_script_sends_spans_to_the_collector(collector, db_path, agent_script):
    result = run_instrumented(agent_script, {
        "LIGHTNING_OTEL_ENDPOINT": collector.url, "OTEL_SERVICE_NAME": "plain-agent",
        "OTEL_RESOURCE_ATTRIBUTES": "lightning.rollout.id=ro-7,lightning.task.id=t-1,lightning.attempt=3"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SELECT 1"
    # The stock defaults would have tried gRPC and metrics/logs exporters; nothing may complain.
    assert "Failed to export" not in result.stderr and "grpc" not in result.stderr.lower()
    rows = client.query("SELECT name, rollout_id, task_id, attempt, service_name FROM spans ORDER BY name",
                        db_path).to_dicts()
    assert rows == [
        {"name": "invoke_agent sql_agent", "rollout_id": "ro-7", "task_id": "t-1", "attempt": 3,
         "service_name": "plain-agent"},
        {"name": "openai.chat", "rollout_id": "ro-7", "task_id": "t-1", "attempt": 3, "service_name": "plain-agent"},
    ]
    assert client.query("SELECT agent FROM llm_calls", db_path)["agent"].to_list() == ["sql_agent"]


@pytest.mark.heavy
def test_user_backend_gets_the_spans_too_and_redaction_applies_to_both(make_collector, tmp_path, agent_script):
    ours = make_collector(db=tmp_path / "ours.duckdb")
    theirs = make_collector(db=tmp_path / "theirs.duckdb")
    result = run_instrumented(agent_script, {
        "LIGHTNING_OTEL_ENDPOINT": ours.url, "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": theirs.url, "LIGHTNING_OTEL_REDACT": r"sk-[A-Za-z0-9]+"})
    assert result.returncode == 0, result.stderr
    for db in (tmp_path / "ours.duckdb", tmp_path / "theirs.duckdb"):
        messages = client.query("SELECT attr(attributes, 'gen_ai.input.messages') AS m FROM spans "
                                "WHERE name = 'openai.chat'", db)["m"].to_list()
        assert messages == ['[{"role": "user", "content": "key [REDACTED] please"}]'], db


@pytest.mark.heavy
def test_in_process_rollouts_and_emitted_rewards(collector, db_path, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import lightning_otel
        from opentelemetry import trace
        tracer = trace.get_tracer("loop")
        for i, task in enumerate(["q1", "q2"]):
            with lightning_otel.rollout(task_id=task, rollout_id=f"ro-{task}", attempt=i):
                with tracer.start_as_current_span("tool execute_sql") as tool:
                    lightning_otel.emit_reward(-0.5, name="tool_error")
                with tracer.start_as_current_span("openai.chat"):
                    pass
                lightning_otel.emit_reward(1.0 if task == "q1" else 0.0, name="exec_match")
    """))
    result = run_instrumented(script, {"LIGHTNING_OTEL_ENDPOINT": collector.url})
    assert result.returncode == 0, result.stderr
    spans = client.query("SELECT rollout_id, task_id, attempt, count(*) AS n FROM spans GROUP BY ALL ORDER BY 1",
                         db_path).to_dicts()
    assert spans == [{"rollout_id": "ro-q1", "task_id": "q1", "attempt": 0, "n": 5},
                     {"rollout_id": "ro-q2", "task_id": "q2", "attempt": 1, "n": 5}]
    rewards = client.query(
        "SELECT r.rollout_id, r.name, r.value, r.source, s.name AS target FROM rewards r "
        "JOIN spans s ON s.trace_id = r.trace_id AND s.span_id = r.span_id ORDER BY 1, 2", db_path).to_dicts()
    assert rewards == [
        {"rollout_id": "ro-q1", "name": "exec_match", "value": 1.0, "source": "emitted", "target": "lightning.rollout"},
        {"rollout_id": "ro-q1", "name": "tool_error", "value": -0.5, "source": "emitted", "target": "tool execute_sql"},
        {"rollout_id": "ro-q2", "name": "exec_match", "value": 0.0, "source": "emitted", "target": "lightning.rollout"},
        {"rollout_id": "ro-q2", "name": "tool_error", "value": -0.5, "source": "emitted", "target": "tool execute_sql"},
    ]


def test_rewards_are_stored_once_when_the_exporter_resends(collector, db_path, tmp_path):
    from conftest import post
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=b"\x01" * 16, span_id=b"\x02" * 8, parent_span_id=b"\x03" * 8, name="lightning.reward")
    for key, value in (("lightning.reward.name", "r"), ("lightning.rollout.id", "ro-x")):
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, value
    kv = span.attributes.add()
    kv.key, kv.value.double_value = "lightning.reward.value", 0.25
    for _ in range(3):
        assert post(collector.url + "/v1/traces", request.SerializeToString())[0] == 200
    rows = client.query("SELECT rollout_id, span_id, value FROM rewards", db_path).to_dicts()
    assert rows == [{"rollout_id": "ro-x", "span_id": "03" * 8, "value": 0.25}]


def test_rollout_and_reward_arguments_are_checked():
    import lightning_otel
    with pytest.raises(ValueError, match="finite"):
        lightning_otel.emit_reward(float("nan"))
    with pytest.raises(ValueError, match="attempt"):
        with lightning_otel.rollout(task_id="t", attempt=-1):
            pass


@pytest.mark.heavy
def test_an_instrumentor_that_fails_quietly_is_reported(collector, tmp_path, agent_script):
    """A real entry point (a .dist-info on the path) whose instrumentor only logs its failure at DEBUG."""
    site = tmp_path / "site"
    dist = site / "quiet_instrumentor-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quiet-instrumentor\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[opentelemetry_instrumentor]\nquiet = quiet_instrumentor:Quiet\n")
    (site / "quiet_instrumentor.py").write_text(textwrap.dedent("""
        import logging
        from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
        log = logging.getLogger("opentelemetry.instrumentation.quiet")
        class Quiet(BaseInstrumentor):
            def instrumentation_dependencies(self):
                return ["packaging >= 1"]
            def _instrument(self, **kwargs):
                log.debug("Failed to wrap Graph.invoke: module 'langchain' has no attribute 'x'")
            def _uninstrument(self, **kwargs):
                pass
    """))
    result = run_instrumented(agent_script, {"LIGHTNING_OTEL_ENDPOINT": collector.url, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    assert "instrumentation reported a failure" in result.stderr
    assert "Failed to wrap Graph.invoke" in result.stderr



@pytest.mark.heavy
def test_run_command_with_explicit_flags(make_collector, tmp_path, agent_script):
    make_collector(token="tok")
    db = tmp_path / "traces.duckdb"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LIGHTNING_OTEL_"))}
    result = subprocess.run([str(BIN / "lightning-otel"), "run", "--db", str(db), "--rollout-id", "ro-run",
                             "--task-id", "t9", "--attempt", "1", "--redact", "sk-[a-z0-9]+", "--",
                             sys.executable, str(agent_script)], env=full_env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    rows = client.query("SELECT DISTINCT rollout_id, task_id, attempt FROM spans", db).to_dicts()
    assert rows == [{"rollout_id": "ro-run", "task_id": "t9", "attempt": 1}]
    assert "[REDACTED]" in client.query("SELECT attr(attributes, 'gen_ai.input.messages') AS m FROM spans "
                                        "WHERE name = 'openai.chat'", db)["m"][0]
    missing = subprocess.run([str(BIN / "lightning-otel"), "run", "--", "no-such-command-xyz"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "command not found" in missing.stderr


@pytest.mark.heavy
def test_an_allow_list_loads_only_the_named_instrumentations(collector, tmp_path):
    installed = distro.installed_instrumentations()
    assert {"openai", "langchain"} <= set(installed)  # both ship with the test environment
    env = {"LIGHTNING_OTEL_INSTRUMENTATIONS": " openai "}
    distro.apply_env_defaults(env)
    assert env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] == ",".join(sorted(set(installed) - {"openai"}))
    mine = {"LIGHTNING_OTEL_INSTRUMENTATIONS": "openai", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "openai"}
    distro.apply_env_defaults(mine)
    assert mine["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] == "openai"  # the user's own list wins
    script = tmp_path / "which.py"
    script.write_text(textwrap.dedent("""
        import sys
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor
        print(OpenAIInstrumentor().is_instrumented_by_opentelemetry, "langchain_core" in sys.modules)
    """))
    base = {"LIGHTNING_OTEL_ENDPOINT": collector.url}
    assert run_instrumented(script, base).stdout.split() == ["True", "True"]
    only = run_instrumented(script, {**base, "LIGHTNING_OTEL_INSTRUMENTATIONS": "openai"})
    assert only.stdout.split() == ["True", "False"], only.stderr


@pytest.mark.heavy
def test_run_keeps_resource_attributes_with_commas_and_equals_intact(make_collector, tmp_path, agent_script):
    # OTEL_RESOURCE_ATTRIBUTES is a comma-separated key=value list: an unencoded `a,b` became two attributes.
    make_collector(token="tok")
    db = tmp_path / "traces.duckdb"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LIGHTNING_OTEL_"))}
    env["OTEL_RESOURCE_ATTRIBUTES"] = "deployment.environment=test"
    result = subprocess.run([str(BIN / "lightning-otel"), "run", "--db", str(db), "--rollout-id", "ro=1 %",
                             "--task-id", "a,b", "--", sys.executable, str(agent_script)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = client.query("SELECT DISTINCT rollout_id, task_id, attr(resource, 'deployment.environment') AS e "
                        "FROM spans", db).to_dicts()
    assert rows == [{"rollout_id": "ro=1 %", "task_id": "a,b", "e": "test"}]
