# One way to build and test: these targets are what CI runs.
#   make test   create .venv, install the lock (requirements-dev.txt), build,
#               run the whole suite (tf_keras included: tests/test_tf_keras.py
#               runs its checks in a child process with TF_USE_LEGACY_KERAS=1),
#               over TEST_JOBS workers
#   make test-latest  the same in a copy of the tree (build/latest/), against
#               the newest versions requirements-dev.in allows: an upgrade is
#               a deliberate, tested step
#   make lock   refresh the locks (requirements-*.txt) from requirements-*.in
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
# What the venv installs: the lock (exact versions), or with LOCK=0 the ranges,
# upgraded to the newest they allow (make test-latest).
LOCK   ?= 1
ifeq ($(LOCK),0)
REQS       := requirements-dev.in
BENCH_REQS := requirements-bench.in
PIP_UP     := --upgrade
else
REQS       := requirements-dev.txt
BENCH_REQS := requirements-bench.txt
# Every pip run below the venv's, build isolation and the tests' own venvs
# included, installs the locked versions.
export PIP_CONSTRAINT := $(CURDIR)/requirements-dev.txt
endif
export TF_CPP_MIN_LOG_LEVEL ?= 2
export CUDA_VISIBLE_DEVICES ?=

.PHONY: all build test test-latest lock bench wheel clean sanitize fuzz

all: build

# tools/install.sh: uv where it can (seconds), pip otherwise and for an
# upgrade; no byte-compiling of every module TensorFlow and torch ship.
$(DEPS): $(REQS)
	$(PYTHON) -m venv $(VENV)
	sh tools/install.sh $(PY) $(REQS) $(PIP_UP)
	touch $@

$(BENCH_DEPS): $(DEPS) $(BENCH_REQS)
	sh tools/install.sh $(PY) $(BENCH_REQS) $(PIP_UP)
	touch $@

build: $(DEPS)
	$(PY) setup.py --quiet build_ext --inplace

# The suite is spread over TEST_JOBS workers (pytest-xdist, default: the
# cores, at most 4), a module at a time (tests/conftest.py orders them).
TEST_JOBS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
test: build
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder --durations=25 tests; \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# The tracked tree copied to build/latest/, so that its venv and in-place
# modules never mix with .venv's.
LATEST := build/latest
test-latest:
	rm -rf $(LATEST) && mkdir -p $(LATEST)
	git ls-files -z | tar --null -T - -cf - | tar -xf - -C $(LATEST)
	$(MAKE) -C $(LATEST) test LOCK=0 PYTHON=$(PYTHON)
	$(LATEST)/.venv/bin/python -m pip freeze > $(LATEST)/versions.txt
	@echo "make test-latest: the versions tested are in $(LATEST)/versions.txt"

# One line refreshes both locks to the newest versions the .in ranges allow.
UV_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
lock: $(DEPS)
	$(PY) -m uv pip compile -q --upgrade --python-version 3.11 --custom-compile-command "make lock" \
		requirements-dev.in -o requirements-dev.txt
	$(PY) -m uv pip compile -q --upgrade --python-version 3.11 --custom-compile-command "make lock" \
		$(UV_LINKS) requirements-bench.in -o requirements-bench.txt

# make bench QUICK=1: a small subset into bench/results/quick/ (a few minutes
# after make test, the peers' install included).
# Each layer runs in a pytest process of its own (bench/run.py).
# BENCH_ARGS: extra pytest arguments, e.g. BENCH_ARGS='-k core --threads 1'.
BENCH_QUICK := $(filter-out 0,$(QUICK))
BENCH_OUT   := bench/results$(if $(BENCH_QUICK),/quick)

# The build (a TensorFlow import and a compile) and the peers' install
# (mostly unpacking torch) run side by side.
bench: $(DEPS)
	$(MAKE) --no-print-directory -j2 build $(BENCH_DEPS)
	mkdir -p $(BENCH_OUT)
	rc=0; $(PY) bench/run.py $(BENCH_OUT)/raw.json $(if $(BENCH_QUICK),--quick) \
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
