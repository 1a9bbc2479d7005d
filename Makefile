# Two commands for a new user (README.md): `make demo` runs the main job, `make test` the tests.
# Each sets itself up from a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_INPUTS := pyproject.toml CMakeLists.txt scripts/setup.sh $(shell find native -type f 2>/dev/null)

.PHONY: setup test test-fast test-contended lint demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	VENV=$(VENV) scripts/setup.sh
	touch $@

lint: setup
	$(PY) -m ruff check .

test: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The inner loop: every test not marked slow, gpu or tools (CONTRIBUTING.md, "The test tiers").
# `make test` stays the full suite and what CI runs.
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow and not gpu and not tools"

# The same run with two busy loops beside it: the tests must not assume a fast or idle machine.
test-contended: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	scripts/contended.sh $(PY) -m pytest -q

demo: setup
	$(PY) -m orchestrator.demo

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache
