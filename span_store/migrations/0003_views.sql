-- Views over the raw spans: LLM calls, tool calls and rollouts. The agent that made a call is derived
-- here from the call's ancestors (CrewAI task > agent > openai.chat; LangGraph execute_task <node> >
-- ChatOpenAI.chat; AutoGen invoke_agent <name> > openai.chat), because ancestors may arrive later.

-- A span that stands for an agent, a task or a graph node, and the name it goes by.
CREATE MACRO agent_name_of(name, attributes, operation_name) AS
    CASE
        WHEN attr(attributes, 'gen_ai.agent.name') IS NOT NULL
            AND coalesce(operation_name, '') NOT IN ('chat', 'text_completion', 'generate_content', 'execute_tool')
            THEN attr(attributes, 'gen_ai.agent.name')
        WHEN attr(attributes, 'traceloop.span.kind') IN ('agent', 'task')
            THEN coalesce(attr(attributes, 'gen_ai.agent.name'), attr(attributes, 'crewai.agent.role'),
                          attr(attributes, 'traceloop.entity.name'), attr(attributes, 'gen_ai.task.name'),
                          regexp_replace(name, '\.(agent|task)$', ''))
        WHEN operation_name IN ('invoke_agent', 'create_agent', 'execute_task')
            OR name LIKE 'invoke_agent %' OR name LIKE 'execute_task %'
            THEN coalesce(attr(attributes, 'gen_ai.agent.name'), attr(attributes, 'gen_ai.task.name'),
                          attr(attributes, 'traceloop.entity.name'),
                          regexp_replace(name, '^(invoke_agent|execute_task|create_agent) ', ''))
        ELSE NULL
    END;

CREATE MACRO is_llm_call(name, operation_name) AS
    operation_name IN ('chat', 'text_completion', 'completion', 'generate_content')
    AND name <> 'lightning.generate';

CREATE MACRO is_tool_call(name, attributes, operation_name) AS
    operation_name = 'execute_tool' OR name LIKE 'execute_tool %'
    OR attr(attributes, 'traceloop.span.kind') = 'tool';

-- For every LLM or tool span: its ancestors, nearest first (depth 1 = parent).
CREATE VIEW call_ancestors AS
WITH RECURSIVE up(trace_id, call_span_id, span_id, depth) AS (
    SELECT trace_id, span_id, parent_span_id, 1 FROM spans
    WHERE parent_span_id IS NOT NULL
      AND (is_llm_call(name, operation_name) OR is_tool_call(name, attributes, operation_name))
    UNION ALL
    SELECT up.trace_id, up.call_span_id, p.parent_span_id, up.depth + 1
    FROM up JOIN spans p ON p.trace_id = up.trace_id AND p.span_id = up.span_id
    WHERE p.parent_span_id IS NOT NULL AND up.depth < 64
)
SELECT up.trace_id, up.call_span_id, up.depth, s.span_id AS ancestor_span_id, s.name AS ancestor_name,
       agent_name_of(s.name, s.attributes, s.operation_name) AS agent_name
FROM up JOIN spans s ON s.trace_id = up.trace_id AND s.span_id = up.span_id;
COMMENT ON VIEW call_ancestors IS 'Every ancestor of every LLM and tool call span, nearest first; the agent columns of llm_calls and tool_calls come from here.';
COMMENT ON COLUMN call_ancestors.trace_id IS 'Trace of the call.';
COMMENT ON COLUMN call_ancestors.call_span_id IS 'The LLM or tool call span.';
COMMENT ON COLUMN call_ancestors.depth IS '1 for the parent, 2 for the grandparent, ...';
COMMENT ON COLUMN call_ancestors.ancestor_span_id IS 'The ancestor span.';
COMMENT ON COLUMN call_ancestors.ancestor_name IS 'The ancestor''s span name.';
COMMENT ON COLUMN call_ancestors.agent_name IS 'The agent, task or graph node the ancestor stands for; NULL when it is none.';

