-- Spans and log records exactly as OTLP delivers them, with the fields queries need often promoted to
-- columns at insert. Values that need a span's ancestors (which agent made an LLM call) are derived in
-- views, never here: spans of one trace arrive in any order and in separate requests.

CREATE TABLE spans (
    trace_id        VARCHAR NOT NULL,
    span_id         VARCHAR NOT NULL,
    parent_span_id  VARCHAR,
    trace_state     VARCHAR,
    flags           BIGINT,
    name            VARCHAR NOT NULL,
    kind            VARCHAR,
    start_ns        BIGINT,
    end_ns          BIGINT,
    status_code     VARCHAR,
    status_message  VARCHAR,
    attributes      JSON,
    resource        JSON,
    scope_name      VARCHAR,
    scope_version   VARCHAR,
    events          JSON,
    links           JSON,
    service_name    VARCHAR,
    rollout_id      VARCHAR,
    task_id         VARCHAR,
    attempt         BIGINT,
    operation_name  VARCHAR,
    request_model   VARCHAR,
    response_model  VARCHAR,
    input_tokens    BIGINT,
    output_tokens   BIGINT,
    received_ns     BIGINT,
    PRIMARY KEY (trace_id, span_id)
);

COMMENT ON TABLE spans IS 'One row per span; a span sent twice (exporter retry, other encoding) is kept once.';
COMMENT ON COLUMN spans.trace_id IS 'Trace id, 32 lowercase hex characters.';
COMMENT ON COLUMN spans.span_id IS 'Span id, 16 lowercase hex characters; with trace_id the primary key.';
COMMENT ON COLUMN spans.parent_span_id IS 'Parent span id (hex); NULL for a root span.';
COMMENT ON COLUMN spans.trace_state IS 'W3C tracestate of the span context, NULL when empty.';
COMMENT ON COLUMN spans.flags IS 'OTLP span flags (W3C trace flags in the low byte).';
COMMENT ON COLUMN spans.name IS 'Span name, e.g. openai.chat, ChatOpenAI.chat, execute_tool sql_db_query.';
COMMENT ON COLUMN spans.kind IS 'UNSPECIFIED, INTERNAL, SERVER, CLIENT, PRODUCER or CONSUMER.';
COMMENT ON COLUMN spans.start_ns IS 'Start time, nanoseconds since the Unix epoch.';
COMMENT ON COLUMN spans.end_ns IS 'End time, nanoseconds since the Unix epoch.';
COMMENT ON COLUMN spans.status_code IS 'UNSET, OK or ERROR.';
COMMENT ON COLUMN spans.status_message IS 'Status description, set with ERROR.';
COMMENT ON COLUMN spans.attributes IS 'Span attributes as a JSON object keyed by attribute name; read one with attr(attributes, ''gen_ai.request.model'').';
COMMENT ON COLUMN spans.resource IS 'Resource attributes (service.name, telemetry.sdk.*, lightning.*) as a JSON object.';
COMMENT ON COLUMN spans.scope_name IS 'Instrumentation scope name, e.g. opentelemetry.instrumentation.openai.v1.';
COMMENT ON COLUMN spans.scope_version IS 'Instrumentation scope version.';
COMMENT ON COLUMN spans.events IS 'Span events as a JSON list of {time_ns, name, attributes}; NULL when none.';
COMMENT ON COLUMN spans.links IS 'Span links as a JSON list of {trace_id, span_id, trace_state, attributes}; NULL when none.';
COMMENT ON COLUMN spans.service_name IS 'Resource attribute service.name.';
COMMENT ON COLUMN spans.rollout_id IS 'lightning.rollout.id from the span''s attributes, else from its resource.';
COMMENT ON COLUMN spans.task_id IS 'lightning.task.id from the span''s attributes, else from its resource.';
COMMENT ON COLUMN spans.attempt IS 'lightning.attempt (sample index within a task''s group) from the span, else its resource.';
COMMENT ON COLUMN spans.operation_name IS 'gen_ai.operation.name (chat, execute_tool, invoke_agent, ...), else Traceloop''s llm.request.type.';
COMMENT ON COLUMN spans.request_model IS 'gen_ai.request.model: the model name the client asked for.';
COMMENT ON COLUMN spans.response_model IS 'gen_ai.response.model: the model name the server answered with.';
COMMENT ON COLUMN spans.input_tokens IS 'gen_ai.usage.input_tokens (or the older gen_ai.usage.prompt_tokens).';
COMMENT ON COLUMN spans.output_tokens IS 'gen_ai.usage.output_tokens (or the older gen_ai.usage.completion_tokens).';
COMMENT ON COLUMN spans.received_ns IS 'When the collector decoded the request that carried the span, ns since the epoch.';

