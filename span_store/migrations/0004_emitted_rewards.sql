-- Rewards the agent emitted with lightning_otel.emit_reward() arrive as `lightning.reward` spans; ingest
-- copies each into `rewards` once, keyed by the reward span, so an exporter retry adds nothing.
ALTER TABLE rewards ADD COLUMN reward_span_id VARCHAR;
COMMENT ON COLUMN rewards.reward_span_id IS 'For emitted rewards: the lightning.reward span the row came from (hex); NULL for computed ones.';
COMMENT ON COLUMN rewards.span_id IS 'Span the reward is about (hex): for an emitted reward, the span that was current at emit_reward() (the lightning.rollout span means the whole episode); NULL for an episode reward.';
