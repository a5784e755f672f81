"""The plain-TensorFlow fallback of lossscale.ops: when it is taken, and that it
gives exactly what the native path (and TensorFlow's own expression) gives.

Fallback triggers: LOSSSCALE_FORCE_FALLBACK, a library built for another
TensorFlow, a missing or unloadable library, XLA compilation, and tensors
that are not on the CPU.
"""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_same_bits, child_env
from lossscale import _loader, ops

FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
NATIVE_OPS = {"LossScaleUnscaleAndCheck", "LossScaleAllFinite", "LossScaleUpdate"}
SCALES = [1.0, 3.0, 1000.0, 2.0 ** 15, 0.75, 2.0 ** 127, 0.0, float("nan")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_loader(monkeypatch):
    monkeypatch.delenv(_loader.FORCE_FALLBACK_ENV, raising=False)
    _loader.reset()
    yield
    _loader.reset()


def gradient_list():
    """Every 16-bit pattern, random float32/float64 bits, all in one list."""
    rng = np.random.default_rng(11)
    grads = [tf.bitcast(tf.constant(np.arange(65536, dtype=np.uint16)), d)
             for d in (tf.float16, tf.bfloat16)]
    grads.append(tf.bitcast(tf.constant(rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64)
                                        .astype(np.uint32)), tf.float32))
    grads.append(tf.bitcast(tf.constant(rng.integers(0, 2 ** 63, 50_000, dtype=np.int64)),
                            tf.float64))
    return grads


def finite_list():
    rng = np.random.default_rng(12)
    return [tf.constant(rng.standard_normal(n).astype(d.as_numpy_dtype) * 10)
            for n, d in zip([1000, 70_000, 5, 333], FLOATS)]


def unscale_inputs(grads, scale):
    return ops.unscale_and_check(grads, scale, check_inputs=True)


def unscale_divided(grads, scale):
    return ops.unscale_and_check(grads, scale, check_inputs=True, divide=True)


def run_everything(call=lambda f, *a: f(*a)):
    """Unscale (both flag modes), all_finite and a short update trajectory."""
    results = []
    for grads in (gradient_list(), finite_list()):
        for scale in SCALES:
            outs, finite = call(ops.unscale_and_check, grads, tf.constant(scale))
            _, finite_in = call(unscale_inputs, grads, tf.constant(scale))
            divided, finite_div = call(unscale_divided, grads, tf.constant(scale))
            results.append((list(outs), bool(finite), bool(finite_in)))
            results.append((list(divided), bool(finite_div), bool(finite_in)))
        results.append(bool(call(ops.all_finite, grads)))
    return results


def update_trajectory(wrap=lambda f: f, steps=120, **config):
    scale = tf.Variable(1000.0)
    counter = tf.Variable(0, dtype=tf.int64)
    run = tf.Variable(0, dtype=tf.int64)
    skipped = tf.Variable(0, dtype=tf.int64)

    def step(finite):
        return ops.update_loss_scale(finite, scale, counter, overflow_run=run, skipped=skipped,
                                     **config)

    step = wrap(step)
    trajectory = []
    for finite in (np.random.default_rng(13).random(steps) > 0.35):
        applied = step(tf.constant(bool(finite)))
        trajectory.append((bool(applied), scale.numpy().tobytes(), int(counter.numpy()),
                           int(run.numpy()), int(skipped.numpy())))
    return trajectory


UPDATE_CONFIGS = [
    dict(increment_period=2),
    dict(increment_period=3, multiplier=3.0, min_loss_scale=2.0, max_loss_scale=5e4,
         hysteresis=2),
    dict(increment_period=2, backoff_factor=0.3, multiplier=1.5),
    dict(rule="keras3", increment_period=2, multiplier=3.0),
]


