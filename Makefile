# specpipe: the two commands in the README are `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_ROOT_USER_ACTION := ignore
# Fixed thread count so timings are comparable (2 cores here).
export OMP_NUM_THREADS ?= 2

.PHONY: install test test-fast demo bench clean

# Idempotent. torch comes first and pinned: the CPU wheel is on disk, any other spec pulls CUDA builds.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

demo: install
	$(PYTHON) -m specpipe.demo

bench: install
	specpipe bench engines/smollm2-demo --prompts-set code --prompts-set chat --json-out reports/bench.json --plot reports/bench.png

clean:
	rm -rf engines/*/ triton_repo/*/ reports/ .pytest_cache
