"""The fused step under MirroredStrategy (two logical CPUs) and
MultiWorkerMirroredStrategy (two and four worker processes on 127.0.0.1),
against the stock ``keras.optimizers.LossScaleOptimizer`` under the same
strategy.

Each run is a child process (TensorFlow fixes its devices and its cluster
when it starts): this file run as a script, printing one JSON report; the
assertions are made here.  Per case three models train side by side from
the same weights on the same data, each replica (worker) on its own batch:

* ``stock``: the stock optimizer, every spoiled step spoiled on *every*
  replica (stock trusts one replica's flag, or each worker its own: fed a
  one-sided overflow it would apply it, or wait in the all-reduce);
* ``ours``: ``lossscale.LossScaleOptimizer`` fed the same;
* ``one``: ours with each spoiled step spoiled on *one* replica only.

A skipped step leaves nothing of its gradients, so all three must hold the
same bits after every step: every copy of every variable, slot,
``iterations``, ``dynamic_scale`` and ``step_counter``; the copies of each
must agree; a spoiled step must leave the weights as they were; and
``step_path`` must say fused.  The cases cover five families, float16
gradients handed over (stock all-reduces them unscaled in float32), a
scale that is not a power of two, gradients over float32's whole range
(unscaled results that TensorFlow flushes), eager and ``tf.function``,
``mixed_float16`` and ``mixed_bfloat16``, and ``Model.fit``.

Beside them: what the fused step leaves to stock (a cross-device op of the
user's own, ``CentralStorageStrategy``), replicas that pass different
variables (a ValueError before anything moves), the one documented
difference (replicas' finite gradients whose sum overflows: stock applies
it, the fused step skips), a two-worker job whose worker is killed by
SIGKILL mid-run and restarted from its ``tf.train.CheckpointManager``
checkpoint, and a ``Model.fit`` under MirroredStrategy killed the same way
and restarted by ``keras.callbacks.BackupAndRestore``: each must end bit
for bit where an uninterrupted run ends.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from helpers import replica_factor
from test_multiworker import Child, ChildFailed, collect, free_ports, port_collision

TIMEOUT = 400  # seconds for one child run, TensorFlow's start-up included
GROWTH = 3
INITIAL_SCALE = 2.0**10

# name -> (inner optimizer, policy, steps, extra): extra "eager", "float16"
# (the gradients handed over as float16), "edge" (gradients over float32's
# whole range instead of the model's), or an initial scale.
MIRRORED_CASES = {
    "adam": ("adam", "mixed_float16", 120, None),
    "sgd_momentum_1000": ("sgd_momentum", "mixed_float16", 120, 1000.0),
    "nadam": ("nadam", "mixed_float16", 120, None),
    "adamw_bfloat16": ("adamw", "mixed_bfloat16", 120, None),
    "adam_eager": ("adam", "mixed_float16", 12, "eager"),
    "sgd_float16_gradients": ("sgd_momentum", "mixed_float16", 60, "float16"),
    "sgd_edge_values": ("sgd_momentum", "float32", 60, "edge"),
    "adafactor": ("adafactor", "mixed_float16", 120, None),
    "adafactor_edge_values": ("adafactor", "float32", 60, "edge"),
    "lamb": ("lamb", "mixed_float16", 120, None),
}
SUM_OVERFLOW = {"sgd_scale_1": ("sgd_momentum", "float32", 1, 1.0)}
WORKER_CASES = {
    "adam": ("adam", "mixed_float16", 104, None),
    "sgd_momentum": ("sgd_momentum", "mixed_float16", 104, None),
    "nadam": ("nadam", "mixed_float16", 104, None),
}
RESUME_STEPS, RESUME_EVERY, RESUME_KILL_AT = 48, 10, 35


def spoil(step):
    """``(replica, value)`` for a spoiled step, else None: the loss factor
    that replica's loss gets (``"all"``: every replica)."""
    if step % 11 == 4:
        return "all", np.inf
    if step % 13 == 6:
        return 1, np.nan
    if step % 17 == 9:
        return 0, np.inf
    if step % 19 == 12:
        return 1, -np.inf
    return None


def factor(step, replica, one_sided):
    return replica_factor(spoil(step), replica, one_sided)