CREATE VIEW call_agents AS
SELECT trace_id, call_span_id,
       arg_min(agent_name, depth) FILTER (WHERE agent_name IS NOT NULL) AS agent,
       string_agg(ancestor_name, ' > ' ORDER BY depth DESC) AS path
FROM call_ancestors GROUP BY trace_id, call_span_id;
COMMENT ON VIEW call_agents IS 'For each LLM or tool call: the nearest agent/task/node ancestor and the path of ancestor span names.';
COMMENT ON COLUMN call_agents.trace_id IS 'Trace of the call.';
COMMENT ON COLUMN call_agents.call_span_id IS 'The LLM or tool call span.';
COMMENT ON COLUMN call_agents.agent IS 'Name of the nearest ancestor that is an agent, task or graph node.';
COMMENT ON COLUMN call_agents.path IS 'Ancestor span names from the root down, joined with " > ".';

CREATE VIEW llm_calls AS
WITH detail_logs AS (
    -- Official GenAI instrumentations (event_only mode) put the messages in a log record of the call's span.
    SELECT trace_id, span_id,
           any_value(attr_json(attributes, 'gen_ai.input.messages')::VARCHAR) AS input_messages,
           any_value(attr_json(attributes, 'gen_ai.output.messages')::VARCHAR) AS output_messages,
           any_value(attr_json(attributes, 'gen_ai.system_instructions')::VARCHAR) AS system_instructions
    FROM logs WHERE span_id IS NOT NULL AND attr(attributes, 'gen_ai.operation.name') IS NOT NULL
    GROUP BY trace_id, span_id
)
SELECT s.trace_id, s.span_id, s.parent_span_id, s.rollout_id, s.task_id, s.attempt, s.service_name,
       s.name, a.agent, a.path AS agent_path,
       row_number() OVER (PARTITION BY coalesce(s.rollout_id, s.trace_id) ORDER BY s.start_ns, s.span_id) - 1
           AS turn,
       s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6 AS duration_ms, s.status_code, s.status_message,
       s.operation_name, coalesce(attr(s.attributes, 'gen_ai.provider.name'), attr(s.attributes, 'gen_ai.system'))
           AS provider,
       s.request_model, s.response_model, s.input_tokens, s.output_tokens,
       coalesce(attr(s.attributes, 'gen_ai.is_streaming') = 'true', false) AS streaming,
       attr(s.attributes, 'gen_ai.response.id') AS response_id,
       attr_json(s.attributes, 'gen_ai.response.finish_reasons') AS finish_reasons,
       coalesce(attr(s.attributes, 'gen_ai.system_instructions'), d.system_instructions) AS system_instructions,
       coalesce(attr(s.attributes, 'gen_ai.input.messages'), d.input_messages) AS input_messages,
       coalesce(attr(s.attributes, 'gen_ai.output.messages'), d.output_messages) AS output_messages,
       attr(s.attributes, 'gen_ai.tool.definitions') AS tool_definitions,
       s.scope_name
