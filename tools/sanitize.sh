#!/bin/sh
# `make sanitize`: the C core and the numpy bindings built with
# AddressSanitizer and UndefinedBehaviorSanitizer, then exercised.
#
#   1. pure C (LeakSanitizer on too): the fuzz targets (buffers, fused
#      optimizer step, loss-scale rule, sums of squares, Adafactor's step)
#      replaying their corpora and every regression input, and the
#      thread-pool driver, under each kernel level LOSSSCALE_SIMD can name;
#      the thread-pool driver again under ThreadSanitizer; with clang, the
#      replay under clang's ASan (which instruments masked vector loads and
#      stores) and both under MemorySanitizer;
#   2. Python: the extension rebuilt into build/sanitize/ (never over the
#      in-place modules), then every test that needs only lossscale.core,
#      with the sanitizer runtime preloaded into the interpreter; the fuzz
#      inputs again at each lower level.
#
# Any report fails the run (halt_on_error for both sanitizers).  Leak
# checking is off for the interpreter, which keeps its own memory to exit.
# PY may be set (default: the project's virtual environment).  The compiler
# is gcc: its runtime is the one preloaded into the interpreter.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CC=gcc
OUT=build/sanitize
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
# every kernel set built for this architecture (_core/src/kernel_sets.def)
LEVELS=$(python3 _core/kernel_sets.py sets)
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
mkdir -p "$OUT"
# A target's inputs: its corpus, and its regressions once any were kept.
inputs() {
    echo "fuzz/corpus/$1"
    if [ -d "fuzz/regressions/$1" ]; then echo "fuzz/regressions/$1"; fi
}

echo "== C: core + fuzz target replay and thread driver ($CC, ASan+UBSan+LSan)"
tools/build_c.sh "$OUT/replay_core" "$CC" "$SAN -O2" fuzz/fuzz_core.c fuzz/replay.c
tools/build_c.sh "$OUT/replay_scale_rule" "$CC" "$SAN -O2" fuzz/fuzz_scale_rule.c fuzz/replay.c
tools/build_c.sh "$OUT/replay_optim" "$CC" "$SAN -O2" fuzz/fuzz_optim.c fuzz/replay.c
tools/build_c.sh "$OUT/replay_norms" "$CC" "$SAN -O2" fuzz/fuzz_norms.c fuzz/replay.c
tools/build_c.sh "$OUT/replay_adafactor" "$CC" "$SAN -O2" fuzz/fuzz_adafactor.c fuzz/replay.c
tools/build_c.sh "$OUT/replay_lamb" "$CC" "$SAN -O2" fuzz/fuzz_lamb.c fuzz/replay.c
ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_scale_rule" fuzz/corpus/scale_rule fuzz/regressions/scale_rule
tools/build_c.sh "$OUT/test_threads" "$CC" "$SAN -O2" _core/tests/test_threads.c
for level in $LEVELS; do
    # a level this CPU lacks still runs: every entry point must refuse it
    echo "-- LOSSSCALE_SIMD=$level"
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_core" fuzz/corpus/core fuzz/regressions/core
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_optim" fuzz/corpus/optim fuzz/regressions/optim
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_norms" $(inputs norms)
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_adafactor" $(inputs adafactor)
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/replay_lamb" $(inputs lamb)
    LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/test_threads"
done
echo "-- ThreadSanitizer"
tools/build_c.sh "$OUT/test_threads_tsan" "$CC" "-fsanitize=thread -g -O1" _core/tests/test_threads.c
# the fork test starts threads in a child of a threaded parent, which
# TSan only follows when told to
TSAN_OPTIONS=halt_on_error=1:die_after_fork=0 "$OUT/test_threads_tsan"

