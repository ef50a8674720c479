# The two quick-start commands: `make pipeline` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# dvc.yaml runs `python -m stages.<name>`: the venv's python must come first on PATH
export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup pipeline test test-fast lint

setup: $(VENV)/.installed

# torch first, from the CPU wheel: anything else would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

pipeline: setup
	$(VENV)/bin/posttrain repro   # dvc repro under one MLflow parent run

lint: setup
	$(VENV)/bin/ruff check .

test-fast: setup
	$(PY) -m pytest -m "not slow" -q

test: lint
	$(PY) -m pytest -m "not slow" -q
	$(PY) -m pytest -m slow -q --durations=15
