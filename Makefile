# The README's two commands are `make demo` and `make test`; CI runs `make test` (via .ci/run).
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-dev demo test test-fast lint bench

install:
	bash scripts/install.sh

install-dev:
	bash scripts/install.sh dev

# The embedded local swarm demo arrives with issue 7; until then the main job shows the command list.
demo: install
	$(BIN)/prime-node --help

# Everything CI checks: the full test suite (slow tests included), then ruff and mypy.
test: install-dev
	$(BIN)/pytest -m "slow or not slow"
	$(MAKE) lint

# The quick default suite (slow tests excluded), for the edit-test loop.
test-fast:
	$(BIN)/pytest

lint:
	$(BIN)/ruff check .
	$(BIN)/mypy

bench:
	@for b in benchmarks/*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done
