"""`lightning-otel ingest` on what the OpenTelemetry Collector's `file` exporter writes.

Spans, logs and metrics come from the real OpenTelemetry SDK and are encoded with its OTLP encoder, one
request per SDK export batch (what a Collector's batch becomes). They are written in every layout the
exporter has (exporter/fileexporter: json lines; proto and zstd messages after a 4-byte big-endian length;
the whole file as one zstd stream under the `exporter.file.nativeCompression` gate) as a rotated set, and
loaded through the CLI. The rows must equal those of the same spans and logs sent to a real collector over
OTLP/HTTP.
"""
from __future__ import annotations

import gzip
import json
import logging

import pyarrow as pa
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk._logs import LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from lightning_otel.cli import main
from lightning_otel.span_store import client, otlp_files
from tests.helpers.sdk import chat_span, logger_provider, tracer_provider
from tests.helpers.otlp_json import request_to_json

# SDK 1.40 (the floor) names it LogExporter; later ones LogRecordExporter.
LogRecordExporter = getattr(log_export, "LogRecordExporter", None) or log_export.LogExporter
ROTATED = ["traces-2026-05-01T10-00-00.000.json", "traces-2026-05-01T11-00-00.000.json", "traces.json"]
SPANS, LOGS = 12, 2


class EncodingSpanExporter(SpanExporter):
    """Keeps each export batch as the ExportTraceServiceRequest the SDK's OTLP exporters send."""

    def __init__(self) -> None:
        self.requests: list = []

    def export(self, spans) -> SpanExportResult:
        self.requests.append(encode_spans(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class EncodingLogExporter(LogRecordExporter):
    def __init__(self) -> None:
        self.requests: list = []

    def export(self, batch):
        self.requests.append(encode_logs(batch))
        return log_export.LogExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


@pytest.fixture
def sent(make_collector, tmp_path):
    """The same SDK telemetry sent over OTLP/HTTP to a collector on its own store, and kept as requests:
    (requests in the order a Collector would write them, the reference store)."""
    reference_db = tmp_path / "reference.duckdb"
    collector = make_collector(db=reference_db)
    spans = EncodingSpanExporter()
    provider = tracer_provider(collector.url, {"service.name": "agent-files", "lightning.task.id": "t-7"})
    provider.add_span_processor(BatchSpanProcessor(spans, max_export_batch_size=4, schedule_delay_millis=60_000))
    tracer = provider.get_tracer("test.ingest", "1.2")
    for rollout in range(3):
        with tracer.start_as_current_span("workflow", kind=SpanKind.INTERNAL) as workflow:
            workflow.set_attributes({"lightning.rollout.id": f"ro-{rollout}", "ratio": 0.25, "ok": True,
                                     "tags": ["a", "b"], "lightning.attempt": rollout})
            workflow.add_event("started", {"step": rollout})
            context = workflow.get_span_context()
            with tracer.start_as_current_span("invoke_agent planner"):
                chat_span(tracer, rollout_id=f"ro-{rollout}", tokens=10 + rollout)
            retry = [Link(context, {"why": "retry"})]
            with tracer.start_as_current_span("execute_tool run_sql", links=retry) as tool:
                tool.set_status(Status(StatusCode.ERROR, "no such table"))
    provider.shutdown()  # both processors flush: the collector has them, `spans` holds batches of 4

    logs = EncodingLogExporter()
    log_provider = logger_provider(collector.url, {"service.name": "agent-files"})
    log_provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(logs))
    logger = logging.getLogger("test-ingest-files")
    handler = LoggingHandler(logger_provider=log_provider)
    logger.addHandler(handler)
    try:
        logger.warning("tool %s failed", "run_sql")
        logger.error("rollout %s gave up", "ro-2")
    finally:
        logger.removeHandler(handler)
        log_provider.shutdown()

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    meter_provider.get_meter("test").create_counter("calls").add(3)
    metrics = encode_metrics(reader.get_metrics_data())
    meter_provider.shutdown()
    collector.close()
    assert len(spans.requests) == 3 and len(logs.requests) == LOGS
    requests = [spans.requests[0], logs.requests[0], spans.requests[1], metrics, logs.requests[1], spans.requests[2]]
    return requests, reference_db


def rows(db, table: str) -> list[dict]:
    key = "span_id" if table == "spans" else "log_id"
    return client.query(f"SELECT * EXCLUDE (received_ns) FROM {table} ORDER BY {key}", db).to_dicts()


# ---- the layouts of the Collector's file exporter ---------------------------------------------------

def as_json(request) -> bytes:
    return json.dumps(request_to_json(request), separators=(",", ":")).encode()


def length_prefixed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def zstd_frame(body: bytes) -> bytes:
    return pa.compress(body, codec="zstd", asbytes=True)


def zstd_stream(data: bytes) -> bytes:
    """A streamed zstd file (frames without a content size), what the native-compression writer leaves."""
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


LAYOUTS = {
    "json": lambda reqs: b"".join(as_json(r) + b"\n" for r in reqs),
    "proto": lambda reqs: b"".join(length_prefixed(r.SerializeToString()) for r in reqs),
    "json-zstd": lambda reqs: b"".join(length_prefixed(zstd_frame(as_json(r))) for r in reqs),
    "proto-zstd": lambda reqs: b"".join(length_prefixed(zstd_frame(r.SerializeToString())) for r in reqs),
    "json-zstd-native": lambda reqs: zstd_stream(b"".join(as_json(r) + b"\n" for r in reqs)),
    "proto-zstd-native": lambda reqs: zstd_stream(b"".join(length_prefixed(r.SerializeToString()) for r in reqs)),
    # Native compression with rotation: one complete frame per message.
    "json-zstd-native-rotated": lambda reqs: b"".join(zstd_frame(as_json(r) + b"\n") for r in reqs),
    "json-gzip-afterwards": lambda reqs: gzip.compress(b"".join(as_json(r) + b"\n" for r in reqs)),
}


def write_rotated(folder, requests, layout: str):
    """Two rotated backups and the live file, as the exporter names them (the names say .json whatever the
    content: ingest reads the first bytes)."""
    folder.mkdir()
    for name, part in zip(ROTATED, (requests[:2], requests[2:4], requests[4:])):
        (folder / name).write_bytes(LAYOUTS[layout](part))
    return folder


@pytest.mark.heavy
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ingest_reads_each_file_exporter_layout_like_otlp_http(layout, sent, db_path, tmp_path, capsys):
    requests, reference_db = sent
    folder = write_rotated(tmp_path / "exports", requests, layout)
    assert main(["ingest", str(folder), "--db", str(db_path)]) == 0
    out = capsys.readouterr().out
    assert f"stored {SPANS} spans and {LOGS} log records from 5 requests" in out
    assert "1 metrics requests skipped" in out
    spans = rows(db_path, "spans")
    assert len(spans) == SPANS and spans == rows(reference_db, "spans")
    assert rows(db_path, "logs") == rows(reference_db, "logs")
    tool = next(s for s in spans if s["name"] == "execute_tool run_sql")
    assert tool["status_code"] == "ERROR" and json.loads(tool["links"])[0]["attributes"] == {"why": "retry"}
    workflow = next(s for s in spans if s["name"] == "workflow" and s["rollout_id"] == "ro-1")
    assert json.loads(workflow["attributes"])["tags"] == ["a", "b"] and workflow["attempt"] == 1
    assert workflow["task_id"] == "t-7" and workflow["scope_version"] == "1.2"


def test_ingest_through_a_running_collector_from_a_glob(sent, make_collector, db_path, tmp_path, capsys):
    requests, reference_db = sent
    folder = write_rotated(tmp_path / "exports", requests, "proto-zstd")
    (folder / "notes.txt").write_text("not matched by the glob\n")
    make_collector()  # holds db_path: ingest posts each request to it (protobuf as protobuf)
    assert main(["ingest", str(folder / "traces*.json"), "--db", str(db_path)]) == 0
    assert f"stored {SPANS} spans" in capsys.readouterr().out
    assert rows(db_path, "spans") == rows(reference_db, "spans")
    assert rows(db_path, "logs") == rows(reference_db, "logs")


# ---- damage: reported with what was expected, and every request before it is kept -------------------

def test_damaged_files_are_reported_and_everything_readable_is_kept(sent, db_path, tmp_path, capsys):
    requests, _ = sent
    traces = [r for r in requests if isinstance(r, ExportTraceServiceRequest)]
    good = tmp_path / "good.json"
    good.write_bytes(LAYOUTS["json"](traces[:1]))
    garbage = tmp_path / "archive.json"
    garbage.write_bytes(b"PK\x03\x04\x14\x00\x00\x00 a zip file, not telemetry")
    # Native zstd with rotation (a frame per message) and gzip, each cut inside its second request.
    cut = tmp_path / "cut.json.zst"
    whole = LAYOUTS["json-zstd-native-rotated"](traces[1:3])
    cut.write_bytes(whole[:len(whole) - 20])
    cut_gzip = tmp_path / "cut.json.gz"
    whole = LAYOUTS["json-gzip-afterwards"](traces[1:3])
    cut_gzip.write_bytes(whole[:len(whole) - 20])
    # Legacy zstd messages: the first is fine, the second frame is damaged, the third is cut short.
    frames = [length_prefixed(zstd_frame(r.SerializeToString())) for r in traces]
    damaged = frames[1][:4] + frames[1][4:8] + b"\x00" * (len(frames[1]) - 8)
    legacy = tmp_path / "legacy.bin"
    legacy.write_bytes(frames[0] + damaged + frames[2][:-5])
    # Proto messages after a length that cannot be one.
    bad_length = tmp_path / "bad-length.pb"
    bad_length.write_bytes(length_prefixed(traces[2].SerializeToString()) + b"\xff\xff\xff\x00" + b"\x0a" * 64)

    assert main(["ingest", str(good), str(garbage), str(cut), str(cut_gzip), str(legacy), str(bad_length),
                 "--db", str(db_path)]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith(f"error: {garbage}: not a Collector file export: it starts with bytes 50 4b 03 04")
    assert "OTLP/JSON lines (format: json)" in errors[0]
    complete = len(zstd_frame(as_json(traces[1]) + b"\n"))
    assert errors[1] == (f"error: {cut}: byte {complete}: the zstd data stops here (a frame is cut short): the file "
                         f"is truncated, or the Collector is still writing it (ingest rotated files, or stop it "
                         f"first); the frames before were read")
    assert errors[2].startswith(f"error: {cut_gzip}: the gzip data stops or is damaged") and "truncated" in errors[2]
    assert errors[3].startswith(f"error: {legacy}: message 2 at byte {len(frames[0])}: its zstd frame is damaged")
    assert errors[4].startswith(f"error: {legacy}: message 3 at byte {len(frames[0]) + len(damaged)}: its length "
                                f"prefix says") and "truncated" in errors[4]
    assert errors[5].startswith(f"error: {bad_length}: message 2 at byte ")
    assert "4294967040 bytes, more than any Collector message" in errors[5]
    assert len(errors) == 6 and "6 part(s) above could not be loaded; everything else was stored" in captured.err
    # Each file gave the one request before its damage: good, cut zstd, cut gzip, legacy, bad length.
    assert "stored 20 spans and 0 log records from 5 requests" in captured.out

    kept = {span["span_id"] for span in rows(db_path, "spans")}
    expected = {s.span_id.hex() for r in traces for s in r.resource_spans[0].scope_spans[0].spans}
    assert kept == expected and len(kept) == SPANS


def test_paths_that_name_nothing_stop_before_anything_is_loaded(sent, db_path, tmp_path, capsys):
    requests, _ = sent
    good = tmp_path / "good.json"
    good.write_bytes(LAYOUTS["json"](requests))
    (tmp_path / "empty").mkdir()
    args = [str(good), str(tmp_path / "missing.json"), str(tmp_path / "empty"), str(tmp_path / "nope*.json")]
    assert main(["ingest", *args, "--db", str(db_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing was loaded" in err and "missing.json: no such file or folder" in err
    assert "empty: the folder holds no files" in err and "nope*.json: no file matches" in err
    assert not db_path.exists()


def test_twice_compressed_and_empty_files(db_path, tmp_path, capsys):
    twice = tmp_path / "twice.json.gz.zst"
    twice.write_bytes(zstd_stream(gzip.compress(b'{"resourceSpans": []}\n')))
    (tmp_path / "empty.json").write_bytes(b"")
    assert main(["ingest", str(twice), str(tmp_path / "empty.json"), "--db", str(db_path)]) == 1
    err = capsys.readouterr().err
    assert f"{twice}: compressed twice" in err and "empty.json" not in err


def test_protobuf_signal_from_the_first_record(sent):
    requests, _ = sent
    assert [otlp_files.protobuf_signal(r.SerializeToString()) for r in requests] == \
        ["traces", "logs", "traces", "metrics", "logs", "traces"]
    assert otlp_files.protobuf_signal(b"") == "traces"  # no records: nothing to store either way
    assert otlp_files.protobuf_signal(b"\x0a\x05\x12\x03\x12\x01") is None  # a length past the end
    assert otlp_files.protobuf_signal(b"\x0b") is None  # wire type 3 (groups) is not OTLP
