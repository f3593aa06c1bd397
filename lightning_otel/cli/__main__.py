"""`python -m lightning_otel.cli` (DeepSpeed's and torchrun's `--module` launchers start it this way)."""
import sys

from lightning_otel.cli import main

sys.exit(main())
