#!/bin/sh
# Links the C core, compiled with the given compiler and flags, into one
# executable with the given sources: how the sanitizer and fuzz builds get
# the core without touching the Python extension.  Each per-ISA kernel file
# gets its own -m flags, exactly as setup.py's CORE_SOURCES gives them (keep
# the two lists in step), so the binary runs on any CPU of its architecture
# and dispatches at run time like the extension does.
#
#   tools/build_c.sh OUTPUT CC "CFLAGS" SOURCE...
set -eu
out=$1 cc=$2 cflags=$3
shift 3
src=_core/src
objdir=$out.objs
mkdir -p "$objdir"
common="-std=c11 -Wall -Wextra -Wno-unused-parameter -pthread -I_core/include -I$src"

compile() { # source, extra flags
    obj=$objdir/$(basename "$1" .c).o
    # shellcheck disable=SC2086  # flag lists are meant to split
    $cc $cflags $common $2 -c "$1" -o "$obj"
    objs="$objs $obj"
}

objs=
for f in dispatch fpenv lists threads scale_rule kernels_scalar; do
    compile "$src/$f.c" ""
done
case $(uname -m) in
x86_64 | amd64 | i?86)
    compile "$src/kernels_avx2.c" "-mavx2 -mf16c -mfma"
    compile "$src/kernels_avx512.c" "-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx2 -mf16c -mfma"
    ;;
aarch64 | arm64)
    compile "$src/kernels_neon.c" ""
    ;;
esac
for f in "$@"; do
    compile "$f" ""
done
# shellcheck disable=SC2086
$cc $cflags -pthread $objs -o "$out" -lm
