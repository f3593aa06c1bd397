"""Evaluation and reports. Installed as lightning_otel.eval."""