def batch(step, replica, n=4):
    rng = np.random.default_rng([11, step, replica])
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return x, np.tanh(x[:, :1] - 0.5 * x[:, 3:4]).astype(np.float32)


def edge_gradients(step, replica, shapes, top=100):
    """Gradients over float32's whole range: subnormal to 2**top, signs and
    zeros mixed, so that the unscaled values cross TensorFlow's flush."""
    rng = np.random.default_rng([13, step, replica])
    out = []
    for shape in shapes:
        exponent = rng.uniform(-149, top, shape)
        value = np.sign(rng.standard_normal(shape)) * np.exp2(exponent)
        value[rng.random(shape) < 0.1] = 0.0
        out.append(value.astype(np.float32))
    return out


# --------------------------------------------------- inside a child process

def inner_optimizer(name):
    import keras

    return {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.5, nesterov=True),
        "nadam": lambda: keras.optimizers.Nadam(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
        "adafactor": lambda: keras.optimizers.Adafactor(0.05, clip_threshold=0.5),
        "lamb": lambda: keras.optimizers.Lamb(0.01, weight_decay=0.01),
    }[name]()


def build_model(policy, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh", dtype=policy),
        keras.layers.Dense(1, dtype="float32"),
    ])


def copies(variable):
    """The bytes of every copy of ``variable``."""
    import keras

    v = variable.value if isinstance(variable, keras.Variable) else variable
    return [np.asarray(c.numpy()).tobytes() for c in getattr(v, "values", [v])]


def state(model, opt):
    """Every copy of every variable: the model's, then the optimizer's."""
    return [copies(v) for v in list(model.variables) + list(opt.variables)]


def digest(values):
    import hashlib

    h = hashlib.sha1()
    for value in values:
        for c in value:
            h.update(c)
    return h.hexdigest()


def make_case(strategy, name, cases, cls_of_model):
    """The three models and optimizers of a case, made under the strategy."""
    import keras

    import lossscale

    inner, policy, _, extra = cases[name]
    initial = extra if isinstance(extra, float) else INITIAL_SCALE
    made = {}
    for model_name, cls in cls_of_model.items():
        cls = (keras.optimizers.LossScaleOptimizer if cls == "stock"
               else lossscale.LossScaleOptimizer)
        with strategy.scope():
            model = build_model(policy)
            opt = cls(inner_optimizer(inner), initial_scale=initial,
                      dynamic_growth_steps=GROWTH)
            opt.build(model.trainable_variables)
        made[model_name] = (model, opt)
    return made


def step_function(strategy, model, opt, extra):
    """One training step of the custom loop: ``strategy.run`` over each
    replica's ``(x, y, factor, edge gradients)``, ``apply`` on the scaled
    gradients."""
    import tensorflow as tf

    replicas = strategy.num_replicas_in_sync

    def replica(x, y, f, edge):
        if extra == "edge":
            grads = [g * f for g in edge]
        else:
            with tf.GradientTape() as tape:
                pred = tf.cast(model(x, training=True), tf.float32)
                loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)) * f / replicas)
            grads = tape.gradient(loss, model.trainable_variables)
            if extra == "float16":
                grads = [tf.cast(g, tf.float16) for g in grads]
        opt.apply(grads, model.trainable_variables)

    def step(x, y, f, edge):
        strategy.run(replica, args=(x, y, f, edge))

    return step if extra == "eager" else tf.function(step)


def run_case(strategy, name, cases, inputs):
    """Trains the case's three models; returns its report.  ``inputs(step,
    model_name)`` gives the step's per-replica ``(x, y, factor, edge)``."""
    made = make_case(strategy, name, cases, {"stock": "stock", "ours": "ours", "one": "ours"})
    _, _, steps, extra = cases[name]
    functions = {m: step_function(strategy, *made[m], extra) for m in made}
    return run_steps(made, functions, inputs, steps)


