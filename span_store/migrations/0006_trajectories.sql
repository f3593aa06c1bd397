-- The compiler's inputs, and the default transitions, in SQL (DESIGN §4, §7). train/compile.py reads
-- trajectory_calls and episode_rewards; the transitions view is what `lightning-otel compile` gives with
-- its defaults (gamma 1, episode reward, per-rollout advantage) for rollouts whose calls all have gateway
-- token records (re-tokenising the others needs the model's tokenizer: only the compiler does that).
--
-- Compiling a large store must not parse JSON: reading the attributes of a million spans alone takes
-- ~10 CPU-seconds, parsing the token arrays of the gateway's records ~16 (measured,
-- benchmarks/RESULTS.md). So what the compiler reads is extracted once, when a span is stored: the
-- response id and the agent/task/node name a span goes by (from its own attributes, read by the decoder;
-- the ancestors are still joined at query time), and the gateway's records as typed rows.

-- The attributes a span's derived columns come from, parsed once: [1] gen_ai.agent.name,
-- [2] traceloop.span.kind, [3] crewai.agent.role, [4] traceloop.entity.name, [5] gen_ai.task.name,
-- [6] gen_ai.response.id.
CREATE MACRO span_fields(attributes) AS json_extract_string(attributes, [
    '$."gen_ai.agent.name"', '$."traceloop.span.kind"', '$."crewai.agent.role"', '$."traceloop.entity.name"',
    '$."gen_ai.task.name"', '$."gen_ai.response.id"']);
-- agent_name_of (0003) on fields already extracted; agent_name_of is redefined on it, so the rule is written once.
CREATE MACRO agent_name_from(name, operation_name, f) AS
    CASE
        WHEN f[1] IS NOT NULL
            AND coalesce(operation_name, '') NOT IN ('chat', 'text_completion', 'generate_content', 'execute_tool')
            THEN f[1]
        WHEN f[2] IN ('agent', 'task')
            THEN coalesce(f[1], f[3], f[4], f[5], regexp_replace(name, '\.(agent|task)$', ''))
        WHEN operation_name IN ('invoke_agent', 'create_agent', 'execute_task')
            OR name LIKE 'invoke_agent %' OR name LIKE 'execute_task %'
            THEN coalesce(f[1], f[5], f[4], regexp_replace(name, '^(invoke_agent|execute_task|create_agent) ', ''))
        ELSE NULL
    END;
CREATE OR REPLACE MACRO agent_name_of(name, attributes, operation_name) AS
    agent_name_from(name, operation_name, span_fields(attributes));
-- The decoders (otlp.py, _otlp_fast.c) fill response_id and agent_name while they have the attributes at
-- hand (the C and Python twins of agent_name_from; tests compare them with it), so storing a span parses no
-- JSON. Rows that come in the spans table's own shape (a copy, an older export) get them here.
CREATE MACRO spans_from_rows(source) AS TABLE
SELECT * EXCLUDE (_f), _f[6] AS response_id, agent_name_from(name, operation_name, _f) AS agent_name
FROM (SELECT *, span_fields(attributes) AS _f FROM query_table(source));

ALTER TABLE spans ADD COLUMN response_id VARCHAR;
ALTER TABLE spans ADD COLUMN agent_name VARCHAR;
COMMENT ON COLUMN spans.response_id IS 'gen_ai.response.id: the server''s completion id, on LLM call spans and the gateway''s records.';
COMMENT ON COLUMN spans.agent_name IS 'The agent, task or graph node this span stands for (agent_name_of of its own attributes); NULL when it is none.';
UPDATE spans SET response_id = attr(attributes, 'gen_ai.response.id'),
                 agent_name = agent_name_of(name, attributes, operation_name);

