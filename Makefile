# Two entry points (see README): `make demo` and `make test`. Both set up what they need first.
SHELL := /bin/bash
export SAM_CLI_TELEMETRY := 0
export AWS_DEFAULT_REGION ?= us-east-1

# The Lambda runtime's Python (template.yaml: python3.12): on PATH first, else pyenv's.
PY312 := $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' 2>/dev/null && command -v python3.12 || ls -d $$HOME/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -n 1)
# The oldest Python the client supports, for the client tests; falls back to the machine's python3.
PY310 := $(shell ls -d $$HOME/.pyenv/versions/3.10.*/bin/python3.10 2>/dev/null | tail -n 1 || true)
PY_CLIENT := $(if $(PY310),$(PY310),python3)

# torch 2.13.0 installs for Python 3.11 only (from local disk): the venv of the torchrun tests and of the
# Trainer and Lightning integrations' tests, with the versions they are tested against.
PY311 := $(shell command -v python3.11 >/dev/null 2>&1 && command -v python3.11 || ls -d $$HOME/.pyenv/versions/3.11.*/bin/python3.11 2>/dev/null | tail -n 1)
TORCH_VENV := .cache/venv-torch

VENV := .venv
CLIENT_VENV := .cache/venv-client
BIN := $(VENV)/bin

.PHONY: setup browser demo serve test lint typecheck template unit client-tests openapi bench clean

$(BIN)/.installed: pyproject.toml infra/layer/requirements.txt infra/requirements-dev.txt
	@test -n "$(PY312)" || { echo "python3.12 is needed (the Lambda runtime); none found" >&2; exit 1; }
	test -x $(BIN)/python || $(PY312) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[server,dev]'
	touch $@

$(CLIENT_VENV)/.installed: pyproject.toml
	test -x $(CLIENT_VENV)/bin/python || $(PY_CLIENT) -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/pip install --quiet -e . pytest==9.2.0 pytest-timeout==2.4.0
	touch $@

$(TORCH_VENV)/.installed: pyproject.toml
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the torchrun test); none found" >&2; exit 1; }
	test -x $(TORCH_VENV)/bin/python || $(PY311) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet torch==2.13.0 transformers==5.18.0 accelerate==1.15.0 lightning==2.6.6 -e .
	touch $@

setup: $(BIN)/.installed

# Debian's Chromium for the browser tests (Playwright drives it; it never downloads a browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: setup
	$(BIN)/python -m infra.demo

serve: setup
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

client-tests: $(CLIENT_VENV)/.installed
	$(CLIENT_VENV)/bin/python -m pytest tests/client -m client -p no:cacheprovider

test: lint typecheck template unit client-tests

# openapi.json is generated from the code; a test fails when it is out of date.
openapi: setup
	$(BIN)/python -m infra.openapi

# The benchmarks. The client's is measured beside the floor, wandb offline and tensorboardX, which get
# a venv of their own (never the client's).
BENCH_VENV := .cache/venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PY312) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet orjson==3.13.0 wandb==0.31.0 tensorboardX==2.6.5 -e .
	touch $@

# The Lightning integration's overhead beside WandbLogger (offline): torch 2.13.0 needs Python 3.11.
BENCH_LIGHTNING_VENV := .cache/venv-bench-lightning
$(BENCH_LIGHTNING_VENV)/.installed: pyproject.toml
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the Lightning benchmark); none found" >&2; exit 1; }
	test -x $(BENCH_LIGHTNING_VENV)/bin/python || $(PY311) -m venv $(BENCH_LIGHTNING_VENV)
	$(BENCH_LIGHTNING_VENV)/bin/pip install --quiet torch==2.13.0 lightning==2.6.6 wandb==0.30.0 -e .
	touch $@

# The Hugging Face Trainer callback's overhead beside wandb's integration (offline), likewise.
BENCH_HF_VENV := .cache/venv-bench-hf
$(BENCH_HF_VENV)/.installed: pyproject.toml
	@test -n "$(PY311)" || { echo "python3.11 is needed for torch 2.13.0 (the Trainer benchmark); none found" >&2; exit 1; }
	test -x $(BENCH_HF_VENV)/bin/python || $(PY311) -m venv $(BENCH_HF_VENV)
	$(BENCH_HF_VENV)/bin/pip install --quiet torch==2.13.0 transformers==5.18.0 accelerate==1.15.0 wandb==0.30.0 -e .
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
	$(BENCH_LIGHTNING_VENV)/bin/python benchmarks/lightning_overhead.py
	$(BENCH_HF_VENV)/bin/python benchmarks/hf_overhead.py

clean:
	rm -rf $(VENV) $(CLIENT_VENV) $(TORCH_VENV) .aws-sam
