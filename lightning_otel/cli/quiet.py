"""A quiet command line: third-party warnings, log lines below ERROR and progress bars (DeepSpeed's accelerator
notice, transformers' deprecation warnings, weight-loading bars) are hidden unless --verbose. The command's own
progress lines and errors, and every library's errors, still show.
"""
from __future__ import annotations

import logging
import os

# Loggers of the libraries a training or demo run loads in this process.
THIRD_PARTY = ("DeepSpeed", "deepspeed", "transformers", "torch", "peft", "accelerate", "huggingface_hub",
               "datasets", "httpx", "urllib3", "filelock", "matplotlib", "py.warnings")
# Set in the environment, so the libraries read them when imported (and the processes a run starts inherit them).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def quiet_third_parties(environ: dict | None = None) -> None:
    """Hide what other libraries print below ERROR; a value the user set in the environment wins. Loggers
    get a filter rather than a level, since DeepSpeed sets its logger's level when it is imported."""
    environ = os.environ if environ is None else environ
    for key, value in QUIET_ENV.items():
        environ.setdefault(key, value)
    logging.captureWarnings(True)  # warnings.warn() goes to the py.warnings logger
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ErrorsOnly) for f in logger.filters):
            logger.addFilter(_ErrorsOnly())
