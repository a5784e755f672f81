"""Speed of the numpy-level core (``lossscale.core.unscale_``) against its peers.

Side by side, on the same arrays, at one thread and at the machine's
thread count:

* ``core``       -- ``lossscale.core.unscale_(arrays, s)``: one call per list;
* ``multiply``   -- ``np.multiply(a, s, out=a)`` per array: the memory
                    roofline (same bytes read and written, no check);
* ``numpy``      -- ``np.isfinite(a).all()`` then the multiply, per array:
                    what a numpy user writes (a Python loop over the list);
* ``torch``      -- ``torch._amp_foreach_non_finite_check_and_unscale_`` on
                    CPU tensors sharing the arrays' memory (if torch imports).

numpy is single-threaded: its columns are the same in both thread rows.
Values stay finite (standard normal, scaled alternately by 1/2 and 2, both
exact), so nothing short-circuits.  Reported: medians over repeats, ratios,
the issue's goals, and a throughput-against-size sweep.  Writes
``results/core.json``, ``results/core.md`` and ``results/core_throughput.png``.

``LOSSSCALE_BENCH_QUICK=1`` runs a small smoke version (no 1 GiB tensor).
"""

import gc
import json
import os
import platform
import statistics
import sys
import time

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import workloads  # noqa: E402

from lossscale import core  # noqa: E402

try:
    import torch
except Exception:  # torch is an optional peer
    torch = None

QUICK = os.environ.get("LOSSSCALE_BENCH_QUICK", "") not in ("", "0")
RESULTS = os.path.join(HERE, "results")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", BF16: "bfloat16"}
METHODS = ["core", "multiply", "numpy", "torch"]
SCALES = (0.5, 2.0)  # alternate: exact both ways, values stay where they are

GOAL_SINGLE = 1.15   # core / multiply, single thread, float32
GOAL_TINY = 10.0     # numpy loop / core on 2,000 tiny tensors


# ------------------------------------------------------------ the methods


def make_methods(arrays):
    """name -> zero-argument callable doing one unscale pass over the list;
    each call alternates the scale so repeated calls keep values in range."""
    dtype = arrays[0].dtype
    typed = [dtype.type(s) for s in SCALES]
    state = {"i": 0}

    def flip():
        state["i"] ^= 1
        return state["i"]

    def run_core():
        core.unscale_(arrays, SCALES[flip()])

    def run_multiply():
        s = typed[flip()]
        for a in arrays:
            np.multiply(a, s, out=a)

    def run_numpy():
        s = typed[flip()]
        finite = True
        for a in arrays:
            finite &= bool(np.isfinite(a).all())
            np.multiply(a, s, out=a)
        return finite

    methods = {"core": run_core, "multiply": run_multiply, "numpy": run_numpy}
    if torch is not None:
        if dtype == BF16:
            tensors = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in arrays]
        else:
            tensors = [torch.from_numpy(a) for a in arrays]
        found_inf = torch.zeros(1, dtype=torch.float32)
        invs = [torch.full((1,), s, dtype=torch.float32) for s in SCALES]

        def run_torch():
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf,
                                                             invs[flip()])

        methods["torch"] = run_torch
    return methods


def set_threads(n):
    core.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n if n > 0 else machine_threads())


# Pause before each sample.  torch's OpenMP workers keep spinning for a
# while after a parallel region; without a gap they steal the cores from
# whichever method is timed next.  Every method gets the same gap.
SETTLE_S = 0.02


def measure(methods, reps, min_sample=2e-3):
    """Median seconds per call of each method; methods are interleaved in
    every repeat so that drift hits all of them alike."""
    number = {}
    for name, fn in methods.items():
        fn()  # warm up (page faults, thread start, lazy init)
        t0 = time.perf_counter()
        fn()
        once = time.perf_counter() - t0
        number[name] = max(1, int(min_sample / max(once, 1e-9)))
    samples = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            k = number[name]
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t0) / k)
    return {name: {"median_s": statistics.median(v), "min_s": min(v), "reps": len(v),
                   "calls_per_sample": number[name]} for name, v in samples.items()}


# -------------------------------------------------------------- the cases


def cases():
    """(workload, dtype, repeats)"""
    if QUICK:
        return [("resnet50", np.float32, 3), ("tiny_2000x64", np.float32, 5),
                ("resnet50", np.float16, 3), ("tiny_2000x64", BF16, 3)]
    return [
        ("resnet50", np.float32, 11),
        ("resnet50", np.float16, 9),
        ("resnet50", BF16, 7),
        ("bert_base", np.float32, 5),
        ("gib", np.float32, 5),
        ("tiny_2000x64", np.float32, 21),
        ("tiny_2000x64", np.float16, 15),
        ("tiny_2000x64", BF16, 11),
    ]