def run_steps(made, functions, inputs, steps, state_of=state, model_size=None):
    """Trains the three models ``made`` (``{name: (model, optimizer)}``) by
    their ``functions`` for ``steps`` steps; the report ``check_case``
    reads.  ``state_of(model, opt)``: every copy, the model's first
    (``model_size(model)`` of them; default: its variables)."""
    model_size = model_size or (lambda model: len(model.variables))
    mismatch, disagree, moved, scales = [], [], [], []
    for step in range(steps):
        before = state_of(*made["one"])
        for m, function in functions.items():
            function(*inputs(step, m))
        now = {m: state_of(*made[m]) for m in made}
        if not now["stock"] == now["ours"] == now["one"]:
            mismatch.append(step)
        if not all(len(set(c)) == 1 for s in now.values() for c in s):
            disagree.append(step)
        n = model_size(made["one"][0])
        if (now["one"][:n] != before[:n]) != (spoil(step) is None):
            moved.append(step)
        scales.append(float(np.frombuffer(copies(made["ours"][1].dynamic_scale)[0],
                                          np.float32)[0]))
    ours = made["ours"][1]
    return {"mismatch": mismatch, "copies_disagree": disagree, "wrong_moves": moved,
            "scales": scales, "iterations": int(ours.iterations.numpy()),
            "paths": [made[m][1].step_path for m in ("ours", "one")],
            "state": digest(state_of(*made["ours"]))}


def per_replica(strategy, fn):
    import tensorflow as tf

    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(tf.constant, fn(ctx.replica_id_in_sync_group)))


def run_mirrored():
    """Every MirroredStrategy case, in one process over two logical CPUs."""
    import tensorflow as tf

    from helpers import two_cpu_replicas

    strategy = two_cpu_replicas()
    report = {"replicas": strategy.num_replicas_in_sync, "cases": {}}
    shapes = [(6, 5), (5,), (5, 1), (1,)]
    for name in MIRRORED_CASES:
        extra = MIRRORED_CASES[name][3]

        def inputs(step, model_name):
            def of(r):
                x, y = batch(step, r)
                f = factor(step, r, one_sided=model_name == "one")
                # Adafactor squares them: up to 2**60, whose squares are finite.
                edge = edge_gradients(step, r, shapes, 60 if "adafactor" in name else 100) \
                    if extra == "edge" else \
                    [np.zeros((), np.float32)]
                return x, y, f, edge
            return tuple(per_replica(strategy, lambda r, i=i: of(r)[i]) for i in range(4))

        report["cases"][name] = run_case(strategy, name, MIRRORED_CASES, inputs)
    report["fit"] = mirrored_fit(strategy)
    report["stock_paths"] = stock_paths()
    report["mismatched_variables"] = mismatched_variables(strategy)
    report["sum_overflow"] = sum_overflow(strategy)
    del tf
    return report


def mirrored_fit(strategy):
    """``Model.fit`` with global batches of 8 (4 per replica): stock and ours
    with a non-finite sample in both halves of the spoiled batches, ``one``
    with it in one half only; the state after every batch."""
    import keras

    from helpers import batch_recorder

    made = make_case(strategy, "adam", MIRRORED_CASES,
                     {"stock": "stock", "ours": "ours", "one": "ours"})
    x, y = (np.concatenate(parts) for parts in zip(*(batch(200 + i, 0, 8) for i in range(30))))

    def spoiled(one_sided):
        x_ = x.copy()
        for b in range(30):
            if spoil(b) is not None:
                who, value = spoil(b)
                halves = [0 if who == "all" else who] if one_sided else [0, 1]
                for h in halves:
                    x_[8 * b + 4 * h + 1, 2] = value
        return x_

    runs = {}
    for m, (model, opt) in made.items():
        with strategy.scope():
            model.compile(optimizer=opt, loss="mse")
        snapshots = batch_recorder(keras.callbacks, lambda model, opt: digest(state(model, opt)))
        model.fit(spoiled(one_sided=m == "one"), y, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[snapshots])
        runs[m] = {"states": snapshots.states, "iterations": int(opt.iterations.numpy()),
                   "path": opt.step_path if m != "stock" else None,
                   "copies_agree": all(len(set(c)) == 1 for c in state(model, opt))}
    return runs


