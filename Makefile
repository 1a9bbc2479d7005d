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

test: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The inner loop (CONTRIBUTING.md, "The test tiers"): every test not marked slow, gpu or tools, less
# the files and tests that start real nodes, the demo or compilers (docs/test-durations.md says why
# each is left out). `make test` stays the full suite and what CI runs.
FAST_IGNORE := tests/orchestrator/test_cli.py tests/orchestrator/test_demo.py \
	tests/orchestrator/frontdoor/test_frontdoor.py tests/gpuprims/cuda/test_archs.py
FAST_DESELECT := tests/gpuprims/profile/test_measure.py::test_cli_device_cpu_records_the_pool_and_the_stages \
	tests/gpuprims/test_wire.py::test_fuzz_header_parser_python_and_native_agree \
	tests/gpuprims/test_cpushare.py::test_apply_in_child_sets_affinity_and_threads \
	tests/apps/test_zoo.py::test_weights_are_bit_identical_in_another_process
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow and not gpu and not tools and not heavy" $(addprefix --ignore=,$(FAST_IGNORE)) \
		$(addprefix --deselect=,$(FAST_DESELECT))

# The same run with two busy loops beside it: the tests must not assume a fast or idle machine.
test-contended: setup
	scripts/install-tools.sh
	$(PY) -m ruff check .
	scripts/contended.sh $(PY) -m pytest -q

# The minutes-long verifications `make test` leaves out (marker `heavy`): every zoo model through every CPU
# engine, inductor compiles.
test-heavy: setup
	$(PY) -m pytest -q -m heavy

demo: setup
	$(PY) -m orchestrator.demo

# Your models (README.md): build the example Triton model repository, serve it with
# `gpuprims-orchestrator start --model-repository`, ask every model over HTTP, gRPC and UDP, stop the node.
demo-repository: setup
	$(PY) examples/repository_demo.py

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache
