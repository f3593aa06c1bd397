"""The plain-OpenAI SQL example (a standalone script; also installed as lightning_otel.tasks.spider.example_agent,
the demo's agent)."""
