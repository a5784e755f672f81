"""The fused step under MirroredStrategy (two logical CPUs) for sparse
(``tf.IndexedSlices``) gradients and for Keras' gradient clipping, against
the stock ``keras.optimizers.LossScaleOptimizer`` under the same strategy.

Stock Keras all-reduces a sparse gradient by TensorFlow's cross-device op,
which concatenates the replicas' slices and indices in replica order
(``AggregateIndexedSlicesGradients``; nothing is summed), and the family's
``update_step`` then densifies or scatters those slices as a single
replica's; and it clips each replica's unscaled gradients by that
replica's own norms (``_clip_gradients``) before the all-reduce.  The runs
here are those of ``test_fused_distributed.py``: one child process, three
models side by side from the same weights (``stock``; ``ours`` fed the same
spoiled steps; ``one``, ours with each spoiled step spoiled on one replica
only), every copy of every variable, slot, ``iterations``,
``dynamic_scale`` and ``step_counter`` compared bit for bit after every
step, and ``step_path`` asserted.

The gradients are an embedding table's slices (repeated indices, a
different number of slices on each replica, rows no slice reaches) beside
dense ones, made by hand (a spoiled step puts one non-finite element in one
slice: an infinity that clipvalue would clip to a finite value, a NaN) or
by a ``GradientTape`` over a model with a ``keras.layers.Embedding``, and
``Model.fit`` of such a model (a spoiled batch has a non-finite sample
weight).  Adam, AdamW (float16 gradients), SGD with momentum, Adagrad
(int32 indices), Lion, RMSprop (weight decay) and RMSprop with momentum
(whose sparse step stays stock: it says why),
in a ``tf.function`` and eagerly; clipnorm, clipvalue and global_clipnorm
with Adam and SGD with momentum, and global_clipnorm with RMSprop and with
SGD's weight decay (the clip makes their sparse gradient dense; in one
replica's graph TensorFlow would reorder SGD's clip and decay products,
which the all-reduce's sum prevents here).  ``use_ema`` with Adam, and
with SGD under clipnorm, in a ``tf.function``; with
``ema_overwrite_frequency`` eagerly (in a ``tf.function`` stock Keras
fails); with a variable without a gradient it stays stock, saying why.
The Adam cases run again on two workers of a MultiWorkerMirroredStrategy.
"""

import json
import sys

import numpy as np
import pytest

import test_fused_distributed as distributed
from test_fused_distributed import TIMEOUT, copies, digest, per_replica, spoil, state
from test_multiworker import Child, ChildFailed, collect, free_ports, port_collision

GROWTH = 3
INITIAL_SCALE = 2.0**10
VOCAB, DIM, OUT = 24, 4, 3  # indices < 16: rows 16.. never reached
SLICES = (6, 5)  # slices on replica 0 and 1
STEPS = 24

