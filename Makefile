# The few commands a newcomer needs. Each installs whatever is missing first.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=


.PHONY: setup native run test lint bench-quick clean

setup:
	@bash scripts/setup.sh

## native: build the optional native fast path when missing or stale (native/fastpath.c,
## native/pyfast.c; see native/README.md). Without gcc or Python.h it says so and carries on:
## everything then runs in Python.
native: setup
	@$(PY) -m kvstore.dataplane.native

## run: set up, then run the main job (a local cluster serving a slice of a real trace with KV reuse)
run: setup native
	$(PY) -m kvstore.cli.main run

## test: set up, then run the whole suite (lint and type checks included)
test: setup native
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvstore conductor planner bench
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvstore conductor planner

bench-quick: setup
	$(PY) -m kvstore.cli.main bench tiers --quick
	$(PY) -m kvstore.cli.main bench hashing --quick
	$(PY) -m kvstore.cli.main bench datapath --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
