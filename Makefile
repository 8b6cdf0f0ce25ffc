# specpipe: the two commands in the README are `make demo` and `make test`.
# Everything installs into the project's own virtual environment (.venv), never the system Python.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_ROOT_USER_ACTION := ignore
# Fixed thread count so timings are comparable (2 cores here).
export OMP_NUM_THREADS ?= 2

.PHONY: install test test-fast demo bench loadtest clean distclean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Idempotent: a stamp records what was installed from which pyproject.toml.
# torch comes first and pinned: the CPU wheel is on disk, any other spec pulls CUDA builds.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

demo: install
	$(PY) -m specpipe.demo

bench: install
	$(VENV)/bin/specpipe bench engines/smollm2-demo --prompts-set code --prompts-set chat --json-out reports/bench.json --plot reports/bench.png

# Load on the demo's Triton repository (built by `make demo`); LOADTEST_LABEL names its row, so runs of
# several deployments can be merged: specpipe loadtest --compare a.json --compare b.json --plot both.png
LOADTEST_LABEL ?= demo
loadtest: install
	$(VENV)/bin/specpipe loadtest triton_repo --label $(LOADTEST_LABEL) --json-out reports/loadtest-$(LOADTEST_LABEL).json --plot reports/loadtest-$(LOADTEST_LABEL).png

clean:
	rm -rf engines/*/ triton_repo/*/ reports/ .pytest_cache

distclean: clean
	rm -rf $(VENV)
