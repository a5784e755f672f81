# One way to build and test: these targets are what CI runs.
#   make test   create .venv, install, build, run the whole suite (tf_keras
#               included: tests/test_tf_keras.py runs its checks in a child
#               process with TF_USE_LEGACY_KERAS=1)
#   make bench  the same set-up, then the benchmarks -> bench/results/
#               (make bench QUICK=1: the quick subset -> bench/results/quick/)
#   make sanitize  the core and lossscale.core under ASan+UBSan (+LSan, TSan
#                  in C), built apart in build/sanitize/, core tests run there
#   make fuzz   the libFuzzer target for FUZZ_SECONDS (default 60)
#   make wheel  the release artefacts: sdist + repaired wheel -> dist/
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
BENCH_DEPS := $(VENV)/.bench-deps-installed
export TF_CPP_MIN_LOG_LEVEL ?= 2
export CUDA_VISIBLE_DEVICES ?=

.PHONY: all build test bench wheel clean sanitize fuzz

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

# make bench QUICK=1: a small subset (under two minutes) into bench/results/quick/.
# BENCH_ARGS: extra pytest arguments, e.g. BENCH_ARGS='-k core --threads 1'.
BENCH_QUICK := $(filter-out 0,$(QUICK))
BENCH_OUT   := bench/results$(if $(BENCH_QUICK),/quick)

bench: build $(BENCH_DEPS)
	mkdir -p $(BENCH_OUT)
	rc=0; $(PY) -m pytest bench -q -p no:cacheprovider $(if $(BENCH_QUICK),--quick) \
		--benchmark-disable-gc --benchmark-quiet --benchmark-json=$(BENCH_OUT)/raw.json \
		$(BENCH_ARGS) || rc=$$?; \
	$(PY) bench/report.py $(BENCH_OUT)/raw.json || rc=1; exit $$rc

# Never touches the in-place modules: everything lands in build/sanitize/.
sanitize: $(DEPS)
	PY=$(PY) sh tools/sanitize.sh

FUZZ_SECONDS ?= 60
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) sh tools/fuzz.sh

# dist/: the sdist and a manylinux wheel built from it (auditwheel-repaired,
# TensorFlow's shared libraries excluded) against .venv's TensorFlow.
wheel: $(DEPS)
	PY=$(PY) sh tools/wheel.sh dist

clean:
	rm -rf build dist *.egg-info lossscale/*.so lossscale/_native.c lossscale/_build_info.py