-- call_ancestors (0003) reads the promoted column instead of parsing every ancestor's attributes; the same
-- names: agent_name_of is only ever non-NULL where may_name_agent holds.
CREATE OR REPLACE VIEW call_ancestors AS
WITH RECURSIVE up(trace_id, call_span_id, span_id, depth) AS (
    SELECT trace_id, span_id, parent_span_id, 1 FROM spans
    WHERE parent_span_id IS NOT NULL
      AND (is_llm_call(name, operation_name) OR is_tool_call(name, attributes, operation_name))
    UNION ALL
    SELECT up.trace_id, up.call_span_id, p.parent_span_id, up.depth + 1
    FROM up JOIN spans p ON p.trace_id = up.trace_id AND p.span_id = up.span_id
    WHERE p.parent_span_id IS NOT NULL AND up.depth < 64
)
SELECT up.trace_id, up.call_span_id, up.depth, s.span_id AS ancestor_span_id, s.name AS ancestor_name, s.agent_name
FROM up JOIN spans s ON s.trace_id = up.trace_id AND s.span_id = up.span_id;
COMMENT ON VIEW call_ancestors IS 'Every ancestor of every LLM and tool call span, nearest first; the agent columns of llm_calls and tool_calls come from here.';
COMMENT ON COLUMN call_ancestors.trace_id IS 'Trace of the call.';
COMMENT ON COLUMN call_ancestors.call_span_id IS 'The LLM or tool call span.';
COMMENT ON COLUMN call_ancestors.depth IS '1 for the parent, 2 for the grandparent, ...';
COMMENT ON COLUMN call_ancestors.ancestor_span_id IS 'The ancestor span.';
COMMENT ON COLUMN call_ancestors.ancestor_name IS 'The ancestor''s span name.';
COMMENT ON COLUMN call_ancestors.agent_name IS 'The agent, task or graph node the ancestor stands for; NULL when it is none.';

-- The gateway's records (lightning.generate spans, one per returned choice) as typed rows.
CREATE TABLE token_records (
    trace_id            VARCHAR NOT NULL,
    span_id             VARCHAR NOT NULL,
    llm_span_id         VARCHAR,
    rollout_id          VARCHAR,
    policy_version      BIGINT,
    engine              VARCHAR,
    request_model       VARCHAR,
    response_id         VARCHAR,
    choice_index        INTEGER,
    prompt_ids          INTEGER[],
    completion_ids      INTEGER[],
    completion_logprobs DOUBLE[],
    start_ns            BIGINT,
    end_ns              BIGINT,
    PRIMARY KEY (trace_id, span_id)
);
COMMENT ON TABLE token_records IS 'The gateway''s lightning.generate spans as typed rows, filled when the span is stored; read them through the generations view.';
COMMENT ON COLUMN token_records.trace_id IS 'Trace of the client''s LLM call.';
COMMENT ON COLUMN token_records.span_id IS 'The lightning.generate span.';
COMMENT ON COLUMN token_records.llm_span_id IS 'Its parent: the client''s LLM span named by the request''s traceparent.';
COMMENT ON COLUMN token_records.rollout_id IS 'Rollout, from the gateway URL prefix.';
COMMENT ON COLUMN token_records.policy_version IS 'lightning.policy.version.';
COMMENT ON COLUMN token_records.engine IS 'lightning.engine.';
COMMENT ON COLUMN token_records.request_model IS 'gen_ai.request.model.';
COMMENT ON COLUMN token_records.response_id IS 'gen_ai.response.id.';
COMMENT ON COLUMN token_records.choice_index IS 'lightning.choice.index.';
COMMENT ON COLUMN token_records.prompt_ids IS 'lightning.prompt.token_ids.';
COMMENT ON COLUMN token_records.completion_ids IS 'lightning.completion.token_ids.';
COMMENT ON COLUMN token_records.completion_logprobs IS 'lightning.completion.logprobs.';
COMMENT ON COLUMN token_records.start_ns IS 'Start of the lightning.generate span.';
COMMENT ON COLUMN token_records.end_ns IS 'End of the lightning.generate span.';

