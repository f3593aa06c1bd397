"""Training (GRPO on DeepSpeed). Installed as lightning_otel.train."""
