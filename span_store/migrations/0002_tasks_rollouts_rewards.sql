-- What the rollout runner knows and spans do not: the task rows, how each agent process ended, and the
-- rewards. Filled by the capture work (runner, reward functions, emit_reward); empty until then.

CREATE TABLE tasks (
    task_id     VARCHAR NOT NULL PRIMARY KEY,
    fields      JSON NOT NULL,
    source      VARCHAR,
    created_ns  BIGINT
);
COMMENT ON TABLE tasks IS 'Tasks given to the rollout runner (one row per task id).';
COMMENT ON COLUMN tasks.task_id IS 'The task row''s id field, else its line number in the task file.';
COMMENT ON COLUMN tasks.fields IS 'The whole task row as JSON (question, db_id, gold query, ...).';
COMMENT ON COLUMN tasks.source IS 'Where the task came from (task file path).';
COMMENT ON COLUMN tasks.created_ns IS 'When the row was stored, ns since the epoch.';

CREATE TABLE rollout_runs (
    rollout_id      VARCHAR NOT NULL PRIMARY KEY,
    task_id         VARCHAR,
    attempt         BIGINT,
    policy_version  BIGINT,
    status          VARCHAR,
    error_class     VARCHAR,
    exit_code       BIGINT,
    started_ns      BIGINT,
    ended_ns        BIGINT,
    final_output    VARCHAR,
    stdout_tail     VARCHAR,
    stderr_tail     VARCHAR,
    command         VARCHAR
);
COMMENT ON TABLE rollout_runs IS 'One row per agent process the rollout runner started; read it through the rollouts view.';
COMMENT ON COLUMN rollout_runs.rollout_id IS 'Rollout id, also on every span of the rollout as lightning.rollout.id.';
COMMENT ON COLUMN rollout_runs.task_id IS 'Task the rollout ran.';
COMMENT ON COLUMN rollout_runs.attempt IS 'Sample index 0..n-1 within the task''s group.';
COMMENT ON COLUMN rollout_runs.policy_version IS 'Policy version that served the rollout (0 = base model).';
COMMENT ON COLUMN rollout_runs.status IS 'ok, failed (non-zero exit), timeout or error (could not start).';
COMMENT ON COLUMN rollout_runs.error_class IS 'Short class of the failure (e.g. Timeout, NonZeroExit, FileNotFoundError); NULL when ok.';
COMMENT ON COLUMN rollout_runs.exit_code IS 'Exit code of the agent process.';
COMMENT ON COLUMN rollout_runs.started_ns IS 'When the process started, ns since the epoch.';
COMMENT ON COLUMN rollout_runs.ended_ns IS 'When the process ended, ns since the epoch.';
COMMENT ON COLUMN rollout_runs.final_output IS 'Last non-empty line the agent printed on stdout.';
COMMENT ON COLUMN rollout_runs.stdout_tail IS 'End of the agent''s stdout.';
COMMENT ON COLUMN rollout_runs.stderr_tail IS 'End of the agent''s stderr.';
COMMENT ON COLUMN rollout_runs.command IS 'The agent command line as run, placeholders filled.';

CREATE TABLE rewards (
    rollout_id  VARCHAR NOT NULL,
    trace_id    VARCHAR,
    span_id     VARCHAR,
    name        VARCHAR NOT NULL,
    value       DOUBLE NOT NULL,
    source      VARCHAR NOT NULL,
    created_ns  BIGINT
);
COMMENT ON TABLE rewards IS 'Rewards: emitted by the agent (lightning.reward spans) or computed by a reward function.';
COMMENT ON COLUMN rewards.rollout_id IS 'Rollout the reward belongs to.';
COMMENT ON COLUMN rewards.trace_id IS 'Trace of the target span (hex); NULL for an episode reward.';
COMMENT ON COLUMN rewards.span_id IS 'Target span the reward is about (hex); NULL for an episode reward.';
COMMENT ON COLUMN rewards.name IS 'Reward name, e.g. spider_exec.';
COMMENT ON COLUMN rewards.value IS 'Reward value.';
COMMENT ON COLUMN rewards.source IS 'emitted (from the agent) or function (computed after the rollout).';
COMMENT ON COLUMN rewards.created_ns IS 'When the reward was stored, ns since the epoch.';
