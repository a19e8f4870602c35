# Set-up contract: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# Dev and CI pin the CPU build (on local disk here); pyproject keeps a range for users.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install demo test unit e2e lint format bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# One resolver pass: the pinned torch and the project with its dev extras together.
	$(PY) -m pip install -q $(TORCH_PIN) -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/trainguard run -f examples/gpt/job.yaml

test: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

unit: install
	$(VENV)/bin/pytest -q -m "not e2e" $(PYTEST_ARGS)

e2e: install
	$(VENV)/bin/pytest -q -m e2e $(PYTEST_ARGS)

# Benchmarks: each scenario against its baselines in the same run; writes bench/results.json
# and bench/results.md (see README). BENCH_ARGS="--only recovery,hang" or "--quick" to develop.
bench: install
	$(PY) -m bench $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests examples bench
	$(VENV)/bin/ruff format --check src tests examples bench
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format src tests examples bench
	$(VENV)/bin/ruff check --fix src tests examples bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
