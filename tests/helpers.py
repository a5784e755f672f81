"""What several test modules need alike: exact comparison of values,
TensorFlow 2.4's loss scaling as an oracle, and the small model and custom
training loops run side by side with it.

``bits`` turns a value into a comparable key of its raw bytes (NaN equals
the same NaN, -0.0 differs from 0.0); ``bit_patterns`` gives the unsigned
integer of each element, and ``same_bits`` / ``assert_same_bits`` compare
arrays bit for bit except that any NaN meets any NaN.  ``tf_dynamic`` and
``tf_fixed`` are TensorFlow's own ``tf.compat.v1.mixed_precision`` loss
scales, and ``tf24_reference_step`` is TensorFlow 2.4's
``LossScaleOptimizer`` step written with TensorFlow's ops and such a loss
scale.  ``mixed_mlp``, ``mse_loss`` and the two custom-loop steps
(``keras3_train_step``, ``tf24_train_step``, both on ``scaled_gradients``)
are that model and loop; ``child_env`` and ``two_cpu_replicas`` set up
the child processes some tests start, and ``child_pytest`` runs a file of
checks in one (``case_names`` lists them).  ``bench_module`` loads a module
of ``bench/`` (the report, the run driver) as the benchmark suite does.
TensorFlow and Keras are imported only by the functions that need them, so
that the tests of the C core can use this module without them, and the
child processes that configure TensorFlow before importing it can too.
"""

import importlib.util
import os
import sys

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bench_module(name):
    """``bench/<name>.py`` as a module, with ``bench/`` on the path while it
    loads (its modules import their neighbours) and the module in
    ``sys.modules`` (its dataclasses look their module up)."""
    bench = os.path.join(ROOT, "bench")
    sys.path.insert(0, bench)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                      os.path.join(bench, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench)
    return module


def bits(x):
    """The raw bytes of ``x`` with its dtype and shape, as one comparable key:
    NaN equals the same NaN, -0.0 differs from 0.0."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.dtype.str, a.shape, a.reshape(-1).view(np.uint8).tobytes()


def bit_patterns(a):
    """Each element of the array ``a`` as the unsigned integer of its bits."""
    return np.ascontiguousarray(a).view(UINT[a.dtype.itemsize])


def nan_blind_equal(a, b):
    """Element by element, flattened: the same bits, or both NaN (NaN payloads
    are free)."""
    a, b = np.asarray(a), np.asarray(b)
    both_nan = np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64))
    return (bit_patterns(a).reshape(-1) == bit_patterns(b).reshape(-1)) | both_nan.reshape(-1)


def same_bits(a, b):
    """The same dtype, shape and bits, except that any NaN equals any NaN."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(nan_blind_equal(a, b).all())


def assert_same_bits(got, want, what=""):
    """``same_bits(got, want)``, or an error that shows the first differences."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    bad = np.flatnonzero(~nan_blind_equal(got, want))
    if bad.size:
        k = bad[:8]
        g, w = got.reshape(-1), want.reshape(-1)
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} differ; first at {k.tolist()}: "
            f"got {g[k].tolist()} (bits {[hex(int(v)) for v in bit_patterns(g)[k]]}) "
            f"want {w[k].tolist()} (bits {[hex(int(v)) for v in bit_patterns(w)[k]]})")


def tf_dynamic(*args, **kwargs):
    """``tf.compat.v1.mixed_precision.DynamicLossScale``, without its
    deprecation warning."""
    import tensorflow as tf
    from tensorflow.python.util import deprecation
    with deprecation.silence():
        return tf.compat.v1.mixed_precision.DynamicLossScale(*args, **kwargs)


def tf_fixed(value):
    """``tf.compat.v1.mixed_precision.FixedLossScale``, without its deprecation
    warning."""
    import tensorflow as tf
    from tensorflow.python.util import deprecation
    with deprecation.silence():
        return tf.compat.v1.mixed_precision.FixedLossScale(value)


def mixed_mlp(seed, hidden):
    """A mixed_float16 Dense(hidden, tanh) on 6 inputs and a float32 Dense(1),
    its weights drawn from ``seed``."""
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(hidden, activation="tanh", dtype="mixed_float16"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def overflowing_batches(steps, batch, seed, first, every, factor):
    """Regression data of ``steps`` batches (4 inputs, 1 target) whose
    batches ``first``, ``first + every``, ... are ``factor`` times larger:
    enough to overflow half-precision gradients at any scale a run reaches."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, 4)).astype("float32")
    y = (rng.normal(size=(steps * batch, 1)) * 40).astype("float32")
    for i in range(first, steps, every):
        x[i * batch:(i + 1) * batch] *= factor
    return x, y


