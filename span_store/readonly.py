"""The read-only SQL checker: of everything DuckDB parses, only statements that read the store's tables and
views pass, so the query endpoint cannot change settings, write, or reach files. A statement is parsed by
DuckDB itself (never by pattern), EXPLAIN's wrapped statement is checked under every reading the grammar
allows, and a SELECT's sources are checked on DuckDB's syntax tree before anything is bound.
"""
from __future__ import annotations

import json
import threading
from typing import Iterator

import duckdb

from lightning_otel.errors import UserError

READ_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
# Table functions a query may call: generators and catalog metadata. Everything else is refused, because
# SELECT reaches more than reads: read_blob/read_text/read_csv... read the store's own files (DuckDB always
# allows those paths), query/query_table take a name that may be a file, and checkpoint(),
# json_execute_serialized_sql() and others change state.
READ_TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "repeat", "repeat_row", "json_each", "json_tree",
    "duckdb_columns", "duckdb_constraints", "duckdb_databases", "duckdb_dependencies", "duckdb_functions",
    "duckdb_indexes", "duckdb_keywords", "duckdb_memory", "duckdb_optimizers", "duckdb_schemas",
    "duckdb_sequences", "duckdb_settings", "duckdb_tables", "duckdb_temporary_files", "duckdb_types",
    "duckdb_views", "pragma_collations", "pragma_database_size", "pragma_metadata_info", "pragma_platform",
    "pragma_show", "pragma_storage_info", "pragma_table_info", "pragma_version", "pg_timezone_names",
    "icu_calendar_names"})
EXPLAIN_MODIFIERS = {"ANALYZE", "ANALYSE"}
SQL_SERIALIZE = "SELECT json_serialize_sql(?)"


def check_read_only(sql: str) -> None:
    """Refuse anything but read statements, with a message that says what to do instead."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise UserError(f"cannot parse SQL: {exc}") from None
    if not statements:
        raise UserError("empty SQL: give one SELECT statement")
    if len(statements) > 1:
        raise UserError(f"give one statement at a time, got {len(statements)}")
    kind = _statement_type(statements[0])
    if kind not in READ_STATEMENTS:
        raise UserError(
            f"only read statements (SELECT, FROM, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN) are allowed here, "
            f"got {kind.name if kind else 'another kind'}; the store is written only by the collector")
    reads = [statements[0].query] if kind == duckdb.StatementType.SELECT else explained_statements(statements[0].query)
    for read in reads:
        _check_sources(read)


def check_condition(where: str, flag: str = "--where") -> None:
    """A SQL condition to put in `WHERE (\n<condition>\n)` of a read statement: not empty, and its parentheses
    balance, so it cannot close the statement's and go on as more SQL. The statement it lands in is still
    checked whole with check_read_only."""
    if not where or not where.strip():
        raise UserError(f"{flag} is empty: give a SQL condition, e.g. task_id = 'spider-12'")
    try:
        tokens = _tokens(where)
    except duckdb.Error as exc:
        raise UserError(f"{flag} {where!r} cannot be parsed: {exc}") from None
    depth = 0
    for _, text in tokens:
        depth += {"(": 1, ")": -1}.get(text, 0)
        if depth < 0:
            break
    if depth != 0 or any(text == ";" for _, text in tokens):
        raise UserError(f"{flag} {where!r} is not one condition (unbalanced parentheses or a ';'): give a SQL "
                        f"condition such as task_id = 'x' or rollout_id IN ('a', 'b')")


def explained_statements(text: str) -> list[str]:
    """The statement an EXPLAIN [ANALYZE] wraps (EXPLAIN ANALYZE runs it), refused unless it is a read.

    `EXPLAIN (...) x` is either options before x or a parenthesized query, so every reading the grammar
    allows is parsed, and each that parses must be a SELECT: a disguise cannot pick the lenient one.
    """
    tokens = _tokens(text)
    starts = [1] if tokens and tokens[0][1].upper() == "EXPLAIN" else []
    if starts and len(tokens) > 1 and tokens[1][1].upper() in EXPLAIN_MODIFIERS:
        starts.append(2)
    for start in list(starts):
        if start < len(tokens) and tokens[start][1] == "(":
            starts.append(_after_parentheses(tokens, start))
    wrapped = []
    for start in sorted(starts, reverse=True):  # the innermost reading first, so the message names it
        rest = text[tokens[start][0]:] if start < len(tokens) else ""
        try:
            parsed = duckdb.extract_statements(rest)
        except duckdb.Error:
            continue  # not how DuckDB reads this EXPLAIN
        if len(parsed) != 1:
            continue
        kind = _statement_type(parsed[0])
        if kind != duckdb.StatementType.SELECT:
            raise UserError(f"EXPLAIN only wraps a read statement here (SELECT, FROM, WITH, DESCRIBE, SHOW, "
                            f"SUMMARIZE), got {kind.name if kind else 'another kind'}: EXPLAIN ANALYZE runs what it "
                            f"wraps, and the collector's settings and files are not changed through queries")
        wrapped.append(rest)
    if not wrapped:
        raise UserError("EXPLAIN must wrap one SELECT statement, e.g. EXPLAIN ANALYZE SELECT count(*) FROM spans")
    return wrapped


def _statement_type(statement) -> duckdb.StatementType | None:
    try:
        return statement.type
    except ValueError:
        return None  # a kind this DuckDB's Python binding has no name for (UPDATE EXTENSIONS), never a read


def _tokens(text: str) -> list[tuple[int, str]]:
    """(offset, text) of each token DuckDB's tokenizer finds, comments left out."""
    found = duckdb.tokenize(text)
    ends = [offset for offset, _ in found[1:]] + [len(text)]
    return [(offset, text[offset:end].strip()) for (offset, kind), end in zip(found, ends)
            if kind != duckdb.token_type.comment]