# name -> (inner, clip keyword and value or None, how the step runs, the
#          gradients ("int64" or "int32" indices, float32 values; "float16":
#          int64 indices, every gradient float16; "no_kernel_gradient": the
#          kernel's None), None where the step is fused, else what its
#          step_path says).  The
# step runs "eager", or in a tf.function that returns nothing ("function")
# or a value ("returns": TensorFlow's graph optimizer rewrites some of a
# step by whether it knows the function's outputs).
CASES = {
    "adam": ("adam", None, "function", "int64", None),
    "adam_eager": ("adam", None, "eager", "int64", None),
    "adamw_float16": ("adamw", None, "function", "float16", None),
    "sgd_momentum": ("sgd_momentum", None, "function", "int64", None),
    "adagrad_int32": ("adagrad", None, "function", "int32", None),
    "lion": ("lion", None, "function", "int64", None),
    "rmsprop": ("rmsprop", None, "function", "int64", None),
    "lamb": ("lamb", None, "function", "int64", None),
    "lamb_clipnorm_float16": ("lamb", ("clipnorm", 3.0), "function", "float16", None),
    "rmsprop_momentum": ("rmsprop_momentum", None, "function", "int64",
                         "RMSprop with momentum densifies each step of a sparse gradient"),
    "adam_clipnorm": ("adam", ("clipnorm", 3.0), "function", "int64", None),
    "adam_clipvalue": ("adam", ("clipvalue", 2.0), "function", "int64", None),
    "adam_global_clipnorm": ("adam", ("global_clipnorm", 10.0), "function", "int64", None),
    "adam_clipnorm_float16": ("adam", ("clipnorm", 3.0), "function", "float16", None),
    "sgd_clipnorm": ("sgd_momentum", ("clipnorm", 3.0), "returns", "int64", None),
    "sgd_clipvalue": ("sgd_momentum", ("clipvalue", 2.0), "function", "int64", None),
    "sgd_global_clipnorm": ("sgd_momentum", ("global_clipnorm", 10.0), "function", "int64",
                            None),
    "sgd_decay_global_clipnorm": ("sgd_momentum_decay", ("global_clipnorm", 10.0), "returns",
                                  "int64", None),
    "sgd_clipvalue_eager": ("sgd_momentum", ("clipvalue", 2.0), "eager", "int64", None),
    "adam_ema": ("adam_ema", None, "function", "int64", None),
    "sgd_ema_clipnorm": ("sgd_momentum_ema", ("clipnorm", 3.0), "function", "int64", None),
    "adam_ema_overwrite_eager": ("adam_ema_overwrite", None, "eager", "int64", None),
    "adam_ema_no_kernel_gradient": ("adam_ema", None, "function", "no_kernel_gradient",
                                    "EMA under a tf.distribute strategy with no gradient for "
                                    "kernel"),
    "rmsprop_global_clipnorm": ("rmsprop", ("global_clipnorm", 10.0), "function", "int64",
                                None),
}


def inner_optimizer(name, clip):
    import keras

    kwargs = {} if clip is None else {clip[0]: clip[1]}
    return {
        "adam": lambda: keras.optimizers.Adam(0.01, **kwargs),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, **kwargs),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.5, nesterov=True,
                                                     **kwargs),
        "sgd_momentum_decay": lambda: keras.optimizers.SGD(0.05, momentum=0.5,
                                                           weight_decay=0.01, **kwargs),
        "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9,
                                                  **kwargs),
        "adam_ema_overwrite": lambda: keras.optimizers.Adam(
            0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3, **kwargs),
        "sgd_momentum_ema": lambda: keras.optimizers.SGD(0.05, momentum=0.5, use_ema=True,
                                                         ema_momentum=0.8, **kwargs),
        "lion": lambda: keras.optimizers.Lion(0.001, **kwargs),
        "adagrad": lambda: keras.optimizers.Adagrad(0.05, **kwargs),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01, rho=0.8, weight_decay=0.01,
                                                    **kwargs),
        "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.3, **kwargs),
        "lamb": lambda: keras.optimizers.Lamb(0.01, weight_decay=0.01, **kwargs),
    }[name]()


def spoiled_value(step, replica, one_sided):
    """The value a spoiled step puts in this replica's gradient, else None."""
    spoiled = spoil(step)
    if spoiled is None:
        return None
    who, value = spoiled
    return value if who == "all" or who == replica or not one_sided else None


def gradients(step, replica, one_sided):
    """This replica's scaled gradients, as arrays: the table's slices
    (indices, values) and the dense kernel and bias; unscaled, about unit
    size at the initial scale."""
    rng = np.random.default_rng([17, step, replica])
    n = SLICES[replica]
    indices = rng.integers(0, 16, n)
    indices[-1] = indices[0]  # a row taken twice, at least
    values = (rng.standard_normal((n, DIM)) * 1000).astype(np.float32)
    kernel = (rng.standard_normal((DIM, OUT)) * 1000).astype(np.float32)
    bias = (rng.standard_normal(OUT) * 1000).astype(np.float32)
    value = spoiled_value(step, replica, one_sided)
    if value is not None:
        # In the last slice: stock's check of a sparse gradient keeps only a
        # row's last slice's flag (lossscale.optimizer's documented
        # difference), and would miss it in an earlier one.
        values[-1, 2] = value
    return indices, values, kernel, bias


# --------------------------------------------------- inside a child process

def make_table_variables(seed=0):
    import keras

    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.standard_normal(shape).astype(np.float32), name=name)
            for name, shape in (("table", (VOCAB, DIM)), ("kernel", (DIM, OUT)),
                                ("bias", (OUT,)))]


