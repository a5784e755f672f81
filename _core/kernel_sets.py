"""The core's kernel sets as the build sees them, read from the one list,
``_core/src/kernel_sets.def`` (which ``dispatch.c``, ``kernels.h`` and
``optim.h`` include as C), for setup.py and tools/*.sh
(``python3 _core/kernel_sets.py sources``).

A kernel set's files are named ``<family>_<set>.c`` (``kernels_avx2.c``);
each is compiled with its set's flags and nothing else is.  The files of no
set (``dispatch.c``, ``lists.c``, ...) get no ISA flags, so the library
loads on any CPU of its architecture and picks its kernels at run time
(``dispatch.c``'s table, from the same list: what each set needs of the
CPU).
"""

import os
import platform
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "src")
LIST = os.path.join(SRC, "kernel_sets.def")

# Flags every core file gets.  -ffp-contract=off: no a*b+c may become one
# fused multiply-add (rounded once), since the results must round every
# operation as numpy and TensorFlow do.  -fno-math-errno: sqrtf and the
# like set no errno (the core never reads it), so loops over them vectorize;
# their results are IEEE's either way.
COMMON_CFLAGS = ["-O3", "-std=c11", "-fvisibility=hidden", "-fno-strict-aliasing",
                 "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-pthread"]

# kernel_sets.def's `arch` column: the machines (platform.machine()) it
# means; None: all.
ARCHES = {
    "ANY": None,
    "X86": ("x86_64", "amd64", "i686", "i386"),
    "ARM64": ("aarch64", "arm64"),
}

_ENTRY = re.compile(
    r"LS_KERNEL_SET\(\s*(?P<name>\w+)\s*,\s*(?P<arch>\w+)\s*,\s*(?P<needs>[^,()]+?)\s*,"
    r"\s*(?P<unscale>\w+)\s*,\s*(?P<optim>\w+)\s*,\s*\"(?P<flags>[^\"]*)\"\s*\)")


def read_list(path=LIST):
    """kernel_sets.def's entries, best first, as dicts of its columns
    (``flags`` split into a list)."""
    with open(path) as f:
        text = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
    entries = []
    for m in _ENTRY.finditer(text):
        entry = m.groupdict()
        if entry["arch"] not in ARCHES:
            raise ValueError(f"{path}: {entry['name']}: unknown arch {entry['arch']}")
        entry["flags"] = entry["flags"].split()
        entries.append(entry)
    # Anything else that looks like an entry is one the pattern missed.
    if len(entries) != text.count("LS_KERNEL_SET(") or not entries:
        raise ValueError(f"{path}: an LS_KERNEL_SET entry is not of the form "
                         "LS_KERNEL_SET(name, arch, needs, unscale, optim, \"flags\")")
    return entries


# (set, machines it is built on (None: all), its files' flags), best first.
KERNEL_SETS = [(e["name"], ARCHES[e["arch"]], e["flags"]) for e in read_list()]


def sets_for(machine=None):
    """The kernel sets built on ``machine`` (default: this one)."""
    machine = (machine or platform.machine()).lower()
    return [(name, flags) for name, machines, flags in KERNEL_SETS
            if machines is None or machine in machines]


def core_sources(machine=None):
    """``[(path relative to the repository root, extra flags)]`` of every
    core file to compile on ``machine``: the generic files, then each set's."""
    names = sorted(f for f in os.listdir(SRC) if f.endswith(".c"))
    all_sets = {name for name, _, _ in KERNEL_SETS}
    built = dict(sets_for(machine))

    def set_of(filename):
        stem = filename[:-2]
        suffix = stem.rsplit("_", 1)[-1] if "_" in stem else None
        return suffix if suffix in all_sets else None

    out = [(os.path.join("_core", "src", f), []) for f in names if set_of(f) is None]
    for name, flags in sets_for(machine):
        out += [(os.path.join("_core", "src", f), list(flags))
                for f in names if set_of(f) == name]
    return [(p, fl) for p, fl in out if set_of(os.path.basename(p)) in (None, *built)]


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "sources"
    if what == "sources":      # one line per file: path, then its flags
        for path, flags in core_sources():
            print(" ".join([path, *flags]))
    elif what == "sets":       # the sets built here, best first
        print(" ".join(name for name, _ in sets_for()))
    elif what == "cflags":
        print(" ".join(COMMON_CFLAGS))
    else:
        sys.exit(f"usage: {sys.argv[0]} [sources|sets|cflags]")