-- The rows of token_records made from a table of spans (the spans table, or a batch being stored).
CREATE MACRO token_records_of(source) AS TABLE
SELECT trace_id, span_id, parent_span_id AS llm_span_id, rollout_id,
       TRY_CAST(json_extract_string(f[1], '$') AS BIGINT) AS policy_version, json_extract_string(f[2], '$') AS engine,
       request_model, json_extract_string(f[3], '$') AS response_id,
       TRY_CAST(json_extract_string(f[4], '$') AS INTEGER) AS choice_index,
       TRY_CAST(f[5] AS INTEGER[]) AS prompt_ids, TRY_CAST(f[6] AS INTEGER[]) AS completion_ids,
       TRY_CAST(f[7] AS DOUBLE[]) AS completion_logprobs, start_ns, end_ns
FROM (SELECT *, json_extract(attributes, ['$."lightning.policy.version"', '$."lightning.engine"',
                                          '$."gen_ai.response.id"', '$."lightning.choice.index"',
                                          '$."lightning.prompt.token_ids"', '$."lightning.completion.token_ids"',
                                          '$."lightning.completion.logprobs"']) AS f
      FROM query_table(source) WHERE name = 'lightning.generate');
INSERT OR IGNORE INTO token_records SELECT * FROM token_records_of('spans');

CREATE OR REPLACE VIEW generations AS
SELECT trace_id, span_id, llm_span_id, rollout_id, policy_version, engine, request_model, response_id, choice_index,
       prompt_ids, completion_ids, completion_logprobs, start_ns, end_ns
FROM token_records;
COMMENT ON VIEW generations IS 'Token-exact records of the rollout gateway, one per returned choice; join llm_calls on trace_id and llm_span_id = llm_calls.span_id.';
COMMENT ON COLUMN generations.trace_id IS 'Trace of the client''s LLM call.';
COMMENT ON COLUMN generations.span_id IS 'The lightning.generate span.';
COMMENT ON COLUMN generations.llm_span_id IS 'The client''s LLM span (openai.chat, ChatOpenAI.chat, ...) named by the request''s traceparent; NULL when the client sent none.';
COMMENT ON COLUMN generations.rollout_id IS 'Rollout, from the gateway URL prefix /r/<rollout_id>/.';
COMMENT ON COLUMN generations.policy_version IS 'Policy version that generated (0 = base model).';
COMMENT ON COLUMN generations.engine IS 'Engine name (vllm).';
COMMENT ON COLUMN generations.request_model IS 'Model name the agent asked for (served by the policy whatever it is).';
COMMENT ON COLUMN generations.response_id IS 'Completion id returned to the agent.';
COMMENT ON COLUMN generations.choice_index IS 'Index of the choice (n > 1 gives several records per call).';
COMMENT ON COLUMN generations.prompt_ids IS 'Prompt token ids exactly as the engine saw them (chat template applied).';
COMMENT ON COLUMN generations.completion_ids IS 'Completion token ids the policy sampled.';
COMMENT ON COLUMN generations.completion_logprobs IS 'Sampling logprob of each completion token (aligned with completion_ids).';
COMMENT ON COLUMN generations.start_ns IS 'When the gateway sent the request to the engine.';
COMMENT ON COLUMN generations.end_ns IS 'When the engine answered.';

-- The episode reward of a rollout, per reward name: a computed one (no target span), or one emitted on the
-- rollout's own span; the latest when there are several.
CREATE VIEW episode_rewards AS
SELECT r.rollout_id, r.name AS reward_name,
       arg_max(r.value, (coalesce(r.created_ns, 0), r.value)) AS reward, count(*) AS stored
FROM rewards r LEFT JOIN spans s ON s.trace_id = r.trace_id AND s.span_id = r.span_id
WHERE r.span_id IS NULL OR s.name = 'lightning.rollout' OR s.parent_span_id IS NULL
GROUP BY r.rollout_id, r.name;
COMMENT ON VIEW episode_rewards IS 'One row per (rollout, reward name): the reward of the whole episode (rewards on inner spans are not here).';
COMMENT ON COLUMN episode_rewards.rollout_id IS 'Rollout.';
COMMENT ON COLUMN episode_rewards.reward_name IS 'Reward name (rewards.name).';
COMMENT ON COLUMN episode_rewards.reward IS 'The latest stored value (by created_ns).';
COMMENT ON COLUMN episode_rewards.stored IS 'How many rows of this name the rollout has (a recomputed reward adds one).';

