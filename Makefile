# Two entry points (see README): `make demo` and `make test`. Both set up what they need first, with uv
# from the lock files under infra/lock/ (hashes checked): `make demo` only the server's packages
# (infra/lock/server.txt, added to .venv), `make test` the whole dev venv (infra/lock/dev.txt, synced:
# what is not in the lock is removed) and the client's and torch's venvs. The server lock is compiled
# within the dev lock, so either order installs the same versions.
#
# `make lock` regenerates every lock from its inputs, keeping the pins already locked where the inputs
# allow (`make lock LOCK_UPGRADE=--upgrade` takes the newest): the server's from infra/layer/requirements.txt
# (the Lambda layer's pins, the server extra); the dev venv's from the layer's pins and
# infra/requirements-dev.txt; the others from infra/lock/<venv>.in. Commit the inputs and the locks
# together: tests/unit/test_locks.py fails when a lock disagrees with an `==` pin of its inputs.
SHELL := /bin/bash
export SAM_CLI_TELEMETRY := 0
export AWS_DEFAULT_REGION ?= us-east-1
# uv uses only the interpreters found below; UV_CACHE_DIR, if set, passes through to it.
export UV_PYTHON_DOWNLOADS := never
# Packages are compiled to bytecode when installed, and Python may cache the project's and the tests'
# compiled modules in __pycache__ (ignored by git), even where the machine sets PYTHONDONTWRITEBYTECODE:
# otherwise every process (pytest, the stack's workers, each uploader) compiles every module it imports
# from source, numpy, pydantic and boto3 included, about a second a process.
export UV_COMPILE_BYTECODE := 1
unexport PYTHONDONTWRITEBYTECODE

# The Lambda runtime's Python (template.yaml: python3.12): on PATH first, else pyenv's.
PY312 := $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' 2>/dev/null && command -v python3.12 || ls -d $$HOME/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -n 1)
# The oldest Python the client supports, for the client tests; falls back to the machine's python3.
PY310 := $(shell ls -d $$HOME/.pyenv/versions/3.10.*/bin/python3.10 2>/dev/null | tail -n 1 || true)
PY_CLIENT := $(if $(PY310),$(PY310),python3)

# torch 2.13.0 installs for Python 3.11 only (from local disk): the venv of the torchrun tests and of the
# Trainer and Lightning integrations' tests, with the versions they are tested against (infra/lock/torch.in).
PY311 := $(shell command -v python3.11 >/dev/null 2>&1 && command -v python3.11 || ls -d $$HOME/.pyenv/versions/3.11.*/bin/python3.11 2>/dev/null | tail -n 1)
TORCH_VENV := .cache/venv-torch
# uv reads no pip configuration: the local torch wheel's directory is passed when it exists.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

# uv itself, pinned, bootstrapped with the machine's python3 into .cache/uv.
UV_VERSION := 0.13.8
UV_HOME := .cache/uv
UV := $(UV_HOME)/bin/uv
UV_STAMP := $(UV_HOME)/.uv-$(UV_VERSION)

VENV := .venv
CLIENT_VENV := .cache/venv-client
BIN := $(VENV)/bin
LOCK := infra/lock

.PHONY: setup browser demo serve test lint typecheck template unit quick client-tests openapi bench lock clean

$(UV_STAMP):
	test -x $(UV_HOME)/bin/python || python3 -m venv $(UV_HOME)
	$(UV_HOME)/bin/pip install --quiet uv==$(UV_VERSION)
	rm -f $(UV_HOME)/.uv-* && touch $@

# venv DIR PYTHON: creates the venv unless it is there.
venv = test -x $(1)/bin/python || $(UV) venv --quiet --python $(2) $(1)
# editable DIR: the project itself, after the lock's packages (a sync removes what is not in the lock).
editable = $(UV) pip install --quiet --python $(1)/bin/python --no-deps -e .

