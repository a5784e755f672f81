#!/bin/sh
# `make fuzz`: builds the libFuzzer targets (clang; ASan and UBSan on) and
# fuzzes the core's buffer entry points for FUZZ_SECONDS (default 60), the
# fused optimizer step for half of that, the loss-scale rule for a sixth
# (its input space is small), the sums of squares for a half, then
# Adafactor's step and Lamb's pass for a sixth each.
#
# Inputs that add coverage go to build/fuzz/corpus/<target>, never into the
# checked-in fuzz/corpus (fold them in with -merge=1, see the README); an
# input that fails is written to build/fuzz/artifacts/ and the run exits
# non-zero.
# clang is installed with apt-get when, and only when, it is missing.
set -eu
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${FUZZ_SECONDS:-60}
OUT=build/fuzz
CLANG=${FUZZ_CC:-clang}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v "$CLANG" >/dev/null 2>&1; then
    echo "fuzz: $CLANG not found; installing clang"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang
fi
# libFuzzer's runtime ships apart from clang on Debian and Ubuntu
if ! ls "$("$CLANG" -print-resource-dir)"/lib/*/libclang_rt.fuzzer*.a >/dev/null 2>&1; then
    major=$("$CLANG" -dumpversion | cut -d. -f1)
    echo "fuzz: libFuzzer runtime not found; installing libclang-rt-$major-dev"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "libclang-rt-$major-dev"
fi

FLAGS="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O2"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
mkdir -p "$OUT/artifacts"
for target in core optim scale_rule norms adafactor lamb; do
    tools/build_c.sh "$OUT/fuzz_$target" "$CLANG" "$FLAGS" "fuzz/fuzz_$target.c"
    mkdir -p "$OUT/corpus/$target"
done
run() { # target, seconds
    echo "== fuzz_$1 for $2 s"
    # a target's regressions, once any were kept
    regressions=
    if [ -d "fuzz/regressions/$1" ]; then regressions="fuzz/regressions/$1"; fi
    # the first directory receives new inputs; the checked-in ones are read only
    # shellcheck disable=SC2086  # no regressions: no argument
    "$OUT/fuzz_$1" -max_total_time="$2" -timeout=30 -print_final_stats=1 \
        -artifact_prefix="$OUT/artifacts/$1-" "$OUT/corpus/$1" "fuzz/corpus/$1" $regressions
}
run core "$SECONDS_TO_RUN"
run optim $((SECONDS_TO_RUN / 2 > 10 ? SECONDS_TO_RUN / 2 : 10))
run scale_rule $((SECONDS_TO_RUN / 6 > 10 ? SECONDS_TO_RUN / 6 : 10))
run norms $((SECONDS_TO_RUN / 2 > 10 ? SECONDS_TO_RUN / 2 : 10))
run adafactor $((SECONDS_TO_RUN / 6 > 10 ? SECONDS_TO_RUN / 6 : 10))
run lamb $((SECONDS_TO_RUN / 6 > 10 ? SECONDS_TO_RUN / 6 : 10))