def sweep_sizes():
    if QUICK:
        return [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    return [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB of float32


def machine_threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def load_average():
    """1-minute load average: other work on the machine skews every column."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_case(name, dtype, reps, thread_counts):
    arrays = workloads.arrays(name, dtype)
    nbytes = sum(a.nbytes for a in arrays)
    rows = []
    numpy_result = None
    for threads in thread_counts:
        set_threads(threads)
        methods = make_methods(arrays)
        if numpy_result is not None:  # numpy is single-threaded: measured once
            methods = {k: v for k, v in methods.items() if k not in ("multiply", "numpy")}
        res = measure(methods, reps)
        if numpy_result is None:
            numpy_result = {k: res[k] for k in ("multiply", "numpy")}
        res.update(numpy_result)
        assert core.all_finite(arrays), "values left the finite range"
        for method, r in res.items():
            rows.append(dict(workload=name, dtype=DTYPE_NAMES[np.dtype(dtype)],
                             tensors=len(arrays), values=sum(a.size for a in arrays),
                             bytes=nbytes, threads=threads, method=method,
                             gbps=2 * nbytes / r["median_s"] / 1e9, **r))
        print(f"  {name:>13} {DTYPE_NAMES[np.dtype(dtype)]:>8} threads={threads}: " +
              "  ".join(f"{m}={res[m]['median_s'] * 1e3:.3f}ms" for m in METHODS if m in res),
              flush=True)
    del arrays
    gc.collect()
    return rows


def run_sweep(thread_counts):
    rows = []
    for size in sweep_sizes():
        n = size // 4
        a = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
        reps = 7 if size < (1 << 26) else 5
        for threads in thread_counts:
            set_threads(threads)
            methods = make_methods([a])
            res = measure(methods, reps)
            for method, r in res.items():
                rows.append(dict(bytes=size, threads=threads, method=method,
                                 gbps=2 * size / r["median_s"] / 1e9, **r))
        del a
    return rows


# ------------------------------------------------------------- reporting


def index(rows):
    return {(r["workload"], r["dtype"], r["threads"], r["method"]): r for r in rows}


def ratios_and_goals(rows, thread_counts):
    idx = index(rows)
    ratios, goals = [], []
    keys = sorted({(r["workload"], r["dtype"], r["threads"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2]))
    for w, d, t in keys:
        c = idx[(w, d, t, "core")]["median_s"]
        entry = dict(workload=w, dtype=d, threads=t,
                     core_over_multiply=c / idx[(w, d, t, "multiply")]["median_s"],
                     numpy_over_core=idx[(w, d, t, "numpy")]["median_s"] / c)
        if (w, d, t, "torch") in idx:
            entry["torch_over_core"] = idx[(w, d, t, "torch")]["median_s"] / c
        ratios.append(entry)
    one, many = thread_counts[0], thread_counts[-1]
    for e in ratios:
        if e["dtype"] == "float32" and e["threads"] == one and e["workload"] in (
                "resnet50", "bert_base", "gib"):
            goals.append(dict(goal=f"single-thread float32 {e['workload']}: core within "
                                   f"{GOAL_SINGLE}x of in-place multiply",
                              value=e["core_over_multiply"],
                              met=e["core_over_multiply"] <= GOAL_SINGLE))
        if e["threads"] == many and "torch_over_core" in e and e["workload"] != "tiny_2000x64":
            goals.append(dict(goal=f"{many} threads {e['dtype']} {e['workload']}: core at "
                                   f"least as fast as torch (torch/core >= 1)",
                              value=e["torch_over_core"], met=e["torch_over_core"] >= 1.0))
        if e["workload"] == "tiny_2000x64" and e["threads"] == one:
            goals.append(dict(goal=f"2,000 tiny {e['dtype']} tensors: core >= {GOAL_TINY:g}x "
                                   f"faster than the numpy loop",
                              value=e["numpy_over_core"], met=e["numpy_over_core"] >= GOAL_TINY))
    return ratios, goals


def fmt_time(s):
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} µs"


def markdown(meta, rows, ratios, goals):
    idx = index(rows)
    lines = ["# lossscale.core benchmark", "",
             f"{meta['cpu']}; {meta['threads_machine']} hardware threads; kernel set "
             f"`{meta['simd_level']}`; numpy {meta['numpy']}; torch {meta['torch'] or 'absent'}; "
             f"load average {meta['loadavg_at_start']} at start, {meta['loadavg_at_end']} at end "
             f"(other work on the machine skews every column).",
             "", "Median time per pass over the whole list (lower is better); ratios are "
             "time ratios: `core/multiply` below 1.15 meets the roofline goal, "
             "`numpy/core` and `torch/core` above 1 mean the core is faster.", "",
             "| workload | dtype | threads | core | np.multiply (roofline) | "
             "numpy isfinite+multiply | torch | core/multiply | numpy/core | torch/core |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in ratios:
        k = (e["workload"], e["dtype"], e["threads"])
        cell = lambda m: fmt_time(idx[k + (m,)]["median_s"]) if k + (m,) in idx else "—"  # noqa
        torch_ratio = f"{e['torch_over_core']:.2f}" if "torch_over_core" in e else "—"
        lines.append(f"| {e['workload']} | {e['dtype']} | {e['threads']} | {cell('core')} | "
                     f"{cell('multiply')} | {cell('numpy')} | {cell('torch')} | "
                     f"{e['core_over_multiply']:.2f} | {e['numpy_over_core']:.1f} | {torch_ratio} |")
    lines += ["", "## Goals (issue 2)", ""]
    for g in goals:
        lines.append(f"- {'met' if g['met'] else '**not met**'}: {g['goal']} — {g['value']:.2f}")
    lines += ["", "numpy's columns are single-threaded: the same measurement appears in "
              "every thread row.  Throughput against tensor size: `core_throughput.png`.", ""]
    return "\n".join(lines)


def plot(sweep, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = sorted({(r["method"], r["threads"]) for r in sweep},
                    key=lambda k: (METHODS.index(k[0]), k[1]))
    for method, threads in series:
        if method in ("multiply", "numpy") and threads != min(r["threads"] for r in sweep):
            continue
        pts = sorted((r["bytes"], r["gbps"]) for r in sweep
                     if r["method"] == method and r["threads"] == threads)
        label = method if method in ("multiply", "numpy") else f"{method}, {threads} thr"
        style = "-" if method == "core" else "--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor size (bytes, float32, one tensor)")
    ax.set_ylabel("throughput (GB/s, bytes read + written)")
    ax.set_title(f"unscale + finite check: {meta['cpu']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    os.makedirs(RESULTS, exist_ok=True)
    many = machine_threads()
    thread_counts = [1] if many == 1 else [1, many]
    meta = dict(loadavg_at_start=load_average(), cpu=cpu_name(), machine=platform.machine(), threads_machine=many,
                simd_level=core.simd_level(), python=platform.python_version(),
                numpy=np.__version__, torch=getattr(torch, "__version__", None),
                quick=QUICK, thread_counts=thread_counts)
    print(f"bench_core: {meta['cpu']}, threads {thread_counts}, simd {meta['simd_level']}, "
          f"torch {meta['torch'] or 'absent'}{' (quick)' if QUICK else ''}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for name, dtype, reps in cases():
        rows += run_case(name, dtype, reps, thread_counts)
    print("  size sweep ...", flush=True)
    sweep = run_sweep(thread_counts)
    set_threads(0)
    ratios, goals = ratios_and_goals(rows, thread_counts)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    meta["loadavg_at_end"] = load_average()

    with open(os.path.join(RESULTS, "core.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows, ratios=ratios, goals=goals, sweep=sweep),
                  f, indent=1)
    with open(os.path.join(RESULTS, "core.md"), "w") as f:
        f.write(markdown(meta, rows, ratios, goals))
    try:
        plot(sweep, meta, os.path.join(RESULTS, "core_throughput.png"))
    except ImportError:
        print("  matplotlib missing: no plot", flush=True)

    print("\nratios (time; core/multiply: lower is better, others: higher is better)")
    for e in ratios:
        torch_ratio = f"{e['torch_over_core']:6.2f}" if "torch_over_core" in e else "     -"
        print(f"  {e['workload']:>13} {e['dtype']:>8} threads={e['threads']}: "
              f"core/multiply={e['core_over_multiply']:5.2f}  numpy/core={e['numpy_over_core']:6.1f}"
              f"  torch/core={torch_ratio}")
    print("\ngoals")
    for g in goals:
        print(f"  [{'met' if g['met'] else 'NOT MET'}] {g['goal']}: {g['value']:.2f}")
    print(f"\nbench_core: {meta['seconds']} s; results in bench/results/core.{{json,md}}, "
          f"core_throughput.png")


if __name__ == "__main__":
    main()
