"""Read the files the OpenTelemetry Collector's `file` exporter writes, for `lightning-otel ingest`.

What the exporter (opentelemetry-collector-contrib, exporter/fileexporter) writes, told apart here by the
first bytes of each file, never by its name:

- `format: json` (the default): one OTLP/JSON export request per line, so the file starts with `{`.
- `format: proto`: each message (TracesData or LogsData, the same bytes as an Export*ServiceRequest) after
  its length, a 4-byte big-endian unsigned integer.
- `compression: zstd`: by default each message is compressed on its own (one zstd frame) and then
  length-prefixed as above, JSON too. With the Collector's `exporter.file.nativeCompression` feature gate
  (v0.154+) the whole file is one zstd stream holding JSON lines (json) or length-prefixed messages (proto).
- A file gzip- or zstd-compressed afterwards (logrotate, an archive job) reads like what it holds.

A rotated set (`traces.json`, `traces-2026-01-02T03-04-05.000.json`, ...) is read by naming its folder
or a glob. A damaged part of a file is reported and skipped; every message before it is still yielded.
"""
from __future__ import annotations

import glob
import gzip
import io
import itertools
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import orjson
import pyarrow as pa

from lightning_otel.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A length prefix above this is damage, not a message: the Collector's batches are far smaller, and reading
# past it would allocate the claimed size first.
MAX_MESSAGE_BYTES = 256 * 2**20
# The first byte of a non-empty message: `{` (JSON), a zstd frame, or protobuf field 1 as bytes
# (resource_spans / resource_logs / resource_metrics all have tag 0x0a).
MESSAGE_STARTS = (b"{", ZSTD_MAGIC, b"\x0a")
EXPECTED = ("expected what the OpenTelemetry Collector's file exporter writes: OTLP/JSON lines (format: json), "
            "length-prefixed messages (format: proto, or compression: zstd), or either gzip/zstd-compressed")
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


@dataclass
class Message:
    """One export request read from a file, decompressed: the body an OTLP/HTTP client would POST."""

    where: str  # "path:line" or "path: message N at byte B"
    signal: str  # traces | logs | metrics
    encoding: str  # json | protobuf
    body: bytes
    doc: dict | None = None  # the parsed request when encoding is json, so it is parsed once


@dataclass
class Unreadable:
    """A part of a file that could not be read; `reason` says what was expected and what to do."""

    where: str
    reason: str


# ---- which files ------------------------------------------------------------------------------------

def expand_paths(arguments: list[Path]) -> list[Path]:
    """The files to read, in order: a file as given, a folder's files (recursively, sorted by path, hidden
    ones skipped), a glob's matches (sorted). Every argument is checked before anything is read."""
    files: list[Path] = []
    missing: list[str] = []
    for argument in arguments:
        if argument.is_file():
            found = [argument]
        elif argument.is_dir():
            found = sorted(p for p in argument.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(argument).parts))
            if not found:
                missing.append(f"{argument}: the folder holds no files")
        elif any(char in str(argument) for char in "*?["):
            found = sorted(Path(p) for p in glob.glob(str(argument), recursive=True) if Path(p).is_file())
            if not found:
                missing.append(f"{argument}: no file matches")
        else:
            found = []
            missing.append(f"{argument}: no such file or folder")
        files.extend(found)
    if missing:
        raise UserError("nothing was loaded: " + "; ".join(missing))
    return list(dict.fromkeys(files))  # a file named twice (a glob and its folder) is read once


# ---- reading one file -------------------------------------------------------------------------------

def read_messages(path: Path) -> Iterator[Message | Unreadable]:
    """Every export request of one file, then an Unreadable for the part that could not be read, if any."""
    try:
        with open(path, "rb") as raw:
            head = raw.peek(8)[:8]
            if head.startswith(GZIP_MAGIC):
                # gzip hands out what it decoded before a cut, then raises EOFError: nothing readable is lost.
                yield from _read_compressed(path, gzip.GzipFile(fileobj=raw), "gzip")
            elif head.startswith(ZSTD_MAGIC):
                yield from _read_zstd(path)
            else:
                yield from _read_plain(path, raw, head)
    except OSError as exc:
        yield Unreadable(str(path), f"cannot read the file: {exc}")


