#!/bin/sh
# Links the C core, compiled with the given compiler and flags, into one
# executable with the given sources: how the sanitizer and fuzz builds get
# the core without touching the Python extension.  The core's files and
# each one's ISA flags come from _core/kernel_sets.py (which reads the one
# list, _core/src/kernel_sets.def), as setup.py's do, so the binary runs on
# any CPU of its architecture and dispatches at run time like the
# extension does.  The given flags come after the common ones, so that
# they win (-O1 for MemorySanitizer, say).
#
#   tools/build_c.sh OUTPUT CC "CFLAGS" SOURCE...
set -eu
out=$1 cc=$2 cflags=$3
shift 3
objdir=$out.objs
mkdir -p "$objdir"
common="$(python3 _core/kernel_sets.py cflags) -I_core/include -I_core/src"

compile() { # source, extra flags
    obj=$objdir/$(basename "$1" .c).o
    # shellcheck disable=SC2086  # flag lists are meant to split
    $cc $common $cflags $2 -c "$1" -o "$obj"
    objs="$objs $obj"
}

objs=
sources=$(python3 _core/kernel_sets.py sources)
while read -r source flags; do
    compile "$source" "$flags"
done <<SOURCES
$sources
SOURCES
for f in "$@"; do
    compile "$f" ""
done
# shellcheck disable=SC2086
$cc $cflags -pthread $objs -o "$out" -lm
