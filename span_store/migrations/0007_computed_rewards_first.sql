-- An agent may emit a reward under any name, the name of the reward function it is trained on included, and
-- at any time, also after the runner scored it. The episode reward is therefore the latest row written through
-- /v1/records (a reward function's, which needs the collector's admin token) when there is one, and the
-- latest emitted one only for a name no record has; `source` says which it is.
CREATE OR REPLACE VIEW episode_rewards AS
SELECT r.rollout_id, r.name AS reward_name,
       arg_max(r.value, (r.source <> 'emitted', coalesce(r.created_ns, 0), r.value)) AS reward,
       arg_max(r.source, (r.source <> 'emitted', coalesce(r.created_ns, 0), r.value)) AS source,
       count(*) AS stored
FROM rewards r LEFT JOIN spans s ON s.trace_id = r.trace_id AND s.span_id = r.span_id
WHERE r.span_id IS NULL OR s.name = 'lightning.rollout' OR s.parent_span_id IS NULL
GROUP BY r.rollout_id, r.name;
COMMENT ON VIEW episode_rewards IS 'One row per (rollout, reward name): the reward of the whole episode (rewards on inner spans are not here).';
COMMENT ON COLUMN episode_rewards.rollout_id IS 'Rollout.';
COMMENT ON COLUMN episode_rewards.reward_name IS 'Reward name (rewards.name).';
COMMENT ON COLUMN episode_rewards.reward IS 'The latest stored value (by created_ns) of a computed reward, else of an emitted one: what the agent emits never replaces what a reward function computed.';
COMMENT ON COLUMN episode_rewards.source IS 'Source of that value: function (computed after the rollout) or emitted (by the agent).';
COMMENT ON COLUMN episode_rewards.stored IS 'How many rows of this name the rollout has (a recomputed reward adds one).';