def _read_zstd(path: Path) -> Iterator[Message | Unreadable]:
    """A zstd file: its complete frames are read, then the cut one, if any, is reported.

    pyarrow's decoder fails a whole read when the data stops inside a frame, dropping what it had decoded
    for that read; decoding only the complete frames keeps every message the Collector finished writing."""
    with pa.memory_map(str(path)) as mapped:
        data = mapped.read_buffer()
        end, problem = _complete_zstd_frames(memoryview(data))
        stream = io.BufferedReader(pa.CompressedInputStream(pa.BufferReader(data.slice(0, end)), "zstd"))
        yield from _read_compressed(path, stream, "zstd")
    if problem:
        yield Unreadable(f"{path}: byte {end}", f"the zstd data stops here ({problem}): the file is truncated, or "
                                                f"the Collector is still writing it (ingest rotated files, or stop "
                                                f"it first); the frames before were read")


def _complete_zstd_frames(data: memoryview) -> tuple[int, str | None]:
    """The length of the leading complete zstd frames (RFC 8878 framing: header, blocks, checksum) and why
    the rest is unreadable, None when there is no rest."""
    pos, size = 0, len(data)
    while pos < size:
        start, magic = pos, bytes(data[pos:pos + 4])
        if len(magic) == 4 and magic[1:] == b"\x2a\x4d\x18" and 0x50 <= magic[0] <= 0x5F:  # skippable frame
            pos += 8 + int.from_bytes(data[pos + 4:pos + 8], "little")
            if pos > size:
                return start, "a skippable frame is cut short"
            continue
        if magic != ZSTD_MAGIC:
            return start, f"no zstd frame starts at byte {start}"
        if pos + 5 > size:
            return start, "a frame header is cut short"
        descriptor = data[pos + 4]
        single_segment = descriptor >> 5 & 1
        pos += 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3] + (single_segment, 2, 4, 8)[descriptor >> 6]
        last = False
        while not last:
            if pos + 3 > size:
                return start, "a frame is cut short"
            header = int.from_bytes(data[pos:pos + 3], "little")
            last, block_type, block_size = bool(header & 1), header >> 1 & 3, header >> 3
            if block_type == 3:
                return start, f"a frame is damaged (reserved block type at byte {pos})"
            pos += 3 + (1 if block_type == 1 else block_size)  # an RLE block holds one byte
        pos += 4 if descriptor & 4 else 0  # content checksum
        if pos > size:
            return start, "a frame is cut short"
    return size, None


def _read_compressed(path: Path, stream: IO[bytes], codec: str) -> Iterator[Message | Unreadable]:
    try:
        head = stream.peek(8)[:8]  # type: ignore[attr-defined]
        if head.startswith((GZIP_MAGIC, ZSTD_MAGIC)):
            inner = "gzip" if head.startswith(GZIP_MAGIC) else "zstd"
            yield Unreadable(str(path), f"compressed twice ({inner} inside {codec}): decompress the outer layer "
                                        f"and ingest the result")
            return
        yield from _read_plain(path, stream, head)
    except (OSError, EOFError, zlib.error) as exc:
        # The messages before the damage were yielded; the last, partial one is not.
        yield Unreadable(str(path), f"the {codec} data stops or is damaged ({exc}): the file is truncated, or "
                                    f"the Collector is still writing it (ingest rotated files, or stop it first); "
                                    f"everything before that point was read")


def _read_plain(path: Path, stream: IO[bytes], head: bytes) -> Iterator[Message | Unreadable]:
    if not head:
        return
    if head.lstrip(b" \t\r\n")[:1] == b"{" or not head.strip(b" \t\r\n"):
        yield from _json_lines(path, stream)
    elif len(head) >= 5 and int.from_bytes(head[:4], "big") <= MAX_MESSAGE_BYTES \
            and (head[4:].startswith(MESSAGE_STARTS) or head[:4] == b"\0\0\0\0"):
        yield from _length_prefixed(path, stream)
    else:
        yield Unreadable(str(path), f"not a Collector file export: it starts with bytes {head.hex(' ')}; "
                                    f"{EXPECTED}")


def _json_lines(path: Path, stream: IO[bytes]) -> Iterator[Message | Unreadable]:
    for number, line in enumerate(stream, start=1):
        if line.strip():
            yield _json_message(f"{path}:{number}", line)


