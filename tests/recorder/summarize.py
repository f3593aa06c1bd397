#!/usr/bin/env python3
"""Print the span trees and log records of recorded fixtures (for writing the fixture README).

    /work/venvs/rec-main/bin/python tests/recorder/summarize.py tests/fixtures/otlp [SCENARIO ...] [--full]
"""
import argparse
import json
import sys
from pathlib import Path

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def anyvalue(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [anyvalue(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: anyvalue(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


def short(x, n):
    s = x if isinstance(x, str) else json.dumps(x)
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("scenarios", nargs="*")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--width", type=int, default=160)
    a = ap.parse_args()
    width = 100000 if a.full else a.width
    names = a.scenarios or sorted(p.name for p in a.dir.iterdir() if p.is_dir())
    for sc in names:
        d = a.dir / sc
        spans, res, logs = [], {}, []
        for f in sorted(d.glob("*.pb"), key=lambda p: (p.name.startswith("logs"), p.stem)):
            if f.name.startswith("logs-"):
                m = ExportLogsServiceRequest()
                m.ParseFromString(f.read_bytes())
                for rl in m.resource_logs:
                    for sl in rl.scope_logs:
                        for r in sl.log_records:
                            logs.append((sl.scope.name, r))
                continue
            m = ExportTraceServiceRequest()
            m.ParseFromString(f.read_bytes())
            for rs in m.resource_spans:
                res = {kv.key: anyvalue(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        spans.append((ss.scope.name, ss.scope.version, s))
        print(f"==================== {sc}: {len(spans)} spans, {len(logs)} log records")
        print("resource:", short(res, 400))
        byid = {s.span_id: s for _, _, s in spans}
        tps = a.dir / f"{sc}.traceparents.json"
        if tps.exists():
            for tp in json.loads(tps.read_text()):
                sid = bytes.fromhex(tp.split("-")[2]) if tp else None
                print("traceparent", tp, "->", byid[sid].name if sid in byid else "NOT A SPAN")
        for scope, ver, s in sorted(spans, key=lambda x: x[2].start_time_unix_nano):
            parent = byid.get(s.parent_span_id)
            pname = parent.name if parent else ("<root>" if not s.parent_span_id else "<missing>")
            print(f"\n--- {s.name!r} kind={KINDS[s.kind]} parent={pname!r} trace={s.trace_id.hex()[:8]} "
                  f"span={s.span_id.hex()} scope={scope} {ver} status={s.status.code} "
                  f"dur={(s.end_time_unix_nano - s.start_time_unix_nano) / 1e6:.1f}ms")
            for kv in s.attributes:
                print(f"    {kv.key} = {short(anyvalue(kv.value), width)}")
            for e in s.events:
                print(f"    [event] {e.name} {short({kv.key: anyvalue(kv.value) for kv in e.attributes}, width)}")
        for scope, r in logs:
            print(f"\n--- LOG scope={scope} event_name={r.event_name!r} sev={r.severity_number} "
                  f"trace={r.trace_id.hex()[:8]} span={r.span_id.hex()}")
            for kv in r.attributes:
                print(f"    {kv.key} = {short(anyvalue(kv.value), width)}")
            print(f"    body = {short(anyvalue(r.body), width)}")


if __name__ == "__main__":
    sys.exit(main())
