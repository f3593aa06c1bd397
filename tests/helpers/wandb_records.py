"""Reading back what W&B wrote offline: the records of a run's `.wandb` file.

wandb 0.31 no longer ships a Python reader for this file. It is a 7-byte header (`:W&B`, a 2-byte magic, a
version byte) followed by a LevelDB-style log: 32 KiB blocks of records, each with a 7-byte header (checksum,
2-byte little-endian length, type: 1 whole, 2 first, 3 middle, 4 last piece) and its bytes; a block's tail too
short for a header is zero padding. Each whole record is a protobuf `wandb.proto.wandb_internal_pb2.Record`.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a .wandb file")
    out, pieces, at = [], b"", HEADER
    while at + HEADER <= len(data):
        if BLOCK - at % BLOCK < HEADER:  # the block's padding
            at += BLOCK - at % BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[at:at + HEADER])
        if length == 0 and kind == 0:  # zeros: the end of what was written
            break
        body = data[at + HEADER:at + HEADER + length]
        at += HEADER + length
        if kind == FULL:
            pieces = body
        elif kind == FIRST:
            pieces = body
            continue
        elif kind == MIDDLE:
            pieces += body
            continue
        else:
            pieces += body
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pieces)
        out.append(record)
        pieces = b""
    return out


def history(path: Path) -> list[dict]:
    """The rows `run.log` wrote, as {key: value} (values decoded from their JSON)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def history_until(path: Path, done, timeout_s: float = 30.0) -> list[dict]:
    """history(path) once done(rows) holds, or as it stands after timeout_s: W&B's service process writes the
    file itself, and on a busy machine the last rows of a finished run reached it after run.finish() returned."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = history(path)
        except Exception:  # a record half written: read again, unless time is up
            if time.monotonic() > deadline:
                raise
            rows = []
        if done(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def config(path: Path) -> dict:
    """The run's config, as the run record holds it."""
    values: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values


def step_metrics(path: Path) -> dict[str, str]:
    """{metric name: its x axis} from the run's define_metric records."""
    return {r.metric.name: r.metric.step_metric for r in records(path)
            if r.WhichOneof("record_type") == "metric" and r.metric.name}