-- Who each rollout is, as the rollouts view says, without its span statistics (those aggregate every
-- span: 4x the time at a million spans).
CREATE VIEW rollout_identities AS
SELECT coalesce(r.rollout_id, s.rollout_id) AS rollout_id, coalesce(r.task_id, s.task_id) AS task_id,
       coalesce(r.attempt, s.attempt) AS attempt, r.policy_version, r.status
FROM rollout_runs r
FULL OUTER JOIN (SELECT rollout_id, any_value(task_id) AS task_id, any_value(attempt) AS attempt
                 FROM spans WHERE rollout_id IS NOT NULL GROUP BY rollout_id) s ON s.rollout_id = r.rollout_id;
COMMENT ON VIEW rollout_identities IS 'Every rollout (runner record or spans) with its task, sample index, policy version and status: the rollouts view''s first columns, cheaply.';
COMMENT ON COLUMN rollout_identities.rollout_id IS 'Rollout id.';
COMMENT ON COLUMN rollout_identities.task_id IS 'Task id (runner record, else the spans).';
COMMENT ON COLUMN rollout_identities.attempt IS 'Sample index within the task''s group.';
COMMENT ON COLUMN rollout_identities.policy_version IS 'Policy version the runner recorded; NULL when it did not.';
COMMENT ON COLUMN rollout_identities.status IS 'ok, failed, timeout or error; NULL for rollouts not started by the runner.';

