# The README's two commands are `make demo` and `make test`; CI runs `make test` (via .ci/run).
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-dev demo test test-fast lint bench

install:
	bash scripts/install.sh

install-dev:
	bash scripts/install.sh dev

# The main job: a whole swarm on this machine (trainer, validator, inferers, a cheating inferer) trains a
# tiny model until its held-out accuracy rises, then prints a summary (docs/quickstart.md).
demo: install
	$(BIN)/prime-node demo

# pytest-xdist workers: one per logical CPU, at most 4, an idle one taking tests queued for another
# (worksteal). The 30 slowest tests are listed at the end: the suite's profile (docs/testing.md).
PARALLEL := -n logical --maxprocesses 4 --dist worksteal

# Everything CI checks: the full test suite (slow tests included), then ruff and mypy.
test: install-dev
	$(BIN)/pytest -m "slow or not slow" $(PARALLEL) --durations=30
	$(MAKE) lint

# The quick default suite (slow tests excluded), for the edit-test loop.
test-fast:
	$(BIN)/pytest $(PARALLEL)

lint:
	$(BIN)/ruff check .
	$(BIN)/mypy

bench:
	@for b in benchmarks/*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done