def _length_prefixed(path: Path, stream: IO[bytes]) -> Iterator[Message | Unreadable]:
    offset = 0
    for number in itertools.count(1):
        prefix = stream.read(4)
        if not prefix:
            return
        where = f"{path}: message {number} at byte {offset}"
        size = int.from_bytes(prefix, "big")
        if len(prefix) < 4 or size > MAX_MESSAGE_BYTES:
            what = ("the file ends inside a length prefix" if len(prefix) < 4 else
                    f"its length prefix says {size} bytes, more than any Collector message")
            yield Unreadable(where, f"{what}: the file is damaged here, the rest of it cannot be read")
            return
        payload = stream.read(size)
        if len(payload) < size:
            yield Unreadable(where, f"its length prefix says {size} bytes but the file ends after {len(payload)}: "
                                    f"truncated, or the Collector is still writing it (ingest rotated files, "
                                    f"or stop it first)")
            return
        if size and not payload.startswith(MESSAGE_STARTS):
            yield Unreadable(where, f"no message starts here (bytes {payload[:8].hex(' ')}): a length prefix "
                                    f"before it is wrong, the rest of the file cannot be read")
            return
        offset += 4 + size
        if payload.startswith(ZSTD_MAGIC):
            try:
                payload = _decompress_zstd(payload)
            except OSError as exc:
                yield Unreadable(where, f"its zstd frame is damaged ({exc}); the next messages are still read")
                continue
        if payload.lstrip(b" \t\r\n")[:1] == b"{":
            yield _json_message(where, payload)
        else:
            yield _protobuf_message(where, payload)


def _decompress_zstd(frame: bytes) -> bytes:
    return pa.CompressedInputStream(pa.BufferReader(frame), "zstd").read()


# ---- one message ------------------------------------------------------------------------------------

def _json_message(where: str, body: bytes) -> Message | Unreadable:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return Unreadable(where, f"not JSON ({exc})")
    signal = _json_signal(doc) if isinstance(doc, dict) else None
    if signal is None:
        return Unreadable(where, "not an OTLP export request (no resourceSpans/resourceLogs)")
    return Message(where, signal, "json", body, doc)


def _json_signal(doc: dict) -> str | None:
    for signal, camel, snake in (("traces", "resourceSpans", "resource_spans"),
                                 ("logs", "resourceLogs", "resource_logs"),
                                 ("metrics", "resourceMetrics", "resource_metrics")):
        if camel in doc or snake in doc:
            return signal
    return None


def _protobuf_message(where: str, body: bytes) -> Message | Unreadable:
    signal = protobuf_signal(body)
    if signal is None:
        return Unreadable(where, "not a protobuf OTLP export request (TracesData, LogsData or MetricsData)")
    return Message(where, signal, "protobuf", body)


def protobuf_signal(body: bytes) -> str | None:
    """traces, logs or metrics for a protobuf TracesData / LogsData / MetricsData, None when malformed.

    The three share their outer shape (field 1: resource blocks, their field 2: scope blocks, theirs: the
    records), so the first record tells: spans carry fixed64 times in fields 7 and 8 and 16- and 8-byte ids
    in fields 1 and 2, log records fixed64 times in fields 1 and 11 and a varint severity in field 2,
    metrics only length-delimited fields. A request without records stores nothing; it reads as traces."""
    try:
        record = _first_record(body)
        if record is None:
            return "traces"
        fields = {(number, wire): end - start for number, wire, start, end in _wire_fields(body, *record)}
    except ValueError:
        return None
    if (7, FIXED64) in fields or (8, FIXED64) in fields:
        return "traces"
    if (1, FIXED64) in fields or (11, FIXED64) in fields or (2, VARINT) in fields:
        return "logs"
    if fields.get((1, LEN)) == 16 and fields.get((2, LEN)) == 8:
        return "traces"
    if all(wire == LEN for _, wire in fields):
        return "metrics"
    return None


def _first_record(body: bytes) -> tuple[int, int] | None:
    for number, wire, start, end in _wire_fields(body, 0, len(body)):
        if (number, wire) != (1, LEN):
            continue
        for number2, wire2, start2, end2 in _wire_fields(body, start, end):
            if (number2, wire2) != (2, LEN):
                continue
            for number3, wire3, start3, end3 in _wire_fields(body, start2, end2):
                if (number3, wire3) == (2, LEN):
                    return start3, end3
    return None


def _wire_fields(body: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each field between start and end."""
    pos = start
    while pos < end:
        key, pos = _varint(body, pos, end)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value_start = pos
            _, pos = _varint(body, pos, end)
            yield number, wire, value_start, pos
            continue
        if wire == LEN:
            length, pos = _varint(body, pos, end)
            value_end = pos + length
        elif wire in (FIXED64, FIXED32):
            value_end = pos + (8 if wire == FIXED64 else 4)
        else:
            raise ValueError(f"wire type {wire}")
        if number == 0 or value_end > end:
            raise ValueError("field runs past its message")
        yield number, wire, pos, value_end
        pos = value_end


def _varint(body: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = body[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")
