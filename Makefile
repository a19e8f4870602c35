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

# The suite in two passes: everything on two xdist workers (most tests wait on processes),
# then the "exclusive" tests one at a time: their faults are found by hang and throughput
# rules that a busy machine would trip. Exit code 5 is "nothing collected" (a PYTEST_ARGS
# selection that falls in one pass only).
test: install
	$(VENV)/bin/pytest -q -m "not exclusive" -n 2 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(VENV)/bin/pytest -q -m exclusive $(PYTEST_ARGS) || [ $$? -eq 5 ]

unit: install
	$(VENV)/bin/pytest -q -m "not e2e" -n 2 $(PYTEST_ARGS)

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