def _after_parentheses(tokens: list[tuple[int, str]], start: int) -> int:
    depth = 0
    for index in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[index][1], 0)
        if depth == 0:
            return index + 1
    return len(tokens)


_parser_lock = threading.Lock()
_parser: duckdb.DuckDBPyConnection | None = None


def _syntax_tree(sql: str) -> dict:
    """DuckDB's own parse of a SELECT, before anything is bound (a table function's bind may already act)."""
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(config={"enable_external_access": False})
        return json.loads(_parser.execute(SQL_SERIALIZE, [sql]).fetchone()[0])


def _check_sources(sql: str) -> None:
    """Refuse a read whose FROM reaches files or state: table functions not in READ_TABLE_FUNCTIONS, and
    names that are file paths (DuckDB reads `FROM 'x.csv'` as the file)."""
    tree = _syntax_tree(sql)
    if tree.get("error"):
        raise UserError(f"cannot check this statement: {tree.get('error_message')}; give one SELECT statement")
    for node in _nodes(tree):
        kind = node.get("type")
        if kind == "TABLE_FUNCTION":
            name = str(node.get("function", {}).get("function_name", "")).lower()
            if name not in READ_TABLE_FUNCTIONS:
                raise UserError(
                    f"{name}() is disabled here: queries read the store's tables and views, not files or "
                    f"settings; allowed table functions: {', '.join(sorted(READ_TABLE_FUNCTIONS))}. To read a "
                    f"file, open it with DuckDB yourself; to load OTLP files, use `lightning-otel ingest`")
        elif kind in ("BASE_TABLE", "SHOW_REF") and any(c in str(node.get("table_name", "")) for c in "./\\:"):
            raise UserError(f"{node['table_name']!r} is a file path, not a table: queries read the store's tables "
                            f"and views (SHOW TABLES lists them), not files")


def _nodes(value) -> Iterator[dict]:
    if isinstance(value, dict):
        yield value
        for child in value.values():
            yield from _nodes(child)
    elif isinstance(value, list):
        for child in value:
            yield from _nodes(child)