# With clang: its ASan also checks the AVX-512 masked loads and stores lane
# by lane (gcc's leaves them alone, so only the guard bytes see those), and
# MemorySanitizer.  Without clang these steps are skipped, not failed.
if command -v clang >/dev/null 2>&1; then
    echo "-- clang: ASan+UBSan, then MemorySanitizer"
    tools/build_c.sh "$OUT/clang/replay_core" clang "$SAN -O2" fuzz/fuzz_core.c fuzz/replay.c
    tools/build_c.sh "$OUT/clang/replay_optim" clang "$SAN -O2" fuzz/fuzz_optim.c fuzz/replay.c
    tools/build_c.sh "$OUT/clang/replay_norms" clang "$SAN -O2" fuzz/fuzz_norms.c fuzz/replay.c
    tools/build_c.sh "$OUT/clang/replay_adafactor" clang "$SAN -O2" fuzz/fuzz_adafactor.c \
        fuzz/replay.c
    tools/build_c.sh "$OUT/clang/replay_lamb" clang "$SAN -O2" fuzz/fuzz_lamb.c fuzz/replay.c
    MSAN="-fsanitize=memory -fsanitize-memory-track-origins -fno-omit-frame-pointer -g -O1"
    tools/build_c.sh "$OUT/msan/replay_core" clang "$MSAN" fuzz/fuzz_core.c fuzz/replay.c
    tools/build_c.sh "$OUT/msan/replay_optim" clang "$MSAN" fuzz/fuzz_optim.c fuzz/replay.c
    tools/build_c.sh "$OUT/msan/replay_norms" clang "$MSAN" fuzz/fuzz_norms.c fuzz/replay.c
    tools/build_c.sh "$OUT/msan/replay_adafactor" clang "$MSAN" fuzz/fuzz_adafactor.c fuzz/replay.c
    tools/build_c.sh "$OUT/msan/replay_lamb" clang "$MSAN" fuzz/fuzz_lamb.c fuzz/replay.c
    tools/build_c.sh "$OUT/msan/test_threads" clang "$MSAN" _core/tests/test_threads.c
    for level in $LEVELS; do
        LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 \
            "$OUT/clang/replay_core" fuzz/corpus/core fuzz/regressions/core
        LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 \
            "$OUT/clang/replay_optim" fuzz/corpus/optim fuzz/regressions/optim
        LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 \
            "$OUT/clang/replay_norms" $(inputs norms)
        LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 \
            "$OUT/clang/replay_adafactor" $(inputs adafactor)
        LOSSSCALE_SIMD=$level ASAN_OPTIONS=detect_leaks=1 "$OUT/clang/replay_lamb" $(inputs lamb)
        LOSSSCALE_SIMD=$level "$OUT/msan/replay_core" fuzz/corpus/core fuzz/regressions/core
        LOSSSCALE_SIMD=$level "$OUT/msan/replay_optim" fuzz/corpus/optim fuzz/regressions/optim
        LOSSSCALE_SIMD=$level "$OUT/msan/replay_norms" $(inputs norms)
        LOSSSCALE_SIMD=$level "$OUT/msan/replay_adafactor" $(inputs adafactor)
        LOSSSCALE_SIMD=$level "$OUT/msan/replay_lamb" $(inputs lamb)
        LOSSSCALE_SIMD=$level "$OUT/msan/test_threads"
    done
else
    echo "-- clang steps skipped (ASan on masked vector accesses, MemorySanitizer): no clang"
fi

echo "== Python: lossscale.core built with ASan+UBSan into $OUT/lib"
CC="$CC" CFLAGS="$SAN" LDFLAGS="$SAN" LOSSSCALE_BUILD_TF_OPS=0 \
    "$PY" setup.py --quiet build_ext --build-lib "$OUT/lib" --build-temp "$OUT/tmp"
cp lossscale/*.py "$OUT/lib/lossscale/"

# The sanitizer runtime must be loaded before the interpreter; libstdc++
# too, or ASan cannot intercept C++ exceptions thrown by TensorFlow (which
# the core tests use as an oracle).  PYTHONSAFEPATH keeps the source tree
# (the working directory) off sys.path in this process and every child,
# so the sanitized build is the one imported.
LD_PRELOAD="$($CC -print-file-name=libasan.so) $($CC -print-file-name=libstdc++.so)"
export LD_PRELOAD
export ASAN_OPTIONS=detect_leaks=0
export PYTHONMALLOC=malloc
export PYTHONSAFEPATH=1
export PYTHONPATH="$PWD/$OUT/lib"
"$PY" -c "
import lossscale, sys
sys.exit(0 if lossscale.__file__.startswith('$PWD/$OUT/') else
         'sanitized build not the one imported: ' + lossscale.__file__)"
# --capture=sys: a sanitizer report is written to file descriptor 2 just
# before the process dies; pytest's descriptor capture would lose it.
"$PY" -m pytest -q -p no:cacheprovider --capture=sys tests/test_core_errors.py tests/test_core_exact.py \
    tests/test_core_rule.py tests/test_core_simd.py tests/test_core_threads.py \
    tests/test_fuzz_regressions.py
# the fuzz inputs through the bindings again at each level below the best
# this CPU runs (test_core_simd forces every level in children already, and
# the C drivers above ran at each)
LEVELS=$("$PY" -c "
from lossscale import core
print(' '.join(core.simd_levels()[1:]))")
for level in $LEVELS; do
    echo "-- LOSSSCALE_SIMD=$level"
    LOSSSCALE_SIMD=$level "$PY" -m pytest -q -p no:cacheprovider --capture=sys \
        tests/test_fuzz_regressions.py
done
echo "sanitize: clean"
