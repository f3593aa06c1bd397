# The two commands of the README. Both build the project's virtual environment from scratch when it is
# missing or pyproject.toml changed, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/lightning-otel demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