def loss_scale_optimizer(model_name, inner, clip):
    """The stock optimizer for ``"stock"``, else ours, around a new inner."""
    import keras

    import lossscale

    cls = keras.optimizers.LossScaleOptimizer if model_name == "stock" else \
        lossscale.LossScaleOptimizer
    return cls(inner_optimizer(inner, clip), initial_scale=INITIAL_SCALE,
               dynamic_growth_steps=GROWTH)


def make_optimizers(strategy, inner, clip, build_variables):
    """``{model name: (variables, optimizer)}`` for stock, ours and one."""
    made = {}
    for name in ("stock", "ours", "one"):
        with strategy.scope():
            variables = build_variables()
            opt = loss_scale_optimizer(name, inner, clip)
            opt.build(variables)
        made[name] = (variables, opt)
    return made


def hand_made_step(strategy, variables, opt, mode, kind):
    """One step: ``strategy.run`` of ``opt.apply`` on each replica's slices
    of the table and its dense gradients."""
    import tensorflow as tf

    def replica(indices, values, kernel, bias):
        if kind == "float16":
            values, kernel, bias = (tf.cast(x, tf.float16) for x in (values, kernel, bias))
        index_dtype = tf.int32 if kind == "int32" else tf.int64
        table = tf.IndexedSlices(values, tf.cast(indices, index_dtype),
                                 tf.constant([VOCAB, DIM], tf.int64))
        opt.apply([table, None if kind == "no_kernel_gradient" else kernel, bias], variables)
        return tf.reduce_sum(kernel)

    def step(*args):
        result = strategy.run(replica, args=args)
        if mode == "returns":
            return strategy.reduce(tf.distribute.ReduceOp.SUM, result, axis=None)
        return None

    return step if mode == "eager" else tf.function(step)


def run_hand_made(strategy, name):
    inner, clip, mode, kind, _ = CASES[name]
    made = make_optimizers(strategy, inner, clip, make_table_variables)
    functions = {m: hand_made_step(strategy, *made[m], mode, kind) for m in made}

    def inputs(step, m):
        def of(r, i):
            return gradients(step, r, one_sided=m == "one")[i]
        return tuple(per_replica(strategy, lambda r, i=i: of(r, i)) for i in range(4))

    return run_steps(made, functions, inputs, STEPS)


def state_of(variables, opt):
    """Every copy of ``variables``, then of the optimizer's."""
    return [copies(v) for v in list(variables) + list(opt.variables)]


def run_steps(made, functions, inputs, steps):
    """Trains the three; the report ``check_case`` reads."""
    return distributed.run_steps(made, functions, inputs, steps, state_of, len)


def embedding_model(policy, seed=0):
    import keras

    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(OUT, activation="tanh"),
            keras.layers.Dense(1, dtype="float32"),
        ])
    finally:
        keras.mixed_precision.set_global_policy(previous)


def tokens(step, replica, n=4):
    rng = np.random.default_rng([19, step, replica])
    x = rng.integers(0, 16, (n, 5)).astype(np.int32)
    return x, np.sin(x[:, :1] * 0.3).astype(np.float32)


def run_tape(strategy):
    """A custom loop over a model with an Embedding (mixed_float16): each
    replica's GradientTape gradients, its loss times the spoiled value."""
    import tensorflow as tf

    made = {}
    for m in ("stock", "ours", "one"):
        with strategy.scope():
            model = embedding_model("mixed_float16")
            opt = loss_scale_optimizer(m, "adam", None)
            opt.build(model.trainable_variables)
        made[m] = (model, opt)
    replicas = strategy.num_replicas_in_sync

    def step_function(model, opt):
        def replica(x, y, f):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(x, training=True), tf.float32)
                loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)) * f / replicas)
            grads = tape.gradient(loss, model.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices), grads[0]
            opt.apply(grads, model.trainable_variables)

        return tf.function(lambda x, y, f: strategy.run(replica, args=(x, y, f)))

    functions = {m: step_function(*made[m]) for m in made}

    def inputs(step, m):
        def f(r):
            value = spoiled_value(step, r, one_sided=m == "one")
            return np.float32(1.0 if value is None else value)
        return (per_replica(strategy, lambda r: tokens(step, r)[0]),
                per_replica(strategy, lambda r: tokens(step, r)[1]),
                per_replica(strategy, f))

    return run_steps({m: (list(model.variables), opt) for m, (model, opt) in made.items()},
                     functions, inputs, STEPS)