def stock_paths():
    """The step_path of strategies the fused step leaves to stock, and
    whether the stock path then still matches stock Keras."""
    import keras
    import tensorflow as tf

    import lossscale

    class OwnReduction(tf.distribute.ReductionToOneDevice):
        pass

    strategies = {
        "own_cross_device_op": tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=OwnReduction()),
        "central_storage": tf.distribute.experimental.CentralStorageStrategy(
            ["/cpu:0", "/cpu:1"]),
    }
    report = {}
    for name, strategy in strategies.items():
        made = make_case(strategy, "adam", MIRRORED_CASES, {"stock": "stock", "ours": "ours"})
        states, errors = {}, {}
        for m, (model, opt) in made.items():
            function = step_function(strategy, model, opt, None)
            states[m] = []
            try:
                for step in range(6):
                    function(*(per_replica(strategy, lambda r, i=i: (
                        *batch(step, r), factor(step, r, False), [np.zeros((), np.float32)])[i])
                        for i in range(4)))
                    states[m].append(state(model, opt))
            except Exception as exc:  # pylint: disable=broad-except
                errors[m] = f"{type(exc).__name__}: {exc}"[-600:]
        report[name] = {"path": made["ours"][1].step_path, "errors": errors,
                        "same": [a == b for a, b in zip(states["stock"], states["ours"])]}
    del keras, lossscale
    return report


def mismatched_variables(strategy):
    """Replica 1 passes its variables in another order: a ValueError naming
    them, and every copy of every variable as it was."""
    import tensorflow as tf

    made = make_case(strategy, "adam", MIRRORED_CASES, {"ours": "ours"})
    model, opt = made["ours"]

    @tf.function
    def step(x, y):
        def replica(x, y):
            variables = list(model.trainable_variables)
            with tf.GradientTape() as tape:
                pred = tf.cast(model(x, training=True), tf.float32)
                loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)))
            grads = tape.gradient(loss, variables)
            r = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
            pairs = list(zip(grads, variables))
            if r == 1:
                pairs = pairs[2:] + pairs[:2]
            opt.apply([g for g, _ in pairs], [v for _, v in pairs])
        strategy.run(replica, args=(x, y))

    before = state(model, opt)
    try:
        step(per_replica(strategy, lambda r: batch(0, r)[0]),
             per_replica(strategy, lambda r: batch(0, r)[1]))
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "unchanged": state(model, opt) == before}


def sum_overflow(strategy):
    """Every replica's scaled gradients finite, their unscaled sum beyond
    float32: stock applies it (the weights become non-finite), the fused
    step skips it (weights kept, scale halved)."""
    import tensorflow as tf

    made = make_case(strategy, "sgd_scale_1", SUM_OVERFLOW, {"stock": "stock", "ours": "ours"})
    shapes = [tuple(v.shape) for v in made["ours"][0].trainable_variables]
    report = {}
    for m, (model, opt) in made.items():
        function = step_function(strategy, model, opt, "edge")
        before = state(model, opt)
        big = per_replica(strategy, lambda r: [np.full(s, 2e38, np.float32) for s in shapes])
        function(*(per_replica(strategy, lambda r: batch(0, r)[i]) for i in range(2)),
                 per_replica(strategy, lambda r: np.float32(1.0)), big)
        n = len(model.variables)
        after = state(model, opt)
        weights = [np.frombuffer(c[0], np.float32) for c in after[:n]]
        report[m] = {"weights_kept": after[:n] == before[:n],
                     "weights_finite": bool(all(np.isfinite(w).all() for w in weights)),
                     "scale": float(np.frombuffer(copies(opt.dynamic_scale)[0], np.float32)[0])}
    del tf
    return report


