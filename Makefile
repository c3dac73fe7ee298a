# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv with the package and its test tools on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# One pytest worker per core (at most 4): tests compile XLA programs on one thread each.
PYTEST_WORKERS ?= -n auto --maxprocesses 4 --dist worksteal
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the tests start hundreds of Python processes that would each compile meshplan again.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest

.PHONY: demo test quick lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshplan demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PYTEST) -q $(PYTEST_WORKERS) --durations=10

# Everything but the tests marked slow (subprocesses, several processes, long compiles).
quick: $(STAMP)
	$(PYTEST) -q -m "not slow" $(PYTEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_core.py
	$(VENV)/bin/python benchmarks/bench_plan.py
	$(VENV)/bin/python benchmarks/bench_layouts.py

clean:
	rm -rf $(VENV) build src/*.egg-info
