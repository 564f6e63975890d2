# The few commands a newcomer needs. Each installs whatever is missing first.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup run test lint bench-quick clean

setup:
	@bash scripts/setup.sh

## run: set up, then run the main job (a local cluster serving a slice of a real trace with KV reuse)
run: setup
	$(PY) -m kvstore.cli.main run

## test: set up, then run the whole suite (lint and type checks included)
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvstore conductor bench
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvstore conductor

bench-quick: setup
	$(PY) -m kvstore.cli.main bench tiers --quick
	$(PY) -m kvstore.cli.main bench hashing --quick
	$(PY) -m kvstore.cli.main bench datapath --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