FROM spans s
LEFT JOIN call_agents a ON a.trace_id = s.trace_id AND a.call_span_id = s.span_id
LEFT JOIN detail_logs d ON d.trace_id = s.trace_id AND d.span_id = s.span_id
WHERE is_llm_call(s.name, s.operation_name);
COMMENT ON VIEW llm_calls IS 'One row per LLM call span (openai.chat, ChatOpenAI.chat, ...), with the agent that made it.';
COMMENT ON COLUMN llm_calls.trace_id IS 'Trace of the call.';
COMMENT ON COLUMN llm_calls.span_id IS 'The call''s span id; the gateway''s lightning.generate span has it as parent.';
COMMENT ON COLUMN llm_calls.parent_span_id IS 'Parent span of the call.';
COMMENT ON COLUMN llm_calls.rollout_id IS 'Rollout the call belongs to.';
COMMENT ON COLUMN llm_calls.task_id IS 'Task of the rollout.';
COMMENT ON COLUMN llm_calls.attempt IS 'Sample index within the task''s group.';
COMMENT ON COLUMN llm_calls.service_name IS 'service.name of the process that made the call.';
COMMENT ON COLUMN llm_calls.name IS 'Span name (openai.chat, ChatOpenAI.chat, ...).';
COMMENT ON COLUMN llm_calls.agent IS 'Nearest agent, task or graph node above the call; NULL for a bare SDK call.';
COMMENT ON COLUMN llm_calls.agent_path IS 'Ancestor span names from the root down, joined with " > ".';
COMMENT ON COLUMN llm_calls.turn IS 'Order of the call in its rollout (0-based, by start time); per trace when the span has no rollout id.';
COMMENT ON COLUMN llm_calls.start_ns IS 'Start, ns since the epoch.';
COMMENT ON COLUMN llm_calls.end_ns IS 'End, ns since the epoch.';
COMMENT ON COLUMN llm_calls.duration_ms IS 'end - start in milliseconds.';
COMMENT ON COLUMN llm_calls.status_code IS 'UNSET, OK or ERROR.';
COMMENT ON COLUMN llm_calls.status_message IS 'Error description when the call failed.';
COMMENT ON COLUMN llm_calls.operation_name IS 'gen_ai.operation.name (chat, text_completion, ...).';
COMMENT ON COLUMN llm_calls.provider IS 'gen_ai.provider.name, else gen_ai.system.';
COMMENT ON COLUMN llm_calls.request_model IS 'Model the client asked for.';
COMMENT ON COLUMN llm_calls.response_model IS 'Model the server answered with.';
COMMENT ON COLUMN llm_calls.input_tokens IS 'Prompt tokens reported by the server.';
COMMENT ON COLUMN llm_calls.output_tokens IS 'Completion tokens reported by the server.';
COMMENT ON COLUMN llm_calls.streaming IS 'Whether the call streamed (gen_ai.is_streaming).';
COMMENT ON COLUMN llm_calls.response_id IS 'gen_ai.response.id (the server''s completion id).';
COMMENT ON COLUMN llm_calls.finish_reasons IS 'gen_ai.response.finish_reasons as JSON.';
COMMENT ON COLUMN llm_calls.system_instructions IS 'gen_ai.system_instructions (JSON text) when the instrumentation splits the system prompt out.';
COMMENT ON COLUMN llm_calls.input_messages IS 'gen_ai.input.messages: the prompt messages as JSON text (parts schema), from the span or else from its GenAI log record.';
COMMENT ON COLUMN llm_calls.output_messages IS 'gen_ai.output.messages: the answer messages as JSON text (parts schema), from the span or else from its GenAI log record.';
COMMENT ON COLUMN llm_calls.tool_definitions IS 'gen_ai.tool.definitions: the tools offered, as JSON text.';
COMMENT ON COLUMN llm_calls.scope_name IS 'Instrumentation that recorded the call.';

CREATE VIEW tool_calls AS
WITH tool_spans AS (
    SELECT s.*,
           coalesce(attr(s.attributes, 'gen_ai.tool.call.arguments'), attr(s.attributes, 'traceloop.entity.input'))
               AS raw_arguments,
           coalesce(attr(s.attributes, 'gen_ai.tool.call.result'), attr(s.attributes, 'traceloop.entity.output'))
               AS raw_result
    FROM spans s WHERE is_tool_call(s.name, s.attributes, s.operation_name)
)
SELECT s.trace_id, s.span_id, s.parent_span_id, s.rollout_id, s.task_id, s.attempt, s.service_name,
       coalesce(attr(s.attributes, 'gen_ai.tool.name'), attr(s.attributes, 'traceloop.entity.name'),
                regexp_replace(s.name, '^execute_tool ', '')) AS tool_name,
       -- LangChain records the whole callback payload: the call id, arguments and result sit inside it.
       coalesce(attr(s.attributes, 'gen_ai.tool.call.id'), json_extract_string(try_cast(s.raw_arguments AS JSON), '$.kwargs.tool_call_id'))
           AS call_id,
       coalesce(json_extract(try_cast(s.raw_arguments AS JSON), '$.inputs')::VARCHAR, s.raw_arguments) AS arguments,
       coalesce(json_extract_string(try_cast(s.raw_result AS JSON), '$.output.kwargs.content'), s.raw_result) AS result,
       a.agent, a.path AS agent_path, s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6 AS duration_ms,
       s.status_code, s.status_message, s.name
