# One way to build and test: these targets are what CI runs.
#   make test   create .venv, install, build, run the whole suite
#   make bench  the same set-up, then the benchmarks -> bench/results/
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
BENCH_DEPS := $(VENV)/.bench-deps-installed
export TF_CPP_MIN_LOG_LEVEL ?= 2
export CUDA_VISIBLE_DEVICES ?=

.PHONY: all build test bench wheel clean

all: build

$(DEPS): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

$(BENCH_DEPS): $(DEPS) requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

build: $(DEPS)
	$(PY) setup.py --quiet build_ext --inplace

test: build
	$(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench: build $(BENCH_DEPS)
	mkdir -p bench/results
	$(PY) bench/run_all.py

wheel: build
	$(PY) -m pip wheel --quiet --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build dist *.egg-info lossscale/*.so lossscale/_native.c lossscale/_build_info.py