def run_worker(steps):
    """One worker of the cluster in ``TF_CONFIG``: every worker case."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    cases = {name: (*case[:2], int(steps), case[3]) for name, case in WORKER_CASES.items()}
    report = {"worker": worker, "replicas": strategy.num_replicas_in_sync, "cases": {}}
    for name in cases:
        def inputs(step, model_name):
            x, y = batch(step, worker)
            f = factor(step, worker, one_sided=model_name == "one")
            return tf.constant(x), tf.constant(y), tf.constant(f), [tf.zeros(())]

        report["cases"][name] = run_case(strategy, name, cases, inputs)
    return report


def run_resume(directory, steps, kill_at, every):
    """One worker of a job that trains ``steps`` steps of the Adam case,
    checkpointing every ``every`` steps with ``tf.train.CheckpointManager``
    (the chief into ``directory``, the others into their own), restoring
    from the chief's latest checkpoint when there is one; worker 1 kills
    itself with SIGKILL before step ``kill_at`` (-1: never)."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    made = make_case(strategy, "adam", WORKER_CASES, {"ours": "ours"})
    model, opt = made["ours"]
    function = step_function(strategy, model, opt, None)
    step_variable = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt, step=step_variable)
    own = directory if worker == 0 else os.path.join(directory, f"worker{worker}")
    manager = tf.train.CheckpointManager(checkpoint, own, max_to_keep=2)
    latest = tf.train.latest_checkpoint(directory)
    restored = None
    if latest is not None:
        checkpoint.restore(latest).assert_consumed()
        restored = {"step": int(step_variable.numpy()),
                    "scale": float(tf.convert_to_tensor(opt.dynamic_scale).numpy()),
                    "counter": int(tf.convert_to_tensor(opt.step_counter).numpy())}
    trace = {}
    for step in range(int(step_variable.numpy()), steps):
        if step == kill_at and worker == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, worker)
        function(tf.constant(x), tf.constant(y),
                 tf.constant(factor(step, worker, one_sided=True)), [tf.zeros(())])
        step_variable.assign(step + 1)
        trace[step + 1] = {"step": step + 1,
                           "scale": float(tf.convert_to_tensor(opt.dynamic_scale).numpy()),
                           "counter": int(tf.convert_to_tensor(opt.step_counter).numpy())}
        if (step + 1) % every == 0:
            manager.save()
        print(json.dumps({"progress": step}), flush=True)
    return {"worker": worker, "restored": restored, "path": opt.step_path, "trace": trace,
            "state": digest(state(model, opt)),
            "scale": float(tf.convert_to_tensor(opt.dynamic_scale).numpy()),
            "counter": int(tf.convert_to_tensor(opt.step_counter).numpy()),
            "iterations": int(opt.iterations.numpy())}


FIT_EPOCHS, FIT_BATCHES, FIT_KILL = 3, 8, (1, 5)  # killed before epoch 1's batch 5


def run_fit_resume(directory, kill):
    """``Model.fit`` under MirroredStrategy with
    ``keras.callbacks.BackupAndRestore`` (a backup after every epoch) into
    ``directory``, restoring from it when there is one; with ``kill`` the
    process kills itself with SIGKILL at ``FIT_KILL`` (epoch, batch).
    Global batches of 8 from the spoiled steps' schedule, one replica's
    half spoiled."""
    import keras

    from helpers import two_cpu_replicas

    strategy = two_cpu_replicas()
    made = make_case(strategy, "adam", MIRRORED_CASES, {"ours": "ours"})
    model, opt = made["ours"]
    with strategy.scope():
        model.compile(optimizer=opt, loss="mse")
    x, y = (np.concatenate(p) for p in zip(*(batch(300 + i, 0, 8) for i in range(FIT_BATCHES))))
    for b in range(FIT_BATCHES):
        if spoil(b) is not None:
            who, value = spoil(b)
            x[8 * b + 4 * (0 if who == "all" else who), 1] = value

    class Kill(keras.callbacks.Callback):
        epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.epochs.append(epoch)

        def on_train_batch_begin(self, batch, logs=None):
            if kill and (self.epoch, batch) == FIT_KILL:
                os.kill(os.getpid(), signal.SIGKILL)

    backup = keras.callbacks.BackupAndRestore(directory, save_freq="epoch",
                                              delete_checkpoint=False)
    model.fit(x, y, batch_size=8, epochs=FIT_EPOCHS, shuffle=False, verbose=0,
              callbacks=[backup, Kill()])
    return {"path": opt.step_path, "state": digest(state(model, opt)),
            "copies_agree": all(len(set(c)) == 1 for c in state(model, opt)),
            "iterations": int(opt.iterations.numpy()), "epochs_run": Kill.epochs}


# ------------------------------------------------------------- the test side