FROM tool_spans s
LEFT JOIN call_agents a ON a.trace_id = s.trace_id AND a.call_span_id = s.span_id;
COMMENT ON VIEW tool_calls IS 'One row per tool execution span (LangGraph, AutoGen, Traceloop tool spans).';
COMMENT ON COLUMN tool_calls.trace_id IS 'Trace of the tool call.';
COMMENT ON COLUMN tool_calls.span_id IS 'The tool call''s span id.';
COMMENT ON COLUMN tool_calls.parent_span_id IS 'Parent span.';
COMMENT ON COLUMN tool_calls.rollout_id IS 'Rollout the call belongs to.';
COMMENT ON COLUMN tool_calls.task_id IS 'Task of the rollout.';
COMMENT ON COLUMN tool_calls.attempt IS 'Sample index within the task''s group.';
COMMENT ON COLUMN tool_calls.service_name IS 'service.name of the process.';
COMMENT ON COLUMN tool_calls.tool_name IS 'gen_ai.tool.name, else the entity name, else the span name without "execute_tool ".';
COMMENT ON COLUMN tool_calls.call_id IS 'gen_ai.tool.call.id (LangChain: the payload''s tool_call_id): joins the tool_call part of the LLM''s output message.';
COMMENT ON COLUMN tool_calls.arguments IS 'Arguments as JSON text (gen_ai.tool.call.arguments or traceloop.entity.input; for LangChain the payload''s inputs); NULL when the instrumentation does not record them (AutoGen).';
COMMENT ON COLUMN tool_calls.result IS 'Result (gen_ai.tool.call.result or traceloop.entity.output; for LangChain the ToolMessage content).';
COMMENT ON COLUMN tool_calls.agent IS 'Nearest agent, task or graph node above the tool call.';
COMMENT ON COLUMN tool_calls.agent_path IS 'Ancestor span names from the root down.';
COMMENT ON COLUMN tool_calls.start_ns IS 'Start, ns since the epoch.';
COMMENT ON COLUMN tool_calls.end_ns IS 'End, ns since the epoch.';
COMMENT ON COLUMN tool_calls.duration_ms IS 'end - start in milliseconds.';
COMMENT ON COLUMN tool_calls.status_code IS 'UNSET, OK or ERROR (a failed tool).';
COMMENT ON COLUMN tool_calls.status_message IS 'Error description when the tool failed.';
COMMENT ON COLUMN tool_calls.name IS 'Span name.';