def tied_size_decay_case(seed=3, each=30, steps=3):
    """For weight decay's grouping in a graph: ``(shapes, starts, grads)``,
    ``each`` variables of each of the shapes (), (1,), (1, 1) and (3,) (a
    one-element variable's factors tie in size with the scalars), their
    starting values, and ``steps`` lists of gradients as tensors."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    shapes = [s for s in [(), (1,), (1, 1), (3,)] for _ in range(each)]
    starts = [rng.uniform(0.5, 2.0, s).astype(np.float32) for s in shapes]
    grads = [[tf.constant(rng.standard_normal(s).astype(np.float32) * 8) for s in shapes]
             for _ in range(steps)]
    return shapes, starts, grads


def mse_loss(model, x, y, factor):
    """The tests' training loss: mean squared error in float32, times ``factor``
    (a large or non-finite factor forces an overflow)."""
    import tensorflow as tf
    pred = tf.cast(model(x, training=True), tf.float32)
    return tf.reduce_mean(tf.square(pred - y)) * factor


def scaled_gradients(model, loss_of, scale, x, y, factor, edit=None):
    """``(loss, gradients of scale(loss))`` for ``loss_of(model, x, y,
    factor)``; the gradients passed through ``edit`` when given (a test
    spoiling one of them)."""
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y, factor)
        scaled = scale(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    return loss, (grads if edit is None else edit(grads))


def tf24_reference_step(model, inner, loss_scale, loss_of=mse_loss, *, count_skipped=False):
    """TensorFlow 2.4's ``LossScaleOptimizer`` step with TensorFlow's ops.

    ``loss_scale`` is a ``tf.compat.v1`` loss scale and ``inner`` a Keras
    optimizer built for ``model``.  The returned ``step(x, y, factor,
    edit=None)`` takes the gradients of the scaled loss, multiplies them by
    ``1 / scale`` in their own dtype, updates the loss scale and applies them
    when they were finite; ``count_skipped``: a skipped step still counts in
    ``inner.iterations``, as TensorFlow 2.4's did.  It returns the
    should-apply flag, and runs in whatever context calls it (eager or a
    ``tf.function``).
    """
    import tensorflow as tf

    def scale(loss):
        return loss * tf.cast(loss_scale(), loss.dtype)

    def step(x, y, factor, edit=None):
        _, grads = scaled_gradients(model, loss_of, scale, x, y, factor, edit)
        inv = 1.0 / loss_scale()
        grads = [g * tf.cast(inv, g.dtype) for g in grads]
        _, should_apply = loss_scale.update(grads)

        def apply():
            inner.apply(grads, model.trainable_variables)

        def skip():
            if count_skipped:
                inner.iterations.assign_add(1)

        tf.cond(should_apply, apply, skip)
        return should_apply

    return step


def keras3_train_step(model, optimizer, loss_of=mse_loss):
    """Keras 3's custom-loop step: ``scale_loss``, then ``apply`` on the scaled
    gradients; ``step(x, y, factor, edit=None)`` returns the loss."""

    def step(x, y, factor, edit=None):
        loss, grads = scaled_gradients(model, loss_of, optimizer.scale_loss, x, y, factor, edit)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


def tf24_train_step(model, optimizer, loss_of=mse_loss):
    """TensorFlow 2.4's custom-loop step: ``get_scaled_loss``,
    ``get_unscaled_gradients``, ``apply_gradients``; ``step(x, y, factor,
    edit=None)`` returns the loss."""

    def step(x, y, factor, edit=None):
        loss, grads = scaled_gradients(model, loss_of, optimizer.get_scaled_loss, x, y, factor,
                                       edit)
        grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


# ------------------------------------------------------------ child processes


def replica_factor(spoiled, replica, one_sided):
    """What ``replica``'s loss is multiplied by at a step that ``spoiled``
    (None, or ``(who, value)``: ``who`` a replica, or ``"all"``) describes;
    ``one_sided``: only ``who``'s is, else every replica's."""
    if spoiled is None:
        return np.float32(1.0)
    who, value = spoiled
    hit = who == "all" or who == replica or not one_sided
    return np.float32(value if hit else 1.0)

def child_env(drop=(), **values):
    """The environment of a test's child Python process: the source tree and
    the tests first on PYTHONPATH, TensorFlow quiet and on the CPU unless
    this environment says otherwise, the variables in ``drop`` removed, and
    ``values`` set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, TESTS] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    for name in drop:
        env.pop(name, None)
    env.update(values)
    return env


def case_names(path):
    """The ``test_*`` functions defined at the top level of the file ``path``."""
    import ast
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def child_pytest(path, report, **env):
    """Runs the checks of ``path`` in a child pytest (``child_env(**env)``),
    its junit report written to ``report``; returns ``{test id: None, or the
    failure's message and the end of its traceback}``."""
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "ignore::DeprecationWarning", f"--junitxml={report}", path],
        env=child_env(**env), cwd=TESTS, capture_output=True, text=True, timeout=900,
        check=False)
    if not os.path.exists(report):
        raise AssertionError(f"the child pytest of {os.path.basename(path)} wrote no report:\n"
                             f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        results[case.get("name")] = None if failure is None else failure.get("message", "") + \
            "\n" + (failure.text or "")[-3000:]
    return results


def assert_child_case_passed(results, name):
    """Every run of the check ``name`` (each of its parameters) in ``results``
    of ``child_pytest`` passed, and there was at least one."""
    mine = {k: v for k, v in results.items() if k == name or k.startswith(name + "[")}
    assert mine, f"{name} did not run in the child"
    failed = {k: v for k, v in mine.items() if v is not None}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


def two_cpu_replicas():
    """A MirroredStrategy over two logical CPUs.  TensorFlow fixes its devices
    when it initialises, so this is the first thing a fresh process does
    with TensorFlow."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def batch_recorder(callbacks, record):
    """A ``callbacks.Callback`` (Keras 3's or tf_keras' module) whose
    ``states`` list gets ``record(model, optimizer)`` after every training
    batch of ``fit``."""

    class Recorder(callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.states = []

        def on_train_batch_end(self, batch, logs=None):
            self.states.append(record(self.model, self.model.optimizer))

    return Recorder()
