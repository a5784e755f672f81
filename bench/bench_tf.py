"""Speed and memory of the TensorFlow ops (``lossscale.ops``) against their peers.

One training step's loss-scale work — unscale every gradient, check them all
for inf/NaN, update the loss scale — done four ways, on the same float32
gradient lists, at the same thread count (TensorFlow's intra-op pool and
PyTorch both set to the machine's cores):

* ``native``     -- ``ops.unscale_and_check`` + ``ops.update_loss_scale``
                    inside ``tf.function``: two ops for the whole list;
* ``composite``  -- stock TensorFlow inside ``tf.function``: ``g *
                    tf.cast(1 / scale, g.dtype)`` per tensor, then
                    ``tf.compat.v1.mixed_precision.DynamicLossScale.update``
                    (``is_finite`` + ``reduce_all`` per tensor, the update);
* ``torch``      -- ``torch._amp_foreach_non_finite_check_and_unscale_`` +
                    ``torch._amp_update_scale_`` on CPU tensors (in place);
* ``native_eager`` -- the native op called eagerly, no ``tf.function``.

Workloads (``workloads.py``): ResNet-50 (161 tensors, 25.6M values) and
2,000 tensors of 64 values, each twice: as the function's arguments (every
method pays the same cost of calling a ``tf.function`` with that many
arguments, and nothing can be done in place), and made inside the graph
(ResNet: a fresh buffer per tensor, from an op Grappler cannot fuse with
the composite's multiply, as backprop leaves them; tiny: one ``tf.split``), the time to make them measured alone
and subtracted.  Times are medians (and minima) over interleaved repeats.  Values stay finite; torch alternates its inverse scale between
1/2 and 2 (exact both ways) so that in-place repeats keep values in range.

Memory: on one 1 GiB float32 gradient, the peak resident memory a step adds,
each method in its own subprocess, in two situations: the gradient made
inside the step (as backprop makes it: TensorFlow may hand its buffer to the
op that consumes it) and the gradient passed in from outside (it stays
alive, so nothing can reuse it).

Writes ``results/tf.json``, ``results/tf.md`` (and ``results/tf_throughput.png``
when matplotlib imports).  ``LOSSSCALE_BENCH_QUICK=1``: a small smoke run.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

QUICK = os.environ.get("LOSSSCALE_BENCH_QUICK", "") not in ("", "0")
RESULTS = os.path.join(HERE, "results")
GIB = 1 << 30

# Pause before each timed call: torch's OpenMP workers keep spinning for a
# while after a parallel region and would steal the next method's cores.
SETTLE_S = 0.01

GOAL_RESNET = 4.0        # composite / native, ResNet-50
GOAL_TINY = 20.0         # composite / native, 2,000 tiny tensors
GOAL_TORCH = 1.0         # torch / native, ResNet-50 (native not slower)
GOAL_MEMORY_NATIVE = 0.05
GOAL_MEMORY_COMPOSITE = 1.0


def machine_threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def import_tf(threads):
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def import_torch(threads):
    try:
        import torch
    except Exception:  # torch is an optional peer
        return None
    torch.set_num_threads(threads)
    return torch


# ------------------------------------------------------------ the methods

def loss_scale_steps(tf):
    """The two ways of doing one step's loss-scale work on a gradient list,
    each with its own state: ``(native_step, composite_step, reference)``;
    a step maps gradients to ``(unscaled, should_apply)``."""
    import warnings

    from lossscale import ops

    scale = tf.Variable(2.0 ** 15)
    counter = tf.Variable(0, dtype=tf.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=2.0 ** 15, increment_period=10 ** 9)

    def native_step(gs):
        outs, finite = ops.unscale_and_check(gs, scale)
        return outs, ops.update_loss_scale(finite, scale, counter, increment_period=10 ** 9)

    def composite_step(gs):
        inv = 1.0 / reference()
        outs = [g * tf.cast(inv, g.dtype) for g in gs]
        return outs, reference.update(outs)[1]

    return native_step, composite_step, reference


def tf_methods(tf, arrays, in_graph=False):
    """name -> zero-argument callable running one step with TensorFlow.

    With ``in_graph`` the gradients are made inside the function from its
    argument (tiny lists: one ``tf.split`` of a flat tensor; big ones: a
    fresh buffer per tensor, as backprop would leave them) and
    ``producer`` makes them without the step, to be subtracted.
    """
    import numpy as np

    native_step, composite_step, _ = loss_scale_steps(tf)

    if not in_graph:
        grads = [tf.constant(a) for a in arrays]
        native_fn = tf.function(native_step)
        composite_fn = tf.function(composite_step)
        return {
            "native": lambda: native_fn(grads),
            "composite": lambda: composite_fn(grads),
            "native_eager": lambda: native_step(grads),
        }

    if len(arrays) > 500:
        sizes = [a.size for a in arrays]
        seed = tf.constant(np.concatenate([a.ravel() for a in arrays]))

        def produce(x):
            return tf.split(x, sizes)
    else:
        # Each gradient ends in an op Grappler cannot see through (the
        # stateful pass-through of the op library, which hands on its input
        # buffer), as backprop ends in a convolution or matmul gradient.
        # Without it Grappler moves the composite's multiply by a scalar
        # through the reverse into the producer's own multiply, and the
        # composite's unscale costs nothing — which no real gradient allows.
        from lossscale import _loader

        opaque = _loader.load()[0].loss_scale_debug_buffer_address
        seed = tf.constant(1.0)
        sources = [tf.constant(a) for a in arrays]

        def produce(x):
            return [opaque(tf.reverse(t * x, [0]))[0] for t in sources]

    def consume(gs):
        # Every method ends the same way: a read of one value per tensor, so
        # nothing is pruned and the producer alone costs what it costs in
        # the others.
        return tf.add_n([tf.reduce_sum(g[:1]) for g in gs])

    def producer(x):
        return consume(produce(x))

    def with_consumer(step):
        def run(x):
            outs, flag = step(produce(x))
            return consume(outs), flag
        return run

    native_fn = tf.function(with_consumer(native_step))
    composite_fn = tf.function(with_consumer(composite_step))
    producer_fn = tf.function(producer)
    return {
        "native": lambda: native_fn(seed),
        "composite": lambda: composite_fn(seed),
        "producer": lambda: producer_fn(seed),
    }


def torch_method(torch, arrays):
    if torch is None:
        return None
    tensors = [torch.from_numpy(a.copy()) for a in arrays]
    found_inf = torch.zeros(1)
    inv = [torch.tensor([0.5]), torch.tensor([2.0])]
    scale = torch.tensor([2.0 ** 15])
    tracker = torch.zeros(1, dtype=torch.int32)
    state = {"i": 0}

    def step():
        state["i"] ^= 1
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv[state["i"]])
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 10 ** 9)

    return step


def measure(methods, reps, warmup=3):
    """Per method, interleaved: median and minimum wall seconds per call, and
    median process CPU seconds per call (every thread, idle spinning included)."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    wall = {name: [] for name in methods}
    cpu = {name: [] for name in methods}
    names = list(methods)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(SETTLE_S)
            c0, t0 = time.process_time(), time.perf_counter()
            methods[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return ({name: statistics.median(ts) for name, ts in wall.items()},
            {name: min(ts) for name, ts in wall.items()},
            {name: statistics.median(ts) for name, ts in cpu.items()})


def workload_arrays(name, scale_down=1):
    import workloads

    arrays = workloads.arrays(name)
    if scale_down > 1:
        arrays = [a.ravel()[: max(1, a.size // scale_down)].copy() for a in arrays]
    return arrays


def run_speed(tf, torch, reps):
    results = {}
    cases = [("resnet50", False), ("resnet50", True), ("tiny_2000x64", False),
             ("tiny_2000x64", True)]
    for name, in_graph in cases:
        arrays = workload_arrays(name, scale_down=8 if QUICK and name == "resnet50" else 1)
        methods = tf_methods(tf, arrays, in_graph=in_graph)
        peer = torch_method(torch, arrays)
        if peer is not None:
            methods["torch"] = peer  # always in place on its own tensors
        key = name + ("_in_graph" if in_graph else "")
        print(f"  {key}: {len(arrays)} tensors, {sum(a.size for a in arrays):,} values",
              flush=True)
        median, best, cpu = measure(methods, reps)
        if in_graph:
            # the step alone: the time to make the gradients taken off
            for d in (median, best, cpu):
                base = d.pop("producer")
                for k in ("native", "composite"):
                    d[k] = max(d[k] - base, 1e-7)
        r = results[key] = {
            "tensors": len(arrays),
            "values": int(sum(a.size for a in arrays)),
            "gradients": ("made in the graph (making them subtracted)" if in_graph
                          else "function arguments"),
            "ms": {k: v * 1e3 for k, v in median.items()},
            "min_ms": {k: v * 1e3 for k, v in best.items()},
            "cpu_ms": {k: v * 1e3 for k, v in cpu.items()},
        }
        for other in ("composite", "torch"):
            if other in median:
                r[f"{other}_over_native"] = median[other] / median["native"]
                r[f"{other}_over_native_min"] = best[other] / best["native"]
                r[f"{other}_over_native_cpu"] = cpu[other] / cpu["native"]
    return results


def run_sweep(tf, torch, reps):
    """Throughput (values/s) against the size of one float32 tensor."""
    import numpy as np

    sizes = [1 << k for k in ((10, 14, 18, 22) if QUICK else (10, 12, 14, 16, 18, 20, 22, 24))]
    rows = []
    for n in sizes:
        arrays = [np.random.default_rng(n).standard_normal(n, dtype=np.float32)]
        methods = tf_methods(tf, arrays)
        del methods["native_eager"]
        peer = torch_method(torch, arrays)
        if peer is not None:
            methods["torch"] = peer
        times, _, _ = measure(methods, reps)
        rows.append({"values": n, **{f"{k}_values_per_s": n / t for k, t in times.items()}})
    return rows


# ---------------------------------------------------------------- memory

def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(method, situation, values):
    """Runs in a subprocess: prints the peak RSS (bytes) one step adds."""
    import gc

    threads = machine_threads()
    tf = import_tf(threads)
    native_step, composite_step, reference = loss_scale_steps(tf)

    def step(g):
        if method == "producer":       # the gradient alone, consumed
            return tf.reduce_sum(g[:1]), tf.constant(True)
        if method == "native":
            (u,), finite = native_step([g])
            return tf.reduce_sum(u[:1]), finite
        if method == "composite":      # TF 2.4: multiply, then the update checks
            (u,), finite = composite_step([g])
            return tf.reduce_sum(u[:1]), finite
        if method == "composite_check_first":  # Keras 3 order: check, then divide
            finite = tf.reduce_all(tf.math.is_finite(g))
            u = g / reference()
            return tf.reduce_sum(u[:1]), finite
        raise ValueError(method)

    if situation == "inside":
        fn = tf.function(lambda v: step(tf.fill([values], v)))
        arg = tf.constant(1.5)
    else:
        fn = tf.function(step)
        arg = tf.fill([values], 1.5)
    fn.get_concrete_function(arg)          # trace before measuring
    gc.collect()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # reset the peak (VmHWM) to now
    out = fn(arg)
    _ = [o.numpy() for o in out]
    peak = _rss_kib("VmHWM")
    print(json.dumps({"added_bytes": (peak - before) * 1024}))


def run_memory(values):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    nbytes = values * 4
    out = {"gradient_bytes": nbytes, "situations": {}}
    for situation in ("inside", "argument"):
        raw = {}
        for method in ("producer", "native", "composite", "composite_check_first"):
            if situation == "argument" and method == "producer":
                raw[method] = 0
                continue
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--memory-child", method,
                 situation, str(values)], capture_output=True, text=True, env=env, cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"memory child {method}/{situation} failed:\n"
                                   + done.stderr[-3000:])
            raw[method] = json.loads(done.stdout.strip().splitlines()[-1])["added_bytes"]
        base = raw["producer"]
        out["situations"][situation] = {
            m: {"added_bytes": raw[m] - base, "fraction_of_gradient": (raw[m] - base) / nbytes}
            for m in raw if m != "producer"}
        out["situations"][situation]["producer_bytes"] = base
    return out


# --------------------------------------------------------------- reports

def write_markdown(report, path):
    lines = ["# TensorFlow ops: speed and memory", ""]
    lines.append(f"Machine: {report['machine']}; threads: {report['threads']} "
                 f"(TensorFlow intra-op pool and torch); TensorFlow {report['tensorflow']}, "
                 f"torch {report['torch'] or 'not installed'}"
                 + (" — QUICK smoke run" if report["quick"] else "") + ".")
    lines += ["", "## Speed (ms per step: median [min]; ratio = other / native, "
              "median [min])", "",
              "| workload | gradients | native | composite | composite/native | torch | "
              "torch/native | native eager |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in report["speed"].items():
        ms, lo = r["ms"], r["min_ms"]

        def cell(k):
            return f"{ms[k]:.2f} [{lo[k]:.2f}]" if k in ms else "–"

        def ratio(other):
            if f"{other}_over_native" not in r:
                return "–"
            return f"**{r[other + '_over_native']:.1f}×** [{r[other + '_over_native_min']:.1f}×]"

        lines.append(
            f"| {name} ({r['tensors']} tensors, {r['values']:,} values) | {r['gradients']} | "
            f"{cell('native')} | {cell('composite')} | {ratio('composite')} | {cell('torch')} | "
            f"{ratio('torch')} | {cell('native_eager')} |")
    g = report["goals"]
    lines += ["", "## Goals (speed: ratios of minima)", ""]
    for k, v in g.items():
        lines.append(f"- {k}: measured {v['measured']:.2f}, goal {v['goal']} — "
                     f"{'met' if v['met'] else 'NOT met'}")
    mem = report["memory"]
    lines += ["", f"## Peak memory a step adds, 1 gradient of {mem['gradient_bytes'] / GIB:.2f} GiB",
              "", "| gradient | native | composite (multiply, then check) | "
              "composite (check, then divide) |", "|---|---|---|---|"]
    for situation, r in mem["situations"].items():
        label = {"inside": "made inside the step", "argument": "passed in (kept alive)"}[situation]
        lines.append(f"| {label} | " + " | ".join(
            f"{r[m]['fraction_of_gradient'] * 100:.1f}%"
            for m in ("native", "composite", "composite_check_first")) + " |")
    lines += ["", "## Reading the numbers", "",
              "- *function arguments*: the caller still holds its tensors, so TensorFlow "
              "lets no op write into them — the native op writes fresh outputs (out of "
              "place), torch works in place on its own tensors, and with 2,000 arguments "
              "the cost of calling a `tf.function` dominates every method.",
              "- *made in the graph*: the gradients are fresh buffers inside the step, as "
              "after backprop; the native op writes into them (in place). The time to make "
              "them is measured alone (ending in the same one-value-per-tensor read as "
              "every method) and subtracted.",
              "- Each ResNet-50 gradient made in the graph ends in an op Grappler cannot "
              "see through; with a plain elementwise producer Grappler folds the "
              "composite's multiply by a scalar into the producer and the composite's "
              "unscale looks free. The composite's per-tensor `Mul`/`IsFinite` still run "
              "as soon as each gradient exists, while it is in cache, overlapped with "
              "making the next one; the one fused op waits for the whole list (100 MB, "
              "over three times the L3 cache) and streams it back from memory.",
              "- Memory, *multiply, then check* (TensorFlow 2.4's order): TensorFlow's own "
              "`Mul` also reuses a fresh gradient buffer, so what it adds is the `is_finite` "
              "temporary (1 byte per value). *check, then divide* (Keras 3's order) keeps "
              "the input alive while dividing: a full copy plus the temporary.",
              "- Times are medians over interleaved repeats, minima in brackets; on a "
              "machine shared with other jobs the minima are the steadier figure, and the "
              "goals use them. (`cpu_ms` in the JSON is process CPU time per call; it "
              "includes thread pools spinning while idle, so it is not a measure of work.)",
              ""]
    lines += ["", "## Throughput against tensor size (values/s, one float32 tensor)", "",
              "| values | native | composite | torch |", "|---|---|---|---|"]
    for row in report["sweep"]:
        lines.append(f"| {row['values']:,} | " + " | ".join(
            f"{row[k + '_values_per_s']:.3g}" if k + "_values_per_s" in row else "–"
            for k in ("native", "composite", "torch")) + " |")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = report["sweep"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in ("native", "composite", "torch"):
        if k + "_values_per_s" in rows[0]:
            ax.plot([r["values"] for r in rows], [r[k + "_values_per_s"] for r in rows],
                    marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("values in the tensor (float32)")
    ax.set_ylabel("values per second")
    ax.set_title(f"unscale + check + update, {report['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-child", nargs=3, metavar=("METHOD", "SITUATION", "VALUES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        method, situation, values = args.memory_child
        memory_child(method, situation, int(values))
        return 0

    threads = machine_threads()
    tf = import_tf(threads)
    torch = import_torch(threads)
    from lossscale import ops

    status = ops.native_available()
    if not status:
        print(f"bench_tf: the native op library is not usable ({status.reason}); "
              "build it first (make build)", file=sys.stderr)
        return 1
    reps = 5 if QUICK else 40
    print(f"bench_tf: {threads} threads, {'quick' if QUICK else 'full'} run", flush=True)
    speed = run_speed(tf, torch, reps)
    print("  throughput sweep", flush=True)
    sweep = run_sweep(tf, torch, max(3, reps // 3))
    print("  memory (subprocesses)", flush=True)
    memory = run_memory((1 << 24) if QUICK else GIB // 4)

    resnet = speed["resnet50"]
    inside = memory["situations"]["inside"]
    # Ratios of minima: on a machine shared with other jobs the median
    # measures the neighbours as much as the code (both are in the report).
    goals = {}
    for label, key, other, goal in [
            ("ResNet-50 (arguments) composite/native", "resnet50", "composite", GOAL_RESNET),
            ("ResNet-50 (made in graph) composite/native", "resnet50_in_graph", "composite",
             GOAL_RESNET),
            ("ResNet-50 (made in graph: both in place) torch/native", "resnet50_in_graph",
             "torch", GOAL_TORCH),
            ("ResNet-50 (arguments: native out of place) torch/native", "resnet50", "torch",
             GOAL_TORCH),
            ("2,000 tiny (made in graph) composite/native", "tiny_2000x64_in_graph",
             "composite", GOAL_TINY),
            ("2,000 tiny (arguments) composite/native", "tiny_2000x64", "composite",
             GOAL_TINY)]:
        r = speed[key]
        if f"{other}_over_native_min" in r:
            goals[label] = dict(measured=r[f"{other}_over_native_min"],
                                median=r[f"{other}_over_native"], goal=f">= {goal}")
    goals.update({
        "memory, gradient made in the step: native adds (fraction)": dict(
            measured=inside["native"]["fraction_of_gradient"], goal=f"< {GOAL_MEMORY_NATIVE}"),
        "memory, gradient made in the step: composite (multiply, check) adds": dict(
            measured=inside["composite"]["fraction_of_gradient"],
            goal=f"> {GOAL_MEMORY_COMPOSITE}"),
        "memory, gradient made in the step: composite (check, divide) adds": dict(
            measured=inside["composite_check_first"]["fraction_of_gradient"],
            goal=f"> {GOAL_MEMORY_COMPOSITE}"),
    })
    for g in goals.values():
        op, target = g["goal"].split()
        m, t = g["measured"], float(target)
        g["met"] = bool(m >= t if op == ">=" else (m < t if op == "<" else m > t))
    report = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": threads,
        "tensorflow": tf.__version__,
        "torch": getattr(torch, "__version__", None),
        "quick": QUICK,
        "speed": speed,
        "sweep": sweep,
        "memory": memory,
        "goals": goals,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tf.json"), "w") as f:
        json.dump(report, f, indent=2)
    write_markdown(report, os.path.join(RESULTS, "tf.md"))
    plot(report, os.path.join(RESULTS, "tf_throughput.png"))
    with open(os.path.join(RESULTS, "tf.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