CREATE VIEW rollouts AS
WITH span_stats AS (
    SELECT rollout_id, any_value(task_id) AS task_id, any_value(attempt) AS attempt,
           count(*) AS spans, count(DISTINCT trace_id) AS traces,
           count(*) FILTER (WHERE is_llm_call(name, operation_name)) AS llm_calls,
           count(*) FILTER (WHERE is_tool_call(name, attributes, operation_name)) AS tool_calls,
           count(*) FILTER (WHERE status_code = 'ERROR') AS error_spans,
           sum(input_tokens) FILTER (WHERE is_llm_call(name, operation_name))::BIGINT AS input_tokens,
           sum(output_tokens) FILTER (WHERE is_llm_call(name, operation_name))::BIGINT AS output_tokens,
           min(start_ns) AS first_start_ns, max(end_ns) AS last_end_ns,
           string_agg(DISTINCT service_name, ',') AS services
    FROM spans WHERE rollout_id IS NOT NULL GROUP BY rollout_id
),
reward_lists AS (
    SELECT rollout_id, list({'name': name, 'value': value, 'source': source, 'span_id': span_id}
                            ORDER BY created_ns) AS rewards
    FROM rewards GROUP BY rollout_id
)
SELECT coalesce(r.rollout_id, s.rollout_id) AS rollout_id,
       coalesce(r.task_id, s.task_id) AS task_id,
       coalesce(r.attempt, s.attempt) AS attempt,
       r.policy_version, r.status, r.error_class, r.exit_code, r.started_ns, r.ended_ns,
       (r.ended_ns - r.started_ns) / 1e9 AS duration_s, r.final_output,
       coalesce(s.spans, 0) AS spans, coalesce(s.traces, 0) AS traces,
       coalesce(s.llm_calls, 0) AS llm_calls, coalesce(s.tool_calls, 0) AS tool_calls,
       coalesce(s.error_spans, 0) AS error_spans, s.input_tokens, s.output_tokens,
       s.first_start_ns, s.last_end_ns, s.services, w.rewards
FROM rollout_runs r
FULL OUTER JOIN span_stats s ON s.rollout_id = r.rollout_id
LEFT JOIN reward_lists w ON w.rollout_id = coalesce(r.rollout_id, s.rollout_id);
COMMENT ON VIEW rollouts IS 'One row per rollout: the runner''s record (rollout_runs) joined with statistics of its spans; rollouts seen only in spans appear too.';
COMMENT ON COLUMN rollouts.rollout_id IS 'Rollout id.';
COMMENT ON COLUMN rollouts.task_id IS 'Task id (runner record, else the spans).';
COMMENT ON COLUMN rollouts.attempt IS 'Sample index within the task''s group.';
COMMENT ON COLUMN rollouts.policy_version IS 'Policy version that served the rollout; NULL when the runner did not record it.';
COMMENT ON COLUMN rollouts.status IS 'ok, failed, timeout or error; NULL for rollouts not started by the runner.';
COMMENT ON COLUMN rollouts.error_class IS 'Class of the failure.';
COMMENT ON COLUMN rollouts.exit_code IS 'Agent process exit code.';
COMMENT ON COLUMN rollouts.started_ns IS 'Process start, ns since the epoch.';
COMMENT ON COLUMN rollouts.ended_ns IS 'Process end, ns since the epoch.';
COMMENT ON COLUMN rollouts.duration_s IS 'Process run time in seconds.';
COMMENT ON COLUMN rollouts.final_output IS 'Last non-empty stdout line of the agent.';
COMMENT ON COLUMN rollouts.spans IS 'Spans stored for the rollout.';
COMMENT ON COLUMN rollouts.traces IS 'Distinct traces among them (AutoGen makes one per agent turn).';
COMMENT ON COLUMN rollouts.llm_calls IS 'LLM call spans: the transitions of the episode, before any merging.';
COMMENT ON COLUMN rollouts.tool_calls IS 'Tool call spans.';
COMMENT ON COLUMN rollouts.error_spans IS 'Spans with status ERROR.';
COMMENT ON COLUMN rollouts.input_tokens IS 'Sum of prompt tokens over the LLM calls.';
COMMENT ON COLUMN rollouts.output_tokens IS 'Sum of completion tokens over the LLM calls.';
COMMENT ON COLUMN rollouts.first_start_ns IS 'Earliest span start.';
COMMENT ON COLUMN rollouts.last_end_ns IS 'Latest span end.';
COMMENT ON COLUMN rollouts.services IS 'service.name values seen, comma-separated.';
COMMENT ON COLUMN rollouts.rewards IS 'List of {name, value, source, span_id} rewards of the rollout.';