CREATE TABLE logs (
    log_id          VARCHAR NOT NULL PRIMARY KEY,
    time_ns         BIGINT,
    observed_ns     BIGINT,
    severity_number BIGINT,
    severity_text   VARCHAR,
    event_name      VARCHAR,
    body            JSON,
    attributes      JSON,
    resource        JSON,
    scope_name      VARCHAR,
    scope_version   VARCHAR,
    trace_id        VARCHAR,
    span_id         VARCHAR,
    flags           BIGINT,
    service_name    VARCHAR,
    rollout_id      VARCHAR,
    task_id         VARCHAR,
    attempt         BIGINT,
    received_ns     BIGINT
);

COMMENT ON TABLE logs IS 'OTLP log records; GenAI instrumentations may put message content here as events.';
COMMENT ON COLUMN logs.log_id IS 'Hash of the record''s content: a re-sent record is kept once.';
COMMENT ON COLUMN logs.time_ns IS 'Event time, ns since the epoch (0 when the source did not set it).';
COMMENT ON COLUMN logs.observed_ns IS 'When the SDK observed the record, ns since the epoch.';
COMMENT ON COLUMN logs.severity_number IS 'OTLP severity number (9 = INFO, 17 = ERROR).';
COMMENT ON COLUMN logs.severity_text IS 'Severity as text, as the source gave it.';
COMMENT ON COLUMN logs.event_name IS 'Event name, e.g. gen_ai.client.inference.operation.details.';
COMMENT ON COLUMN logs.body IS 'Body (any OTLP value) as JSON.';
COMMENT ON COLUMN logs.attributes IS 'Record attributes as a JSON object.';
COMMENT ON COLUMN logs.resource IS 'Resource attributes as a JSON object.';
COMMENT ON COLUMN logs.scope_name IS 'Instrumentation scope name.';
COMMENT ON COLUMN logs.scope_version IS 'Instrumentation scope version.';
COMMENT ON COLUMN logs.trace_id IS 'Trace of the span the record was emitted in (hex), NULL outside spans.';
COMMENT ON COLUMN logs.span_id IS 'Span the record was emitted in (hex), NULL outside spans.';
COMMENT ON COLUMN logs.flags IS 'OTLP log record flags.';
COMMENT ON COLUMN logs.service_name IS 'Resource attribute service.name.';
COMMENT ON COLUMN logs.rollout_id IS 'lightning.rollout.id from the record, else from its resource.';
COMMENT ON COLUMN logs.task_id IS 'lightning.task.id from the record, else from its resource.';
COMMENT ON COLUMN logs.attempt IS 'lightning.attempt from the record, else from its resource.';
COMMENT ON COLUMN logs.received_ns IS 'When the collector decoded the request, ns since the epoch.';

-- attr(j, 'gen_ai.request.model'): one attribute as text. Attribute names contain dots, which JSON
-- paths would otherwise read as nesting.
CREATE MACRO attr(j, k) AS json_extract_string(j, '$."' || k || '"');
CREATE MACRO attr_json(j, k) AS json_extract(j, '$."' || k || '"');
CREATE MACRO ns_to_timestamp(ns) AS make_timestamp_ns(ns);
