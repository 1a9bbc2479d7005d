# Two commands for a new user (README.md): `make demo` runs the main job, `make test` the tests.
# Each sets itself up from a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_INPUTS := pyproject.toml CMakeLists.txt scripts/setup.sh $(shell find native -type f 2>/dev/null)

.PHONY: setup test test-fast test-contended test-heavy lint demo demo-repository bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	VENV=$(VENV) scripts/setup.sh
	touch $@

lint: setup
	$(PY) -m ruff check .

# Every test, `heavy` ones included (those needing a GPU skip with the reason where there is none);
# docs/test-durations.md has its time. Like test-fast, on TEST_WORKERS pytest-xdist workers, a module on
# one worker; tests/conftest.py orders the modules with heavy tests first so none runs alone at the end.
PYTEST_WORKERS = env PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope
test: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	$(PYTEST_WORKERS)

# The inner loop (CONTRIBUTING.md, "The test tiers"): every test not marked slow, gpu, tools, heavy or
# real (real: starts nodes, instances, the CLI, the demo, compilers or child interpreters), chosen by
# markers alone. A test of this tier whose setup or call takes more than FAST_TEST_LIMIT_S of wall time
# fails (tests/conftest.py), so a slow test cannot join it unseen; the limit is generous for a busy
# machine. `make test` stays the full suite and what CI runs.
# It runs on TEST_WORKERS pytest-xdist workers (default: this machine's cores, at most 4), a test module on one
# worker (its module-scoped servers start once). PYTHONDONTWRITEBYTECODE is cleared for the run: where
# it is set (as on the project's machines), pytest would otherwise re-rewrite the asserts of every test
# module on every run (about 13 s of the collection's 22 on a quiet 2-core machine).
FAST_TEST_LIMIT_S ?= 10
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test-fast: setup
	$(PY) -m ruff check .
	GPUPRIMS_FAST_TEST_LIMIT_S=$(FAST_TEST_LIMIT_S) $(PYTEST_WORKERS) \
		-m "not slow and not gpu and not tools and not heavy and not real"

# The same run with two busy loops beside it: the tests must not assume a fast or idle machine.
test-contended: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	scripts/contended.sh $(PYTEST_WORKERS)

# The minutes-long verifications alone (marker `heavy`: every zoo model through every CPU engine, inductor
# compiles, the benches' quick real-node runs). `make test` runs them too: every test that needs no GPU.
test-heavy: setup
	$(PY) -m pytest -q -m heavy

demo: setup
	$(PY) -m orchestrator.cli.demo

# Your models (README.md): build the example Triton model repository, serve it with
# `gpuprims-orchestrator start --model-repository`, ask every model over HTTP, gRPC and UDP, stop the node.
demo-repository: setup
	$(PY) examples/repository_demo.py

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache
