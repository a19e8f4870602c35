# Set-up contract: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# Dev and CI pin the CPU build (on local disk here); pyproject keeps a range for users.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
BENCH_ARGS ?=
# torch 2.13's gloo sometimes aborts a process at exit, after the script has finished
# ("terminate called without an active exception", SIGABRT: seen in a plain torch FSDP2
# script with no trainguard code in it). A failing test that quotes that line runs once
# more, up to three times; any other failure fails at once (docs/development.md).
TORCH_ABORT = --reruns 3 --only-rerun "terminate called without an active exception"

.PHONY: install demo test test-long unit e2e lint format docs bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# One resolver pass: the pinned torch and the project with its dev extras together.
	$(PY) -m pip install -q $(TORCH_PIN) -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The demo: the GPT example in resilient mode on 2 nodes x 2 processes, rank 3 killed at
# step 100 and recovered in process (no step lost), then the job's report.
DEMO_RUN = $(VENV)/bin/trainguard run -f examples/gpt/job-resilient.yaml --inject kill:rank=3@step=100
demo: install
	$(DEMO_RUN)
	$(VENV)/bin/trainguard report "$$($(VENV)/bin/trainguard list -o json | $(PY) -c 'import json, sys; print(json.load(sys.stdin)[-1]["id"])')"

# The suite in two passes: everything on two xdist workers (most tests wait on processes),
# then the "exclusive" tests one at a time: their faults are found by hang and throughput
# rules that a busy machine would trip. Exit code 5 is "nothing collected" (a PYTEST_ARGS
# selection that falls in one pass only). The "long" tests (minutes each: namespace
# hosts, a real Slurm, the Kubernetes emulator's jobs) are test-long's; CI runs both.
test: install
	$(VENV)/bin/pytest -q -m "not exclusive and not long" -n 2 $(TORCH_ABORT) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(VENV)/bin/pytest -q -m "exclusive and not long" $(TORCH_ABORT) $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-long: install
	$(VENV)/bin/pytest -q -m long -n 2 $(TORCH_ABORT) $(PYTEST_ARGS) || [ $$? -eq 5 ]

unit: install
	$(VENV)/bin/pytest -q -m "not e2e" -n 2 $(PYTEST_ARGS)

e2e: install
	$(VENV)/bin/pytest -q -m e2e $(PYTEST_ARGS)

# Benchmarks: each scenario against its baselines in the same run; writes bench/results.json
# and bench/results.md (see README). BENCH_ARGS="--only recovery,hang" or "--quick" to develop.
bench: install
	$(PY) -m bench $(BENCH_ARGS)

# The GPU lane, on a machine with a GPU (README, "GPUs"): the gpu-marked tests, then the
# checkpoint figures with CUDA state. GPU_PY: an interpreter that has torch and
# trainguard's dependencies (default: the venv, installed first), e.g.
# `make gpu-check GPU_PY=python3` with PYTHONPATH=src on a machine without network.
GPU_PY ?= $(PY)
GPU_BENCH_ARGS ?= --sizes 256 --cuda-sizes 1024,4096 --repeats 3
gpu-check: $(if $(filter $(PY),$(GPU_PY)),install)
	$(GPU_PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	$(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider $(PYTEST_ARGS) tests/test_gpu_*.py
	mkdir -p bench/out
	$(GPU_PY) -m bench.checkpoint $(GPU_BENCH_ARGS) --out bench/out/gpu-checkpoint.json

lint: install
	$(VENV)/bin/ruff check src tests examples bench
	$(VENV)/bin/ruff format --check src tests examples bench
	$(VENV)/bin/mypy

# The docs site (docs/, Sphinx with MyST Markdown) into docs/_build/html. The reference
# pages are regenerated from the code first (under CI only checked: a stale committed page
# fails); -W makes every warning an error (a broken link or anchor, a page missing or left
# out of the toctree), -n every unresolved reference.
docs: install
	$(PY) docs/generate_reference.py $(if $(CI),--check)
	$(VENV)/bin/sphinx-build -W --keep-going -n -q -b html docs docs/_build/html

format: install
	$(VENV)/bin/ruff format src tests examples bench
	$(VENV)/bin/ruff check --fix src tests examples bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
