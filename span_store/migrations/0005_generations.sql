-- The gateway's token records. One `lightning.generate` span per returned choice; its parent is the
-- client's LLM span (from the request's traceparent), so llm_calls join them on (trace_id, span_id).
CREATE VIEW generations AS
SELECT trace_id, span_id, parent_span_id AS llm_span_id, rollout_id,
       TRY_CAST(attr(attributes, 'lightning.policy.version') AS BIGINT) AS policy_version,
       attr(attributes, 'lightning.engine') AS engine,
       request_model,
       attr(attributes, 'gen_ai.response.id') AS response_id,
       TRY_CAST(attr(attributes, 'lightning.choice.index') AS INTEGER) AS choice_index,
       TRY_CAST(attr_json(attributes, 'lightning.prompt.token_ids') AS INTEGER[]) AS prompt_ids,
       TRY_CAST(attr_json(attributes, 'lightning.completion.token_ids') AS INTEGER[]) AS completion_ids,
       TRY_CAST(attr_json(attributes, 'lightning.completion.logprobs') AS DOUBLE[]) AS completion_logprobs,
       start_ns, end_ns
FROM spans WHERE name = 'lightning.generate';
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
