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
# The core's objects depend only on the compiler, the flags and the core's
# files, so the executables built beside each other with the same ones share
# them: they are compiled once, side by side on every core, into a folder
# named by a checksum of all three (OUTPUT's folder/core.<checksum>/).
#
#   tools/build_c.sh OUTPUT CC "CFLAGS" SOURCE...
set -eu
out=$1 cc=$2 cflags=$3
shift 3
common="$(python3 _core/kernel_sets.py cflags) -I_core/include -I_core/src"
sources=$(python3 _core/kernel_sets.py sources)

# shellcheck disable=SC2086  # flag lists are meant to split
key=$( { echo "$cc $common $cflags"; "$cc" --version; echo "$sources";
         find _core/include _core/src -type f | LC_ALL=C sort | xargs cat; } | cksum | tr ' ' -)
mkdir -p "$(dirname "$out")"
coredir=$(dirname "$out")/core.$key

compile() { # source, object, extra flags
    # shellcheck disable=SC2086
    $cc $common $cflags $3 -c "$1" -o "$2"
}

if [ ! -d "$coredir" ]; then
    # compiled into a fresh folder, renamed into place once every object is
    # there: a folder of that name is always complete
    work=$(mktemp -d "$coredir.tmp.XXXXXX")
    pids=
    while read -r source flags; do
        compile "$source" "$work/$(basename "$source" .c).o" "$flags" &
        pids="$pids $!"
    done <<SOURCES
$sources
SOURCES
    failed=0
    for pid in $pids; do wait "$pid" || failed=1; done
    if [ "$failed" != 0 ]; then rm -rf "$work"; exit 1; fi
    # -T: a folder another build renamed into place first is left as it is
    mv -T "$work" "$coredir" 2>/dev/null || rm -rf "$work"
fi

objdir=$out.objs
mkdir -p "$objdir"
objs=$(ls "$coredir"/*.o)
for f in "$@"; do
    obj=$objdir/$(basename "$f" .c).o
    compile "$f" "$obj" ""
    objs="$objs $obj"
done
# shellcheck disable=SC2086
$cc $cflags -pthread $objs -o "$out" -lm