def cluster_run(tmp, name, workers, mode, args=(), expect_kill=None):
    """Runs ``workers`` children of ``mode`` as one cluster (a new pair of
    ports on a collision); their reports.  With ``expect_kill``, that
    worker is expected to die of SIGKILL: then the others are killed too
    (they would wait for it forever) and None is returned."""
    for attempt in range(3):
        ports = free_ports(workers)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        children = [Child(mode, tmp, f"{name}-w{i}-{attempt}",
                          {"cluster": cluster, "task": {"type": "worker", "index": i}},
                          script=__file__, args=args)
                    for i in range(workers)]
        if expect_kill is not None:
            deadline = time.monotonic() + TIMEOUT
            victim = children[expect_kill]
            try:
                while victim.proc.poll() is None and time.monotonic() < deadline:
                    if any(c.proc.poll() not in (None, 0) for c in children if c is not victim):
                        break
                    time.sleep(0.2)
            finally:
                for child in children:
                    child.kill()
            if victim.proc.returncode == -signal.SIGKILL:
                return None
            if attempt < 2 and any(port_collision(c.tail()) for c in children):
                continue
            raise AssertionError(f"worker {expect_kill} did not die of SIGKILL:\n"
                                 + "\n".join(c.tail() for c in children))
        try:
            return collect(children, TIMEOUT)
        except ChildFailed as failure:
            if attempt == 2 or not port_collision(failure.stderr):
                raise
    raise AssertionError("no free ports")


def run_child(tmp, mode, name):
    (report,) = collect([Child(mode, tmp, name, script=__file__)], TIMEOUT)
    return report


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    return run_child(tmp_path_factory.mktemp("mirrored"), "mirrored", "mirrored")


def check_case(report, steps, name):
    where = name
    assert report["mismatch"] == [], \
        f"{where}: differs from stock after steps {report['mismatch']}"
    assert report["copies_disagree"] == [], where
    assert report["wrong_moves"] == [], f"{where}: weights moved or kept wrongly at steps " \
                                        f"{report['wrong_moves']}"
    for path in report["paths"]:
        assert path.startswith("fused ("), (where, path)
    skipped = sum(spoil(s) is not None for s in range(steps))
    assert report["iterations"] == steps - skipped, where
    scales = report["scales"]
    assert sum(b > a for a, b in zip(scales, scales[1:])) >= 1, where
    assert sum(b < a for a, b in zip(scales, scales[1:])) >= 2, where


@pytest.mark.parametrize("name", list(MIRRORED_CASES))
def test_mirrored_bit_identical_to_stock(mirrored, name):
    assert mirrored["replicas"] == 2
    check_case(mirrored["cases"][name], MIRRORED_CASES[name][2], name)


def test_mirrored_fit_bit_identical_to_stock(mirrored):
    fit = mirrored["fit"]
    assert len(fit["ours"]["states"]) == 30
    assert fit["ours"]["states"] == fit["stock"]["states"] == fit["one"]["states"]
    assert fit["ours"]["iterations"] == 30 - sum(spoil(b) is not None for b in range(30))
    assert fit["ours"]["path"].startswith("fused (") and fit["one"]["path"].startswith("fused (")
    assert all(run["copies_agree"] for run in fit.values())


def test_mirrored_strategies_left_to_stock(mirrored):
    paths = mirrored["stock_paths"]
    own = paths["own_cross_device_op"]
    assert own["path"].startswith("stock: a cross-device op of its own (OwnReduction)"), own
    assert own["errors"] == {} and own["same"] == [True] * 6, own
    central = paths["central_storage"]
    assert central["path"] == ("stock: a CentralStorageStrategy with several replicas (the "
                               "fused step serves MirroredStrategy and "
                               "MultiWorkerMirroredStrategy)"), central
    # Stock Keras 3's LossScaleOptimizer does not run under CentralStorageStrategy
    # (its merge call gets the gradients on the replicas' devices); when it
    # does, the stock path must match it.
    if "stock" not in central["errors"]:
        assert central["errors"] == {} and all(central["same"]), central


def test_mirrored_mismatched_variables_raise_before_anything_moves(mirrored):
    result = mirrored["mismatched_variables"]
    assert result["error"] is not None and "replica 1 applies" in result["error"], result
    assert "kernel" in result["error"] or "bias" in result["error"], result
    assert result["unchanged"]


