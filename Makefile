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

.PHONY: install install-peers test test-fast test-stress demo bench loadtest soak clean distclean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Idempotent: a stamp records what was installed from which pyproject.toml.
# torch comes first and pinned: the CPU wheel is on disk, any other spec pulls CUDA builds.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The peers `make bench` compares with (OpenVINO GenAI, onnxruntime-genai; llama.cpp builds from source, ~15 min
# on 2 cores, so nice'd; its failure leaves the others installed). torch stays pinned: the extras must not move
# specpipe's own pins.
# OpenVINO GenAI runs EAGLE-3 heads as optimum-intel >= 2.0 exports them, which cannot share .venv's optimum:
# that export gets its own environment (specpipe/bench/peers/openvino.py names the packages).
OV_EXPORT_VENV := .venv-ov-export
install-peers: install
	$(PIP) install -q torch==2.13.0 -e '.[dev,peers]'
	test -x $(OV_EXPORT_VENV)/bin/python || $(PYTHON) -m venv $(OV_EXPORT_VENV)
	$(OV_EXPORT_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PY) -c 'from specpipe.bench.peers.openvino import HEAD_EXPORTER; print("\n".join(HEAD_EXPORTER))' \
		| xargs $(OV_EXPORT_VENV)/bin/python -m pip install -q
	-CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-1} nice -n 19 $(PIP) install -q torch==2.13.0 -e '.[dev,peers-llamacpp]'

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# The tests that involve threads, servers or time (marker `timing`), STRESS_COUNT times each in random order,
# with a busy loop on every core: CI shares its machine, and users' machines are loaded too.
STRESS_COUNT ?= 3
test-stress: install
	$(PY) -m specpipe.testing.hog -- $(PY) -m pytest -q -p no:cacheprovider -m timing --count $(STRESS_COUNT) --random-order

# The demo's 25-minute bound counts the install: its clock starts when make reads this file.
DEMO_STARTED := $(shell date +%s)
demo: install
	SPECPIPE_DEMO_STARTED=$(DEMO_STARTED) $(PY) -m specpipe.demo

# Every peer runs where it is installed (`make install-peers`); a missing one is a note under the tables. The peers'
# draft-model rows use K = 2, 4, 8 (specpipe's own rows all of 1..8) to keep the run under an hour on 2 cores.
bench: install
	$(VENV)/bin/specpipe bench engines/smollm2-demo --prompts-set code --prompts-set chat --peer all --peer-k 2,4,8 --json-out reports/bench.json --plot reports/bench.png

# Load on the demo's Triton repository (built by `make demo`); LOADTEST_LABEL names its row, so runs of
# several deployments can be merged: specpipe loadtest --compare a.json --compare b.json --plot both.png
LOADTEST_LABEL ?= demo
loadtest: install
	$(VENV)/bin/specpipe loadtest triton_repo --label $(LOADTEST_LABEL) --json-out reports/loadtest-$(LOADTEST_LABEL).json --plot reports/loadtest-$(LOADTEST_LABEL).png

# 16 streams x 100 requests through the real server on the demo's deployment (`make demo`), mixed lengths and
# sampling settings: fails on any error, server memory growth >= 5%, or a greedy output that differs from the same
# request decoded alone (the near-tie rule). `make test` runs a short version (tests/test_soak.py).
SOAK_ENGINES ?= engines/smollm2-demo
soak: install
	$(PY) -m specpipe.bench.soak $(SOAK_ENGINES) --json-out reports/soak.json

clean:
	rm -rf engines/*/ triton_repo/*/ reports/ .pytest_cache

distclean: clean
	rm -rf $(VENV) $(OV_EXPORT_VENV)
