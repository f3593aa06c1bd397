-- Human feedback: a person's score for a rollout or one of its spans (`lightning-otel feedback`, POST /v1/feedback
-- with the admin token), stored as a reward with source 'human', its author and a comment, so the compiler and
-- `train --offline` use it like any other reward of its name.
ALTER TABLE rewards ADD COLUMN author VARCHAR;
ALTER TABLE rewards ADD COLUMN comment VARCHAR;
COMMENT ON COLUMN rewards.author IS 'Who gave a human score (source human); NULL for other rewards.';
COMMENT ON COLUMN rewards.comment IS 'The comment that came with a human score; NULL when none.';
COMMENT ON COLUMN rewards.source IS 'emitted (by the agent), function (computed after the rollout) or human (feedback).';

-- Which stored value of a name is the episode reward: a person's score outranks a computed one, so a correction
-- survives the reward function being run again, and a computed one outranks what the agent emitted; among rows of
-- one rank, the latest.
CREATE OR REPLACE VIEW episode_rewards AS
SELECT r.rollout_id, r.name AS reward_name,
       arg_max(r.value, (CASE r.source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                         coalesce(r.created_ns, 0), r.value)) AS reward,
       arg_max(r.source, (CASE r.source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                          coalesce(r.created_ns, 0), r.value)) AS source,
       count(*) AS stored
FROM rewards r LEFT JOIN spans s ON s.trace_id = r.trace_id AND s.span_id = r.span_id
WHERE r.span_id IS NULL OR s.name = 'lightning.rollout' OR s.parent_span_id IS NULL
GROUP BY r.rollout_id, r.name;
COMMENT ON VIEW episode_rewards IS 'One row per (rollout, reward name): the reward of the whole episode (rewards on inner spans are not here).';
COMMENT ON COLUMN episode_rewards.rollout_id IS 'Rollout.';
COMMENT ON COLUMN episode_rewards.reward_name IS 'Reward name (rewards.name).';
COMMENT ON COLUMN episode_rewards.reward IS 'The latest human score of this name, else the latest computed value, else the latest emitted one (by created_ns): what the agent emits never replaces what a reward function computed or a person gave.';
COMMENT ON COLUMN episode_rewards.source IS 'Source of that value: human (feedback), function (computed after the rollout) or emitted (by the agent).';
COMMENT ON COLUMN episode_rewards.stored IS 'How many rows of this name the rollout has (a recomputed reward adds one).';
COMMENT ON TABLE rewards IS 'Rewards: emitted by the agent (lightning.reward spans), computed by a reward function, or given by a person (lightning-otel feedback).';
