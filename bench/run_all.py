"""Run every benchmark in this directory (``bench_*.py``), one after another.

Each benchmark is its own process (so one's memory or thread settings do
not leak into the next) and writes its own files under ``bench/results/``.
Benchmarks are found by name, so a new ``bench_<thing>.py`` is picked up
without touching this driver.

    python bench/run_all.py               # all of them
    python bench/run_all.py core keras    # only bench_core.py, bench_keras.py
    python bench/run_all.py --quick       # smoke run (LOSSSCALE_BENCH_QUICK=1)
    python bench/run_all.py --list

Exit status: 0 when every benchmark ran, 1 otherwise (each failure named).
"""

import argparse
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def discover():
    """name -> path of every bench/bench_<name>.py, sorted by name."""
    found = {}
    for path in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        name = os.path.basename(path)[len("bench_"):-len(".py")]
        found[name] = path
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these (core, tf, keras, ...)")
    parser.add_argument("--quick", action="store_true",
                        help="short smoke run: sets LOSSSCALE_BENCH_QUICK=1")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)

    benches = discover()
    if args.list:
        print("\n".join(benches))
        return 0
    unknown = [n for n in args.names if n not in benches]
    if unknown:
        print(f"run_all: no benchmark named {', '.join(unknown)}; have: {', '.join(benches)}",
              file=sys.stderr)
        return 2
    selected = {n: p for n, p in benches.items() if not args.names or n in args.names}
    if not selected:
        print("run_all: no bench_*.py found", file=sys.stderr)
        return 1

    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.quick:
        env["LOSSSCALE_BENCH_QUICK"] = "1"

    failed = []
    summary = []
    for name, path in selected.items():
        print(f"=== bench_{name} ===", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, path], cwd=ROOT, env=env)
        took = time.perf_counter() - t0
        summary.append(f"  bench_{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}, "
                       f"{took:.0f} s")
        if rc != 0:
            failed.append(name)
    print("=== summary ===")
    print("\n".join(summary))
    print("results in bench/results/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