# name -> (inner, clip)
FITS = {"adamw": ("adamw", None),
        "sgd_global_clipnorm": ("sgd_momentum", ("global_clipnorm", 0.05))}


def run_fit(strategy, inner, clip):
    """``Model.fit`` of a model with an Embedding (global batches of 8: 4
    per replica), stock and ours with a non-finite sample weight in both
    halves of the spoiled batches, ``one`` in one half only."""
    import keras

    from helpers import batch_recorder

    batches = 24
    x, y = (np.concatenate(p) for p in zip(*(tokens(100 + b, 0, 8) for b in range(batches))))
    runs = {}
    for m in ("stock", "ours", "one"):
        weights = np.ones(len(x), np.float32)
        for b in range(batches):
            if spoil(b) is not None:
                who, value = spoil(b)
                halves = [0 if who == "all" else who] if m == "one" else [0, 1]
                for h in halves:
                    weights[8 * b + 4 * h + 1] = value
        with strategy.scope():
            model = embedding_model("mixed_float16")
            opt = loss_scale_optimizer(m, inner, clip)
            model.compile(optimizer=opt, loss="mse")
        snapshots = batch_recorder(keras.callbacks, lambda model, opt: digest(state(model, opt)))
        model.fit(x, y, sample_weight=weights, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[snapshots])
        runs[m] = {"states": snapshots.states, "iterations": int(opt.iterations.numpy()),
                   "path": opt.step_path if m != "stock" else None,
                   "copies_agree": all(len(set(c)) == 1 for c in state(model, opt))}
    return runs


WORKER_CASES = ["adam", "adam_clipvalue", "adam_global_clipnorm", "adam_clipnorm_float16",
                "adam_ema"]


