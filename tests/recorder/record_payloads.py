#!/usr/bin/env python3
"""Record real OpenTelemetry instrumentation output as OTLP test fixtures.

Run with the recorder venv's python (only the standard library and, for the JSON
conversion, ``opentelemetry-proto`` are needed in the process that runs this file):

    /work/venvs/rec-main/bin/python tests/recorder/record_payloads.py --setup
    /work/venvs/rec-main/bin/python tests/recorder/record_payloads.py --out tests/fixtures/otlp [--only NAME]

In-process, on 127.0.0.1 with ephemeral ports, it starts

* an OpenAI-compatible chat-completions stub (``/v1/chat/completions``, plain and SSE
  streaming) that answers a ``tool_calls`` message when tools are offered and no tool
  result is in the conversation yet, and a text answer otherwise.  It logs the
  ``traceparent`` header of every request;
* an OTLP/HTTP sink that keeps every request body on ``/v1/traces`` and ``/v1/logs``
  byte-for-byte and answers 200 with an empty (protobuf) export response.

Each scenario's agent script (``tests/recorder/agents/``) then runs as a subprocess
under ``opentelemetry-instrument`` in its own venv, pointed at both servers.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENTS = HERE / "agents"
VENV_ROOT = Path(os.environ.get("LIGHTNING_OTEL_RECORDER_VENVS", "/work/venvs"))

# --------------------------------------------------------------------------- venvs and pins

OTEL_CORE = [
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-proto==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-distro==0.66b2",
    "opentelemetry-instrumentation==0.66b2",
]

VENVS: dict[str, list[str]] = {
    # openai SDK, LangGraph and AutoGen with the Traceloop openai + langchain instrumentations.
    "rec-main": OTEL_CORE
    + [
        "opentelemetry-instrumentation-openai==0.62.4",
        "opentelemetry-instrumentation-langchain==0.62.4",
        "openai==3.57.0",
        "langchain-openai==1.7.4",
        "langchain-core==1.8.3",
        "langchain==1.5.2",  # the Traceloop langchain instrumentor only activates when `langchain` is installed
        "langgraph==1.2.24",
        "autogen-agentchat==0.7.5",
        "autogen-core==0.7.5",
        "autogen-ext[openai]==0.7.5",
    ],
    # CrewAI pins openai<3, so it gets its own venv.
    "rec-crewai": OTEL_CORE
    + [
        "opentelemetry-instrumentation-openai==0.62.4",
        "opentelemetry-instrumentation-crewai==0.62.4",
        "crewai==1.15.30",
    ],
    # The OpenAI Agents SDK (its Traceloop instrumentation) and Microsoft Agent Framework (which emits its own
    # GenAI spans through opentelemetry-api), both over the openai SDK with the Traceloop openai instrumentation.
    "rec-agents": OTEL_CORE
    + [
        "opentelemetry-instrumentation-openai==0.62.4",
        "opentelemetry-instrumentation-openai-agents==0.62.4",
        "openai==3.57.0",
        "openai-agents==0.24.0",
        "agent-framework-core==1.23.0",
        "agent-framework-openai==1.17.0",
    ],
    # The official (OpenTelemetry contrib) openai-v2 instrumentation emits GenAI log records.
    # It registers the same entry-point name ("openai") as Traceloop's, so it gets its own venv.
    "rec-logs": OTEL_CORE
    + [
        "opentelemetry-instrumentation-openai-v2==2.4b0",
        "opentelemetry-util-genai==1.1b0",
        "openai==2.54.0",
        "httpx==0.28.1",
    ],
}


@dataclass
class Scenario:
    name: str
    venv: str
    script: str
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""


SCENARIOS: list[Scenario] = [
    Scenario("openai_plain", "rec-main", "openai_plain.py",
             description="openai SDK, non-streaming, one tool-call round (2 chat calls)"),
    Scenario("openai_stream", "rec-main", "openai_stream.py",
             description="openai SDK, SSE streaming with include_usage, one tool-call round"),
    Scenario("langgraph", "rec-main", "langgraph_agent.py",
             description="LangGraph write_query -> execute_query -> answer with ChatOpenAI + @tool"),
    Scenario("autogen", "rec-main", "autogen_agent.py",
             env={"AUTOGEN_DISABLE_RUNTIME_TRACING": "true"},
             description="autogen-agentchat AssistantAgent with a function tool, reflect_on_tool_use"),
    Scenario("crewai", "rec-crewai", "crewai_agent.py",
             env={
                 "CREWAI_DISABLE_TELEMETRY": "true",
                 "CREWAI_DISABLE_TRACKING": "true",
                 "CREWAI_TRACING_ENABLED": "false",
                 "CREWAI_DISABLE_VERSION_CHECK": "true",
             },
             description="CrewAI crew, one agent with one tool, one task"),
    Scenario("openai_agents", "rec-agents", "openai_agents_agent.py",
             description="OpenAI Agents SDK Agent with a function tool over chat completions"),
    Scenario("agent_framework", "rec-agents", "agent_framework_agent.py",
             env={"ENABLE_SENSITIVE_DATA": "true"},
             description="Microsoft Agent Framework Agent with a function tool over chat completions"),
    Scenario("genai_logs", "rec-logs", "openai_plain.py",
             env={
                 "OTEL_LOGS_EXPORTER": "otlp",
                 "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "event_only",
             },
             description="plain openai agent under opentelemetry-instrumentation-openai-v2 (logs + spans)"),
]


def venv_python(venv: str) -> Path:
    return VENV_ROOT / venv / "bin" / "python"


def setup_venvs(only: str | None) -> None:
    for name, pins in VENVS.items():
        if only and name != only:
            continue
        path = VENV_ROOT / name
        print(f"[setup] {path}", flush=True)
        if not (path / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
            subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"],
                           check=True)
        # Transitive versions are held to the `pip freeze` of the verified venv, when there is one.
        constraints = HERE / "constraints" / f"{name}.txt"
        extra = ["-c", str(constraints)] if constraints.exists() else []
        # One install at a time: the machine is small and shared.
        subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", *extra, *pins], check=True)


# --------------------------------------------------------------------------- chat-completions stub

def _rand_id(prefix: str, n: int) -> str:
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(random.choice(alphabet) for _ in range(n))


def _approx_tokens(obj) -> int:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return max(1, len(text) // 4)


SQL = "SELECT COUNT(*) FROM singer"


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _count_from(text: str) -> str:
    m = re.search(r"\d+", text or "")
    return m.group(0) if m else "some"


def plan_answer(req: dict) -> dict:
    """Decide what the stub answers: {'kind': 'tool'|'text', ...}."""
    messages = req.get("messages") or []
    tools = req.get("tools") or []
    tool_results = [m for m in messages if m.get("role") in ("tool", "function")]
    if tools and not tool_results:
        fn = tools[0].get("function", {}).get("name", "execute_sql")
        for t in tools:
            name = t.get("function", {}).get("name", "")
            if "sql" in name.lower():
                fn = name
                break
        return {"kind": "tool", "name": fn, "arguments": json.dumps({"query": SQL})}
    if tool_results:
        n = _count_from(_text_of(tool_results[-1].get("content")))
        return {"kind": "text", "content": f"There are {n} singers."}
    # ReAct-style prompting (no native tools): follow the Thought/Action/Observation format.
    joined = "\n".join(_text_of(m.get("content")) for m in messages)
    if "Action Input" in joined or "Final Answer" in joined:
        if "Observation:" in joined.split("Action Input", 1)[-1]:
            n = _count_from(joined.rsplit("Observation:", 1)[-1])
            return {"kind": "text",
                    "content": f"Thought: I now know the final answer\nFinal Answer: There are {n} singers."}
        return {"kind": "text",
                "content": "Thought: I should count the rows of the singer table.\nAction: execute_sql\n"
                           f"Action Input: {json.dumps({'query': SQL})}"}
    return {"kind": "text", "content": "There are 3 singers."}


class RecorderState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.scenario = "none"
        self.traceparents: list[str | None] = []
        self.chat_requests: list[dict] = []
        self.trace_bodies: list[bytes] = []
        self.log_bodies: list[bytes] = []
        self.other_paths: list[str] = []

    def reset(self, scenario: str) -> None:
        with self.lock:
            self.scenario = scenario
            self.traceparents = []
            self.chat_requests = []
            self.trace_bodies = []
            self.log_bodies = []
            self.other_paths = []


STATE = RecorderState()


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):  # noqa: D401 - keep the console readable
        if os.environ.get("RECORDER_VERBOSE"):
            super().log_message(fmt, *args)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return b""

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ChatStubHandler(QuietHandler):
    def do_GET(self):  # /v1/models, for clients that probe it
        if self.path.rstrip("/").endswith("/models"):
            body = {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "created": 1721172741,
                                                "owned_by": "system"}]}
            self._send(200, json.dumps(body).encode(), "application/json")
        else:
            self._send(404, b'{"error": {"message": "not found"}}', "application/json")

    def do_POST(self):
        raw = self._body()
        if not self.path.rstrip("/").endswith("/chat/completions"):
            with STATE.lock:
                STATE.other_paths.append(self.path)
            self._send(404, b'{"error": {"message": "not found"}}', "application/json")
            return
        req = json.loads(raw or b"{}")
        with STATE.lock:
            STATE.traceparents.append(self.headers.get("traceparent"))
            STATE.chat_requests.append(req)
        plan = plan_answer(req)
        model = req.get("model") or "gpt-4o-mini"
        if model == "gpt-4o-mini":
            model = "gpt-4o-mini-2024-07-18"
        cid = _rand_id("chatcmpl-", 29)
        created = int(time.time())
        fingerprint = "fp_" + "".join(random.choice("0123456789abcdef") for _ in range(10))
        prompt_tokens = _approx_tokens(req.get("messages")) + (_approx_tokens(req["tools"]) if req.get("tools") else 0)
        if plan["kind"] == "tool":
            call_id = _rand_id("call_", 24)
            message = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                       "tool_calls": [{"id": call_id, "type": "function",
                                       "function": {"name": plan["name"], "arguments": plan["arguments"]}}]}
            finish = "tool_calls"
            completion_tokens = _approx_tokens(plan["arguments"]) + 8
        else:
            message = {"role": "assistant", "content": plan["content"], "refusal": None, "annotations": []}
            finish = "stop"
            completion_tokens = _approx_tokens(plan["content"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                 "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                               "accepted_prediction_tokens": 0,
                                               "rejected_prediction_tokens": 0}}
        if not req.get("stream"):
            body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                    "usage": usage, "service_tier": "default", "system_fingerprint": fingerprint}
            self._send(200, json.dumps(body).encode(), "application/json")
            return
        self._stream(req, cid, created, model, fingerprint, message, finish, usage)

    def _stream(self, req, cid, created, model, fingerprint, message, finish, usage):
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(delta, finish_reason=None, with_usage=False, choices=True):
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "service_tier": "default", "system_fingerprint": fingerprint,
                   "choices": ([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
                               if choices else [])}
            if include_usage:
                obj["usage"] = usage if with_usage else None
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        chunk({"role": "assistant", "content": "" if not message.get("tool_calls") else None,
               "refusal": None})
        if message.get("tool_calls"):
            tc = message["tool_calls"][0]
            args = tc["function"]["arguments"]
            chunk({"tool_calls": [{"index": 0, "id": tc["id"], "type": "function",
                                   "function": {"name": tc["function"]["name"], "arguments": ""}}]})
            for i in range(0, len(args), 8):
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[i:i + 8]}}]})
        else:
            for piece in re.findall(r"\S+\s*", message["content"]):
                chunk({"content": piece})
        chunk({}, finish_reason=finish)
        if include_usage:
            chunk(None, with_usage=True, choices=False)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


# --------------------------------------------------------------------------- OTLP/HTTP sink

class OtlpSinkHandler(QuietHandler):
    def do_POST(self):
        raw = self._body()
        enc = (self.headers.get("Content-Encoding") or "").lower()
        if enc not in ("", "identity"):
            print(f"[sink] WARNING: body with Content-Encoding={enc}; set OTEL_EXPORTER_OTLP_COMPRESSION=none",
                  file=sys.stderr)
        path = self.path.split("?", 1)[0].rstrip("/")
        with STATE.lock:
            if path.endswith("/v1/traces"):
                STATE.trace_bodies.append(raw)
            elif path.endswith("/v1/logs"):
                STATE.log_bodies.append(raw)
            else:
                STATE.other_paths.append(self.path)
        # An empty Export*ServiceResponse serialises to zero bytes.
        self._send(200, b"", "application/x-protobuf")


def start_server(handler) -> tuple[ThreadingHTTPServer, int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


# --------------------------------------------------------------------------- OTLP protobuf -> OTLP/JSON

_ID_KEYS = {"traceId", "spanId", "parentSpanId"}


def _ids_to_hex(node):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _ID_KEYS and isinstance(v, str):
                out[k] = base64.b64decode(v).hex()
            else:
                out[k] = _ids_to_hex(v)
        return out
    if isinstance(node, list):
        return [_ids_to_hex(v) for v in node]
    return node


def otlp_to_json_line(body: bytes, kind: str) -> str:
    """One OTLP/JSON line as the Collector's file exporter writes it."""
    from google.protobuf.json_format import MessageToDict

    if kind == "traces":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest as Req
    else:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest as Req
    msg = Req()
    msg.ParseFromString(body)
    # lowerCamelCase keys, enums as integers; 64-bit integers come out as strings already.
    d = MessageToDict(msg, preserving_proto_field_name=False, use_integers_for_enums=True)
    return json.dumps(_ids_to_hex(d), separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- running scenarios

def run_scenario(sc: Scenario, out: Path, stub_port: int, sink_port: int, timeout: float) -> bool:
    py = venv_python(sc.venv)
    instrument = py.parent / "opentelemetry-instrument"
    if not instrument.exists():
        print(f"[{sc.name}] missing {instrument}; run --setup first", file=sys.stderr)
        return False
    STATE.reset(sc.name)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "OPENAI_", "TRACELOOP_", "CREWAI_", "AUTOGEN_", "LANGCHAIN_", "LANGSMITH_"))}
    env.update({
        "PATH": f"{py.parent}:{env.get('PATH', '')}",
        "VIRTUAL_ENV": str(py.parent.parent),
        "PYTHONUNBUFFERED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": sc.name,
        "OTEL_RESOURCE_ATTRIBUTES": f"lightning.rollout.id=ro-{sc.name}-1,lightning.task.id=task-7,lightning.attempt=0",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{stub_port}/v1",
        "OPENAI_API_KEY": "dummy",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    })
    env.pop("PYTHONPATH", None)
    env.update(sc.env)
    cmd = [str(instrument), str(py), str(AGENTS / sc.script)]
    print(f"[{sc.name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(AGENTS), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"[{sc.name}] TIMEOUT after {timeout}s\n{e.stdout}\n{e.stderr}", file=sys.stderr)
        return False
    time.sleep(0.3)  # let the last in-flight export land
    print(f"[{sc.name}] exit={proc.returncode} in {time.time() - t0:.1f}s; stdout: {proc.stdout.strip()[-400:]}")
    if proc.returncode != 0:
        print(f"[{sc.name}] stderr:\n{proc.stderr[-4000:]}", file=sys.stderr)
        return False
    with STATE.lock:
        traces, logs = list(STATE.trace_bodies), list(STATE.log_bodies)
        tps, others = list(STATE.traceparents), list(STATE.other_paths)
    if others:
        print(f"[{sc.name}] note: unexpected paths {others}")
    if not traces:
        print(f"[{sc.name}] no trace export received; stderr:\n{proc.stderr[-4000:]}", file=sys.stderr)
        return False
    sdir = out / sc.name
    if sdir.exists():
        shutil.rmtree(sdir)
    sdir.mkdir(parents=True)
    lines = []
    for k, body in enumerate(traces):
        (sdir / f"{k}.pb").write_bytes(body)
        lines.append(otlp_to_json_line(body, "traces"))
    for k, body in enumerate(logs):
        (sdir / f"logs-{k}.pb").write_bytes(body)
        lines.append(otlp_to_json_line(body, "logs"))
    (out / f"{sc.name}.jsonl").write_text("".join(line + "\n" for line in lines))
    (out / f"{sc.name}.traceparents.json").write_text(json.dumps(tps, indent=1) + "\n")
    size = sum(len(b) for b in traces + logs)
    print(f"[{sc.name}] saved {len(traces)} trace + {len(logs)} log requests ({size} bytes), "
          f"{len(tps)} chat requests")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE.parent / "fixtures" / "otlp")
    ap.add_argument("--only", action="append", help="scenario name (repeatable); with --setup: a venv name")
    ap.add_argument("--setup", action="store_true", help=f"create the recorder venvs under {VENV_ROOT}")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--serve", action="store_true", help="only start the stub and sink and print their ports")
    args = ap.parse_args(argv)

    if args.setup:
        for name in (args.only or [None]):
            setup_venvs(name)
        return 0

    stub, stub_port = start_server(ChatStubHandler)
    sink, sink_port = start_server(OtlpSinkHandler)
    print(f"stub http://127.0.0.1:{stub_port}/v1  sink http://127.0.0.1:{sink_port}", flush=True)
    if args.serve:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    args.out.mkdir(parents=True, exist_ok=True)
    names = {s.name for s in SCENARIOS}
    for n in args.only or []:
        if n not in names:
            ap.error(f"unknown scenario {n}; known: {sorted(names)}")
    failed = []
    for sc in SCENARIOS:
        if args.only and sc.name not in args.only:
            continue
        if not run_scenario(sc, args.out, stub_port, sink_port, args.timeout):
            failed.append(sc.name)
    stub.shutdown()
    sink.shutdown()
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
