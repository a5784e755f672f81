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
common="-std=c11 -ffp-contract=off -Wall -Wextra -Wno-unused-parameter -pthread -I_core/include -I$src"

compile() { # source, extra flags
    obj=$objdir/$(basename "$1" .c).o
    # shellcheck disable=SC2086  # flag lists are meant to split
    $cc $cflags $common $2 -c "$1" -o "$obj"
    objs="$objs $obj"
}

objs=
python3 _core/kernel_sets.py sources > "$objdir/sources"
while read -r source flags; do
    compile "$source" "$flags"
done < "$objdir/sources"
for f in "$@"; do
    compile "$f" ""
done
# shellcheck disable=SC2086
$cc $cflags -pthread $objs -o "$out" -lm