def assert_same_results(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            assert x[1:] == y[1:]
            for out_x, out_y in zip(x[0], y[0]):
                assert_same_bits(out_x, out_y)
        else:
            assert x == y


@pytest.fixture(scope="module")
def native_results():
    _loader.reset()
    assert ops.native_available(), ops.native_available().reason
    return (run_everything(),
            [update_trajectory(**c) for c in UPDATE_CONFIGS])


def graph_native_ops(fn, *args):
    return [op.type for op in fn.get_concrete_function(*args).graph.get_operations()
            if op.type in NATIVE_OPS]


# -------------------------------------------------------- forced fallback

def test_forced_fallback_gives_identical_results(monkeypatch, native_results):
    monkeypatch.setenv(_loader.FORCE_FALLBACK_ENV, "1")
    status = ops.native_available()
    assert not status and status.reason == "forced by LOSSSCALE_FORCE_FALLBACK"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # forcing is not worth a warning
        results = run_everything()
        trajectories = [update_trajectory(**c) for c in UPDATE_CONFIGS]
        in_graph = [update_trajectory(tf.function, **c) for c in UPDATE_CONFIGS]
    assert_same_results(results, native_results[0])
    assert trajectories == native_results[1]
    assert in_graph == native_results[1]  # Grappler rewrites no division here

    fn = tf.function(lambda g, s: ops.unscale_and_check(g, s))
    assert graph_native_ops(fn, finite_list(), tf.constant(2.0)) == []


def test_fallback_results_equal_tensorflow_expression(monkeypatch):
    """The fallback is itself TensorFlow's expression; checked directly too."""
    monkeypatch.setenv(_loader.FORCE_FALLBACK_ENV, "1")
    grads = gradient_list()
    for scale in [3.0, 2.0 ** 15]:
        outs, finite = ops.unscale_and_check(grads, scale)
        refs = [g * tf.cast(1 / tf.constant(scale), g.dtype) for g in grads]
        for out, ref in zip(outs, refs):
            assert_same_bits(out, ref)
        assert bool(finite) is False


def test_forced_fallback_in_a_fresh_process():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import tensorflow as tf\n"
            "from lossscale import ops\n"
            "s = ops.native_available()\n"
            "outs, f = ops.unscale_and_check([tf.constant([3.0, 6.0])], 3.0)\n"
            "print(bool(s), s.reason, outs[0].numpy().tolist(), bool(f))\n")
    env = child_env(LOSSSCALE_FORCE_FALLBACK="1", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == \
        "False forced by LOSSSCALE_FORCE_FALLBACK [1.0, 2.0] True"


# ------------------------------------------------ library that cannot be used

def test_library_built_for_another_tensorflow(monkeypatch, native_results):
    import lossscale._build_info as build_info

    monkeypatch.setattr(build_info, "TF_VERSION", "2.3.0")
    with pytest.warns(RuntimeWarning, match=r"built for TensorFlow 2\.3\.0, running") as rec:
        status = ops.native_available()
    assert len(rec) == 1
    assert not status
    assert status.reason == f"built for TensorFlow 2.3.0, running {tf.__version__}"
    assert "2.3.0" in repr(status) and "False" in repr(status)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        results = run_everything()
        trajectories = [update_trajectory(**c) for c in UPDATE_CONFIGS]
    assert_same_results(results, native_results[0])
    assert trajectories == native_results[1]


@pytest.mark.parametrize("problem", ["missing", "garbage", "no-build-info"])
def test_unusable_library_warns_once_and_falls_back(monkeypatch, tmp_path, problem):
    if problem == "missing":
        monkeypatch.setattr(_loader, "library_path", lambda: str(tmp_path / "absent.so"))
        expected = "library not found"
    elif problem == "garbage":
        fake = tmp_path / "_lossscale_ops.so"
        fake.write_bytes(b"not a shared object")
        monkeypatch.setattr(_loader, "library_path", lambda: str(fake))
        expected = "load error"
    else:
        monkeypatch.setattr(_loader, "_recorded_tf_version", lambda: None)
        expected = "no record"
    with pytest.warns(RuntimeWarning) as rec:
        assert not ops.native_available()
        ops.native_available()
        outs, finite = ops.unscale_and_check([tf.constant([3.0, 6.0])], 3.0)
    assert len(rec) == 1
    assert expected in ops.native_available().reason
    assert outs[0].numpy().tolist() == [1.0, 2.0] and bool(finite)


def test_stale_library_lacking_an_op_falls_back(monkeypatch):
    """A library built from older sources (every op but the fused step) is
    not loaded at all: the optimizer takes the stock path, with the same
    result as stock Keras, instead of failing at apply."""
    import keras

    from lossscale import LossScaleOptimizer

    real, _ = _loader.load()
    assert real is not None
    names = [_loader.python_name(op) for op in _loader.OP_NAMES]
    assert "loss_scale_apply_optimizer" in names
    stale = type("Stale", (), {n: getattr(real, n) for n in names
                               if n != "loss_scale_apply_optimizer"})()
    _loader.reset()
    monkeypatch.setitem(_loader._modules, _loader.library_path(), stale)
    with pytest.warns(RuntimeWarning, match="library lacks ops loss_scale_apply_optimizer"):
        assert not ops.native_available()

    def run(cls):
        v = keras.Variable(np.arange(6, dtype=np.float32), name="v")
        opt = cls(keras.optimizers.SGD(0.1, momentum=0.9))
        for g in ([1.0] * 6, [np.inf] * 6, [0.5] * 6):
            opt.apply([tf.constant(np.array(g, np.float32) * 1024)], [v])
        return opt, v.numpy()

    ours, got = run(LossScaleOptimizer)
    _, want = run(keras.optimizers.LossScaleOptimizer)
    assert ours.step_path.startswith("stock: the native op library is not available "
                                     "(library lacks ops loss_scale_apply_optimizer")
    assert_same_bits(got, want)


# ------------------------------------------------------------------ XLA

def test_xla_compilation_uses_the_fallback(native_results):
    unscale = tf.function(lambda g, s: ops.unscale_and_check(g, s), jit_compile=True)
    compiled = {fn: tf.function(fn, jit_compile=True)
                for fn in (unscale_inputs, unscale_divided, ops.all_finite)}

    def call(fn, *args):
        if fn is ops.unscale_and_check:
            return unscale(*args)
        return compiled[fn](*args)

    assert_same_results(run_everything(call), native_results[0])
    assert graph_native_ops(unscale, finite_list(), tf.constant(2.0)) == []
    hlo = unscale.experimental_get_compiler_ir(finite_list(), tf.constant(2.0))()
    assert "multiply" in hlo


def test_xla_update_uses_the_fallback(native_results):
    def wrap(step):
        fn = tf.function(step, jit_compile=True)
        assert graph_native_ops(fn, tf.constant(True)) == []
        return fn

    trajectories = [update_trajectory(wrap, **c) for c in UPDATE_CONFIGS]
    assert trajectories == native_results[1]


def test_nested_function_inside_xla_uses_the_fallback():
    inner = tf.function(lambda g, s: ops.unscale_and_check(g, s))
    outer = tf.function(lambda g, s: inner(g, s), jit_compile=True)
    grads = finite_list()
    outs, finite = outer(grads, tf.constant(3.0))
    for out, g in zip(outs, grads):
        assert_same_bits(out, g * tf.cast(1 / tf.constant(3.0), g.dtype))


# ----------------------------------------------------- tensors off the CPU

def test_graph_tensors_on_an_unknown_device_with_accelerators(monkeypatch):
    """With accelerators present, a graph tensor pinned to no device may be
    placed on one: the fallback is used (no silent copy to the CPU kernel);
    pinned to the CPU it takes the native op."""
    monkeypatch.setattr(ops, "_accelerators_present", lambda: True)
    specs = [tf.TensorSpec([4], tf.float32)]

    def unpinned(g):
        return ops.unscale_and_check([g[0] * 1.0], 2.0)

    def pinned(g):
        with tf.device("/device:CPU:0"):
            return ops.unscale_and_check([g[0] * 1.0], 2.0)

    assert graph_native_ops(tf.function(unpinned), specs) == []
    assert graph_native_ops(tf.function(pinned), specs) == ["LossScaleUnscaleAndCheck"]


def test_non_cpu_devices_are_recognised():
    assert ops._on_cpu("/job:localhost/replica:0/task:0/device:CPU:0")
    assert ops._on_cpu("/cpu:0")
    assert not ops._on_cpu("/job:localhost/replica:0/task:0/device:GPU:0")
    assert not ops._on_cpu("/device:TPU:1")


def test_tensors_on_a_gpu_use_the_fallback():
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        pytest.skip("no GPU in this process")
    with tf.device(gpus[0].name):
        g = tf.constant([3.0, 6.0])
        scale = tf.Variable(3.0)
        counter = tf.Variable(0, dtype=tf.int64)
    fn = tf.function(lambda g: ops.unscale_and_check([g], scale))
    assert graph_native_ops(fn, g) == []
    outs, finite = ops.unscale_and_check([g], scale)
    assert "GPU" in outs[0].device and outs[0].numpy().tolist() == [1.0, 2.0]
    ops.update_loss_scale(False, scale, counter)
    assert float(scale.numpy()) == 1.5
