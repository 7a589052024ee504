PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench man clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/replicator demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Every benchmark, one after the other; writes benchmarks/RESULTS.md. `make bench BENCH_ARGS=--quick` for smoke sizes.
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

# The manual page, rendered from the CLI's parser; tests/unit/test_manpage.py fails until it is regenerated.
man: $(STAMP)
	$(BIN)/python -m replicator.coordinator.manpage > ops/replicator.1.tmp && mv ops/replicator.1.tmp ops/replicator.1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