-- Per rollout, its LLM calls in order, each once. The same request can be recorded by several LLM spans:
-- a framework's span around the SDK's (LangChain's ChatOpenAI.chat around openai.chat when suppression is
-- off), or two SDK instrumentations (Traceloop's openai.chat and the official `chat <model>`). Rules:
--   1. an LLM span with another LLM span below it stands for the deepest one below it (the span that made
--      the HTTP request, whose id the traceparent carries);
--   2. calls joined to the same token record (through the traceparent, or else through the response id
--      when the client sent no traceparent) are one call; the one the traceparent names is kept. A span
--      with several records (the SDK retried the request inside it) takes the last: its answer is the one
--      the agent received;
--   3. calls without a token record that carry the same gen_ai.response.id are one call; the first is kept.
-- The agent path is made of the agent/task/node ancestors' names (agent_name_of), root first, a name
-- repeated by the agent/task/node span right under it counted once (LangGraph's invoke_agent and workflow
-- spans both name the graph).
CREATE VIEW trajectory_calls AS
WITH RECURSIVE calls AS MATERIALIZED (
    SELECT trace_id, span_id, parent_span_id, rollout_id, start_ns, end_ns, response_id
    FROM spans WHERE rollout_id IS NOT NULL AND is_llm_call(name, operation_name)
),
-- The chain of ancestors above each span that is the parent of a call (calls of one agent share it),
-- nearest first. Going up, it carries the nearest agent name and builds the agent path by prepending each
-- agent/task/node name (a name equal to the one just below it is not repeated).
chain(trace_id, start_span_id, span_id, depth, is_call, parent_span_id, agent, head, path) AS (
    SELECT p.trace_id, p.span_id, p.span_id, 1, is_llm_call(p.name, p.operation_name), p.parent_span_id,
           p.agent_name, p.agent_name, p.agent_name
    FROM spans p SEMI JOIN calls c ON c.trace_id = p.trace_id AND c.parent_span_id = p.span_id
    UNION ALL
    SELECT chain.trace_id, chain.start_span_id, p.span_id, chain.depth + 1, is_llm_call(p.name, p.operation_name),
           p.parent_span_id, coalesce(chain.agent, p.agent_name), coalesce(p.agent_name, chain.head),
           CASE WHEN p.agent_name IS NULL OR p.agent_name = chain.head THEN chain.path
                WHEN chain.path IS NULL THEN p.agent_name
                ELSE p.agent_name || '/' || chain.path END
    FROM chain JOIN spans p ON p.trace_id = chain.trace_id AND p.span_id = chain.parent_span_id
    WHERE chain.depth < 64
),
ancestry AS MATERIALIZED (SELECT * FROM chain),
wrappers AS (
    SELECT c.trace_id, a.span_id, arg_max(c.span_id, a.depth) AS kept_span_id
    FROM calls c JOIN ancestry a ON a.trace_id = c.trace_id AND a.start_span_id = c.parent_span_id
    WHERE a.is_call GROUP BY c.trace_id, a.span_id
),
paths AS (  -- the top of each chain holds the whole path
    SELECT trace_id, start_span_id, arg_max(agent, depth) AS agent, arg_max(path, depth) AS agent_path
    FROM ancestry GROUP BY trace_id, start_span_id
),
records AS (
    SELECT trace_id, span_id, llm_span_id, rollout_id, response_id, coalesce(start_ns, 0) AS start_ns
    FROM token_records WHERE coalesce(choice_index, 0) = 0
),
direct AS (  -- through the traceparent (the record is in the call's trace); the last when the SDK retried
    SELECT trace_id, llm_span_id AS span_id, arg_max(span_id, (start_ns, span_id)) AS record_span_id
    FROM records WHERE llm_span_id IS NOT NULL GROUP BY trace_id, llm_span_id
),
members AS (
    SELECT c.trace_id, c.span_id, coalesce(w.kept_span_id, c.span_id) AS kept_span_id, d.record_span_id
    FROM calls c
    LEFT JOIN wrappers w ON w.trace_id = c.trace_id AND w.span_id = c.span_id
    LEFT JOIN direct d ON d.trace_id = c.trace_id AND d.span_id = c.span_id
),
kept AS MATERIALIZED (  -- the record of the kept span, else of a wrapper around it
    SELECT c.trace_id, c.span_id, c.parent_span_id, c.rollout_id, c.start_ns, c.end_ns, c.response_id, k.nested,
           k.record_span_id
    FROM (SELECT trace_id, kept_span_id AS span_id,
                 coalesce(any_value(record_span_id) FILTER (WHERE span_id = kept_span_id), any_value(record_span_id))
                     AS record_span_id,
                 count(*) - 1 AS nested
          FROM members GROUP BY trace_id, kept_span_id) k
    JOIN calls c ON c.trace_id = k.trace_id AND c.span_id = k.span_id
),
by_response AS (  -- only for calls the traceparent did not join to a record (few)
    SELECT r.rollout_id, r.response_id, arg_max(r.trace_id, (r.start_ns, r.trace_id, r.span_id)) AS record_trace_id,
           arg_max(r.span_id, (r.start_ns, r.trace_id, r.span_id)) AS record_span_id
    FROM records r SEMI JOIN kept k ON k.record_span_id IS NULL AND k.rollout_id = r.rollout_id
        AND k.response_id = r.response_id
    GROUP BY r.rollout_id, r.response_id
),
matched AS (
    SELECT k.trace_id, k.span_id, k.parent_span_id, k.rollout_id, k.start_ns, k.end_ns, k.response_id, k.nested,
           CASE WHEN k.record_span_id IS NOT NULL THEN k.trace_id ELSE b.record_trace_id END AS record_trace_id,
           coalesce(k.record_span_id, b.record_span_id) AS record_span_id, k.record_span_id IS NOT NULL AS direct
    FROM kept k
    LEFT JOIN by_response b ON k.record_span_id IS NULL AND b.rollout_id = k.rollout_id AND b.response_id = k.response_id
),
grouped AS (  -- one row per request: its token record, else its response id, else the span itself
    SELECT arg_min({'trace_id': trace_id, 'span_id': span_id, 'parent_span_id': parent_span_id,
                    'start_ns': start_ns, 'end_ns': end_ns,
                    'response_id': response_id, 'record_trace_id': record_trace_id, 'record_span_id': record_span_id},
                   (NOT direct, start_ns, span_id)) AS call,
           rollout_id, sum(nested + 1) - 1 AS duplicates
    FROM matched
    GROUP BY rollout_id,
             CASE WHEN record_span_id IS NOT NULL THEN record_trace_id WHEN response_id IS NOT NULL THEN ''
                  ELSE trace_id END,
             CASE WHEN record_span_id IS NOT NULL THEN record_span_id WHEN response_id IS NOT NULL THEN response_id
                  ELSE span_id END
),
ordered AS (
    SELECT rollout_id, duplicates, unnest(call),
           row_number() OVER (PARTITION BY rollout_id ORDER BY call.start_ns, call.span_id) - 1 AS turn
    FROM grouped
)
SELECT o.rollout_id, o.trace_id, o.span_id, o.turn::INTEGER AS turn, o.start_ns, o.end_ns, p.agent, p.agent_path,
       o.response_id, o.duplicates::INTEGER AS duplicates, o.record_trace_id, o.record_span_id,
       r.policy_version, r.prompt_ids, r.completion_ids, r.completion_logprobs
FROM ordered o
LEFT JOIN paths p ON p.trace_id = o.trace_id AND p.start_span_id = o.parent_span_id
LEFT JOIN token_records r ON r.trace_id = o.record_trace_id AND r.span_id = o.record_span_id;
COMMENT ON VIEW trajectory_calls IS 'Per rollout, its LLM calls in order, each request once (duplicated LLM spans removed), with the agent path and the gateway token record.';
COMMENT ON COLUMN trajectory_calls.rollout_id IS 'Rollout.';
COMMENT ON COLUMN trajectory_calls.trace_id IS 'Trace of the kept LLM span.';
COMMENT ON COLUMN trajectory_calls.span_id IS 'The kept LLM span (the innermost, or the one the token record names).';
COMMENT ON COLUMN trajectory_calls.turn IS 'Order of the call in its rollout after duplicates are removed (0-based, by start time).';
COMMENT ON COLUMN trajectory_calls.start_ns IS 'Start of the kept span, ns since the epoch.';
COMMENT ON COLUMN trajectory_calls.end_ns IS 'End of the kept span, ns since the epoch.';
COMMENT ON COLUMN trajectory_calls.agent IS 'Nearest agent, task or graph node above the call; NULL for a bare SDK call.';
COMMENT ON COLUMN trajectory_calls.agent_path IS 'Names of the agent/task/node spans above the call, root first, joined with "/" (e.g. LangGraph/write_query, crewai.workflow/<task>/SQL Analyst); NULL when there is none.';
COMMENT ON COLUMN trajectory_calls.response_id IS 'gen_ai.response.id of the kept span.';
COMMENT ON COLUMN trajectory_calls.duplicates IS 'Other LLM spans that recorded the same request and were removed.';
COMMENT ON COLUMN trajectory_calls.record_trace_id IS 'Trace of the lightning.generate record (NULL: no token record).';
COMMENT ON COLUMN trajectory_calls.record_span_id IS 'The lightning.generate record of choice 0, joined through the traceparent, else through the response id.';
COMMENT ON COLUMN trajectory_calls.policy_version IS 'Policy version in the token record.';
COMMENT ON COLUMN trajectory_calls.prompt_ids IS 'Prompt token ids from the record.';
COMMENT ON COLUMN trajectory_calls.completion_ids IS 'Completion token ids from the record.';
COMMENT ON COLUMN trajectory_calls.completion_logprobs IS 'Sampling logprobs from the record (aligned with completion_ids).';

-- What `lightning-otel compile` gives with its defaults, for every reward name: gamma 1 (every transition's
-- return is the episode reward R), A = (R - mean) / (std + 1e-6) over the rollouts of a (task, policy
-- version) group (sample std), zero-variance groups left out. A rollout is left out whole when it did not
-- end ok, has no task id, has no reward of that name, or has a call without a usable token record.
CREATE VIEW transitions AS
WITH live AS (
    SELECT rollout_id, task_id, attempt, policy_version FROM rollout_identities
    WHERE coalesce(status, 'ok') = 'ok' AND task_id IS NOT NULL
),
steps AS (
    SELECT t.*, l.task_id, l.attempt,
           coalesce(l.policy_version, min(t.policy_version) OVER (PARTITION BY t.rollout_id), 0) AS version,
           count(*) FILTER (WHERE t.record_span_id IS NULL OR len(t.prompt_ids) = 0
                                  OR len(t.completion_logprobs) IS DISTINCT FROM len(t.completion_ids))
               OVER (PARTITION BY t.rollout_id) AS unusable
    FROM trajectory_calls t JOIN live l ON l.rollout_id = t.rollout_id
),
scored AS (
    SELECT s.*, e.reward_name, e.reward FROM steps s JOIN episode_rewards e ON e.rollout_id = s.rollout_id
    WHERE s.unusable = 0
),
groups AS (
    SELECT rollout_id, reward_name,
           (reward - avg(reward) OVER w) / (stddev_samp(reward) OVER w + 1e-6) AS advantage,
           stddev_samp(reward) OVER w AS spread
    FROM (SELECT DISTINCT rollout_id, reward_name, task_id, version, reward FROM scored)
    WINDOW w AS (PARTITION BY reward_name, task_id, version)
)
SELECT s.rollout_id, s.task_id, s.attempt, s.version AS policy_version, s.agent, s.agent_path, s.turn,
       s.prompt_ids::INTEGER[] AS prompt_ids, s.completion_ids::INTEGER[] AS completion_ids,
       s.completion_logprobs::FLOAT[] AS completion_logprobs,
       list_transform(s.completion_ids, lambda x: 1::TINYINT) AS loss_mask,
       s.reward, s.reward AS "return", g.advantage, 'engine' AS token_source, s.reward_name
FROM scored s JOIN groups g ON g.rollout_id = s.rollout_id AND g.reward_name = s.reward_name
WHERE g.spread > 0;
COMMENT ON VIEW transitions IS 'Training transitions with the compiler''s defaults (gamma 1, episode reward, per-rollout advantage over (task, policy version) groups, zero-variance groups left out), one set per reward name; calls without token records are not re-tokenised here (lightning-otel compile does that).';
COMMENT ON COLUMN transitions.rollout_id IS 'Rollout.';
COMMENT ON COLUMN transitions.task_id IS 'Task of the rollout.';
COMMENT ON COLUMN transitions.attempt IS 'Sample index within the task''s group.';
COMMENT ON COLUMN transitions.policy_version IS 'The runner''s policy version, else the lowest in the rollout''s token records, else 0.';
COMMENT ON COLUMN transitions.agent IS 'Nearest agent, task or graph node above the call.';
COMMENT ON COLUMN transitions.agent_path IS 'Agent/task/node names above the call, root first, joined with "/".';
COMMENT ON COLUMN transitions.turn IS 'Order of the LLM call in its rollout (0-based, duplicates removed).';
COMMENT ON COLUMN transitions.prompt_ids IS 'State: prompt token ids as the engine saw them.';
COMMENT ON COLUMN transitions.completion_ids IS 'Action: completion token ids the policy sampled.';
COMMENT ON COLUMN transitions.completion_logprobs IS 'Sampling logprob of each completion token.';
COMMENT ON COLUMN transitions.loss_mask IS '1 for every completion token (trainable).';
COMMENT ON COLUMN transitions.reward IS 'Episode reward R of the rollout.';
COMMENT ON COLUMN transitions."return" IS 'Return G_t; with gamma 1 and the episode reward only, R.';
COMMENT ON COLUMN transitions.advantage IS '(R - group mean) / (group sample std + 1e-6), each rollout one member of its (task, policy version) group.';
COMMENT ON COLUMN transitions.token_source IS 'engine: token ids recorded by the gateway.';
COMMENT ON COLUMN transitions.reward_name IS 'Name of the reward the row was computed from (one set of rows per stored reward name).';