# `make demo`: the server's packages only, added (never removed: after `make test` nothing changes).
$(BIN)/.installed-server: $(LOCK)/server.txt pyproject.toml $(UV_STAMP)
	@test -n "$(PY312)" || { echo "python3.12 is needed (the Lambda runtime); none found" >&2; exit 1; }
	$(call venv,$(VENV),$(PY312))
	$(UV) pip install --quiet --python $(BIN)/python --require-hashes -r $(LOCK)/server.txt
	$(call editable,$(VENV))
	touch $@

# Everything else: the dev lock (a superset of the server's, same versions), synced.
$(BIN)/.installed: $(LOCK)/dev.txt $(LOCK)/server.txt pyproject.toml $(UV_STAMP)
	@test -n "$(PY312)" || { echo "python3.12 is needed (the Lambda runtime); none found" >&2; exit 1; }
	$(call venv,$(VENV),$(PY312))
	$(UV) pip sync --quiet --python $(BIN)/python --require-hashes $(LOCK)/dev.txt
	$(call editable,$(VENV))
	touch $@ $(BIN)/.installed-server

$(CLIENT_VENV)/.installed: $(LOCK)/client.txt pyproject.toml $(UV_STAMP)
	$(call venv,$(CLIENT_VENV),$(PY_CLIENT))
	$(UV) pip sync --quiet --python $(CLIENT_VENV)/bin/python --require-hashes $(LOCK)/client.txt
	$(call editable,$(CLIENT_VENV))
	touch $@

$(TORCH_VENV)/.installed: $(LOCK)/torch.txt pyproject.toml $(UV_STAMP)
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the torchrun test); none found" >&2; exit 1; }
	$(call venv,$(TORCH_VENV),$(PY311))
	$(UV) pip sync --quiet --python $(TORCH_VENV)/bin/python --require-hashes $(FIND_LINKS) $(LOCK)/torch.txt
	$(call editable,$(TORCH_VENV))
	touch $@

setup: $(BIN)/.installed

# Debian's Chromium for the browser tests (Playwright drives it; it never downloads a browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: $(BIN)/.installed-server
	$(BIN)/python -m infra.demo

serve: $(BIN)/.installed-server
	$(BIN)/python -m infra.demo --serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# SAM and CloudFormation checks, all offline. `sam build` needs python3.12 on PATH: the venv's.
template: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/sam validate --lint
	$(BIN)/cfn-lint template.yaml
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/sam build --build-dir .aws-sam/build

unit: setup browser $(TORCH_VENV)/.installed
	$(BIN)/pytest

# The quick loop while working: every test in the dev venv alone but those marked (pyproject.toml)
# `browser` (headless Chromium), `torch` (the torch venv) or `slow` (over about half a second each,
# the stack tests and the contract suite on moto), which `make unit` runs too.
quick: setup
	$(BIN)/pytest -m "not browser and not torch and not slow"

client-tests: $(CLIENT_VENV)/.installed
	$(CLIENT_VENV)/bin/python -m pytest tests/client -m client -p no:cacheprovider

test: lint typecheck template unit client-tests

# openapi.json is generated from the code, and infra/wiring.json (what the local stack runs) from
# template.yaml; a test fails when either is out of date.
openapi: setup
	$(BIN)/python -m infra.openapi
	$(BIN)/python -m infra.template

# The benchmarks. The client's is measured beside the floor, wandb offline and tensorboardX, which get
# a venv of their own (never the client's).
BENCH_VENV := .cache/venv-bench
$(BENCH_VENV)/.installed: $(LOCK)/bench.txt pyproject.toml $(UV_STAMP)
	$(call venv,$(BENCH_VENV),$(PY312))
	$(UV) pip sync --quiet --python $(BENCH_VENV)/bin/python --require-hashes $(LOCK)/bench.txt
	$(call editable,$(BENCH_VENV))
	touch $@