def test_mirrored_sum_overflow_is_skipped_where_stock_applies_it(mirrored):
    """The one documented difference: stock checks each replica's scaled
    gradients, the fused step their unscaled sum."""
    result = mirrored["sum_overflow"]
    assert result["ours"] == {"weights_kept": True, "weights_finite": True, "scale": 0.5}
    assert result["stock"]["weights_kept"] is False
    assert result["stock"]["weights_finite"] is False
    assert result["stock"]["scale"] == 1.0


@pytest.mark.parametrize("workers,steps", [(2, 104), (4, 104)])
def test_workers_bit_identical_to_stock(tmp_path, workers, steps):
    reports = cluster_run(tmp_path, f"workers{workers}", workers, "worker", args=(steps,))
    assert sorted(r["worker"] for r in reports) == list(range(workers))
    for report in reports:
        assert report["replicas"] == workers
        for name, case in report["cases"].items():
            check_case(case, steps, f"worker {report['worker']}, {name}")
    for name in WORKER_CASES:
        states = {r["cases"][name]["state"] for r in reports}
        assert len(states) == 1, f"{name}: the workers end differently"


def test_worker_killed_and_restarted_ends_as_uninterrupted(tmp_path):
    args = (tmp_path / "uninterrupted", RESUME_STEPS, -1, RESUME_EVERY)
    uninterrupted = cluster_run(tmp_path, "uninterrupted", 2, "resume", args=args)
    directory = tmp_path / "killed"
    args = (directory, RESUME_STEPS, RESUME_KILL_AT, RESUME_EVERY)
    assert cluster_run(tmp_path, "killed", 2, "resume", args=args, expect_kill=1) is None
    restarted = cluster_run(tmp_path, "restarted", 2, "resume", args=args[:2] + (-1, RESUME_EVERY))
    last_saved = RESUME_KILL_AT // RESUME_EVERY * RESUME_EVERY
    for run in (uninterrupted, restarted):
        assert all(r["path"] == "fused (Adam)" for r in run)
    want = {k: uninterrupted[0][k] for k in ("state", "scale", "counter", "iterations")}
    for report in uninterrupted + restarted:
        assert {k: report[k] for k in want} == want, report["worker"]
    for report in restarted:
        assert report["restored"] == uninterrupted[0]["trace"][str(last_saved)], report["worker"]


def test_mirrored_fit_killed_and_restored_ends_as_uninterrupted(tmp_path):
    """BackupAndRestore under MirroredStrategy (fit does not run under
    MultiWorkerMirroredStrategy with several workers in this Keras)."""
    (uninterrupted,) = collect([Child("fit_resume", tmp_path, "fit-whole", script=__file__,
                                      args=(tmp_path / "whole", 0))], TIMEOUT)
    killed = Child("fit_resume", tmp_path, "fit-killed", script=__file__,
                   args=(tmp_path / "backup", 1))
    killed.proc.wait(timeout=TIMEOUT)
    assert killed.proc.returncode == -signal.SIGKILL, killed.tail()
    (restored,) = collect([Child("fit_resume", tmp_path, "fit-restored", script=__file__,
                                 args=(tmp_path / "backup", 0))], TIMEOUT)
    assert uninterrupted["path"] == restored["path"] == "fused (Adam)"
    assert uninterrupted["copies_agree"] and restored["copies_agree"]
    skipped = sum(spoil(b) is not None for b in range(FIT_BATCHES))
    assert uninterrupted["iterations"] == FIT_EPOCHS * (FIT_BATCHES - skipped)
    # The restarted fit resumed at the killed epoch, from the backup of the one before.
    assert uninterrupted.pop("epochs_run") == list(range(FIT_EPOCHS))
    assert restored.pop("epochs_run") == list(range(FIT_KILL[0], FIT_EPOCHS))
    assert restored == uninterrupted


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "mirrored":
        result = run_mirrored()
    elif mode == "fit_resume":
        result = run_fit_resume(args[0], bool(int(args[1])))
    elif mode == "worker":
        result = run_worker(int(args[0]))
    else:
        result = run_resume(args[0], int(args[1]), int(args[2]), int(args[3]))
    print(json.dumps(result), flush=True)