def run_worker():
    """One worker of the two in ``TF_CONFIG``, one replica each: the worker
    cases, each worker's gradients those of its replica number."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    report = {"worker": worker, "replicas": strategy.num_replicas_in_sync, "cases": {}}
    for name in WORKER_CASES:
        inner, clip, mode, kind, _ = CASES[name]
        made = make_optimizers(strategy, inner, clip, make_table_variables)
        functions = {m: hand_made_step(strategy, *made[m], mode, kind) for m in made}

        def inputs(step, m):
            return tuple(tf.constant(x) for x in gradients(step, worker, one_sided=m == "one"))

        report["cases"][name] = run_steps(made, functions, inputs, STEPS)
    return report


def global_norm_overflow(strategy):
    """Each replica's finite gradients with a global norm beyond float32:
    stock's clip makes them NaN and stock applies them; the fused step
    finds NaN in the sums and skips."""
    import keras
    import tensorflow as tf

    import lossscale

    report = {}
    for m, cls in (("stock", keras.optimizers.LossScaleOptimizer),
                   ("ours", lossscale.LossScaleOptimizer)):
        with strategy.scope():
            v = keras.Variable(np.ones(3, np.float32))
            opt = cls(keras.optimizers.SGD(0.1, global_clipnorm=1.0), initial_scale=1.0)
            opt.build([v])
        tf.function(lambda: strategy.run(lambda: opt.apply([tf.fill([3], 1e20)], [v])))()
        report[m] = {"weights": [float(x) for x in v.numpy()],
                     "scale": float(opt.dynamic_scale.numpy()),
                     "path": getattr(opt, "step_path", None)}
    return report


def run_mirrored():
    from helpers import two_cpu_replicas

    strategy = two_cpu_replicas()
    report = {"replicas": strategy.num_replicas_in_sync, "cases": {}}
    for name in CASES:
        report["cases"][name] = run_hand_made(strategy, name)
    report["tape"] = run_tape(strategy)
    report["global_norm_overflow"] = global_norm_overflow(strategy)
    report["fit"] = {name: run_fit(strategy, *FITS[name]) for name in FITS}
    return report


# ------------------------------------------------------------- the test side

@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mirrored_sparse")
    (report,) = collect([Child("mirrored", tmp, "mirrored", script=__file__)], TIMEOUT)
    return report


def check_case(report, name, stock_reason=None):
    assert report["mismatch"] == [], f"{name}: differs from stock after steps " \
                                     f"{report['mismatch']}"
    assert report["copies_disagree"] == [], name
    assert report["wrong_moves"] == [], f"{name}: weights moved or kept wrongly at steps " \
                                        f"{report['wrong_moves']}"
    for path in report["paths"]:
        if stock_reason is None:
            assert path.startswith("fused ("), (name, path)
        else:
            assert path.startswith("stock: ") and stock_reason in path, (name, path)
    assert report["iterations"] == STEPS - sum(spoil(s) is not None for s in range(STEPS))
    scales = report["scales"]
    assert sum(b > a for a, b in zip(scales, scales[1:])) >= 1, name
    assert sum(b < a for a, b in zip(scales, scales[1:])) >= 2, name


def clip_measures(report, clip):
    """What ``clip`` compares with its threshold on each replica of each
    finite step, at the scale that step unscaled by: each gradient's norm
    (clipnorm), their global norm (global_clipnorm), each element's
    magnitude (clipvalue)."""
    measures = []
    for step in range(STEPS):
        if spoil(step) is not None:
            continue
        scale = report["scales"][step - 1] if step else INITIAL_SCALE
        for r in range(2):
            _, values, kernel, bias = gradients(step, r, one_sided=False)
            unscaled = [x.astype(np.float64) / scale for x in (values, kernel, bias)]
            norms = [np.sqrt(np.sum(u * u)) for u in unscaled]
            measures.extend({"clipnorm": norms,
                             "global_clipnorm": [np.sqrt(np.sum(np.square(norms)))],
                             "clipvalue": np.concatenate([np.abs(u).ravel()
                                                          for u in unscaled])}[clip])
    return np.array(measures)


@pytest.mark.parametrize("name", list(CASES))
def test_mirrored_sparse_and_clip_bit_identical_to_stock(mirrored, name):
    assert mirrored["replicas"] == 2
    report = mirrored["cases"][name]
    clip = CASES[name][1]
    if clip is not None:
        # The test's own premise: the threshold clips some and not others.
        measures = clip_measures(report, clip[0])
        assert (measures > clip[1]).any() and (measures < clip[1]).any(), name
    check_case(report, name, CASES[name][4])


def test_mirrored_embedding_tape_bit_identical_to_stock(mirrored):
    check_case(mirrored["tape"], "tape")


def test_mirrored_global_norm_overflow_is_skipped_where_stock_applies_nan(mirrored):
    """A documented difference: stock checks each replica's scaled
    gradients, the fused step their clipped sums."""
    result = mirrored["global_norm_overflow"]
    assert result["ours"] == {"weights": [1.0] * 3, "scale": 0.5, "path": "fused (SGD)"}
    assert all(np.isnan(result["stock"]["weights"])) and result["stock"]["scale"] == 1.0


@pytest.mark.parametrize("name", list(FITS))
def test_mirrored_embedding_fit_bit_identical_to_stock(mirrored, name):
    fit = mirrored["fit"][name]
    assert len(fit["ours"]["states"]) == 24
    assert fit["ours"]["states"] == fit["stock"]["states"] == fit["one"]["states"]
    assert fit["ours"]["iterations"] == 24 - sum(spoil(b) is not None for b in range(24))
    assert fit["ours"]["path"].startswith("fused (") and fit["one"]["path"] == fit["ours"]["path"]
    assert all(run["copies_agree"] for run in fit.values())


def test_workers_sparse_and_clip_bit_identical_to_stock(tmp_path):
    for attempt in range(3):
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        children = [Child("worker", tmp_path, f"worker{i}-{attempt}",
                          {"cluster": cluster, "task": {"type": "worker", "index": i}},
                          script=__file__)
                    for i in range(2)]
        try:
            reports = collect(children, TIMEOUT)
            break
        except ChildFailed as failure:
            if attempt == 2 or not port_collision(failure.stderr):
                raise
    assert sorted(r["worker"] for r in reports) == [0, 1]
    for report in reports:
        assert report["replicas"] == 2
        for name, case in report["cases"].items():
            check_case(case, f"worker {report['worker']}, {name}")
    for name in WORKER_CASES:
        assert len({r["cases"][name]["state"] for r in reports}) == 1, name


if __name__ == "__main__":
    result = run_worker() if sys.argv[1] == "worker" else run_mirrored()
    print(json.dumps(result), flush=True)