# The Lightning integration's overhead beside WandbLogger (offline): torch 2.13.0 needs Python 3.11.
BENCH_LIGHTNING_VENV := .cache/venv-bench-lightning
$(BENCH_LIGHTNING_VENV)/.installed: $(LOCK)/bench-lightning.txt pyproject.toml $(UV_STAMP)
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the Lightning benchmark); none found" >&2; exit 1; }
	$(call venv,$(BENCH_LIGHTNING_VENV),$(PY311))
	$(UV) pip sync --quiet --python $(BENCH_LIGHTNING_VENV)/bin/python --require-hashes $(FIND_LINKS) $(LOCK)/bench-lightning.txt
	$(call editable,$(BENCH_LIGHTNING_VENV))
	touch $@

# The Hugging Face Trainer callback's overhead beside wandb's integration (offline), likewise.
BENCH_HF_VENV := .cache/venv-bench-hf
$(BENCH_HF_VENV)/.installed: $(LOCK)/bench-hf.txt pyproject.toml $(UV_STAMP)
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the Trainer benchmark); none found" >&2; exit 1; }
	$(call venv,$(BENCH_HF_VENV),$(PY311))
	$(UV) pip sync --quiet --python $(BENCH_HF_VENV)/bin/python --require-hashes $(FIND_LINKS) $(LOCK)/bench-hf.txt
	$(call editable,$(BENCH_HF_VENV))
	touch $@

bench: setup $(BENCH_VENV)/.installed $(BENCH_LIGHTNING_VENV)/.installed $(BENCH_HF_VENV)/.installed
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python -m benchmarks.summary
	$(BIN)/python -m benchmarks.findings_quality --jobs 2
	$(BIN)/python -m benchmarks.authorizer
	$(BIN)/python benchmarks/client_overhead.py
	$(BIN)/python -m benchmarks.local_stack
	$(BIN)/python -m benchmarks.runs_index
	$(BIN)/python -m benchmarks.runs_page
	$(BIN)/python -m benchmarks.watch
	$(BIN)/python -m benchmarks.watch_dynamodb
	$(BIN)/python -m benchmarks.aws_model
	$(BIN)/python -m benchmarks.connections
	$(BIN)/python -m benchmarks.big_run
	$(BENCH_LIGHTNING_VENV)/bin/python benchmarks/lightning_overhead.py
	$(BENCH_HF_VENV)/bin/python benchmarks/hf_overhead.py

# The locks (see the top of this file). Each is compiled for its venv's Python on this platform; the dev
# lock first, since the server's is compiled within it.
COMPILE = $(UV) pip compile --quiet --generate-hashes --custom-compile-command 'make lock' $(LOCK_UPGRADE)
lock: $(UV_STAMP)
	@test -n "$(PY312)" -a -n "$(PY311)" || { echo "python3.12 and python3.11 are needed to lock their venvs" >&2; exit 1; }
	$(COMPILE) --python $(PY312) --python-version 3.12 infra/layer/requirements.txt infra/requirements-dev.txt -o $(LOCK)/dev.txt
	$(COMPILE) --python $(PY312) --python-version 3.12 infra/layer/requirements.txt -c $(LOCK)/dev.txt -o $(LOCK)/server.txt
	$(COMPILE) --python $(PY_CLIENT) --python-version 3.10 $(LOCK)/client.in -o $(LOCK)/client.txt
	$(COMPILE) --python $(PY311) --python-version 3.11 $(FIND_LINKS) $(LOCK)/torch.in -o $(LOCK)/torch.txt
	$(COMPILE) --python $(PY312) --python-version 3.12 $(LOCK)/bench.in -o $(LOCK)/bench.txt
	$(COMPILE) --python $(PY311) --python-version 3.11 $(FIND_LINKS) $(LOCK)/bench-lightning.in -c $(LOCK)/torch.txt -o $(LOCK)/bench-lightning.txt
	$(COMPILE) --python $(PY311) --python-version 3.11 $(FIND_LINKS) $(LOCK)/bench-hf.in -c $(LOCK)/torch.txt -o $(LOCK)/bench-hf.txt

clean:
	rm -rf $(VENV) $(CLIENT_VENV) $(TORCH_VENV) .aws-sam
