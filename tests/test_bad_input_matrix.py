"""Bad input, table-driven: every public entry point against every class of
bad input.

The matrix is data.  Each applicable cell holds one or more cases: the call,
a factory for fresh inputs, the exception type(s) it must raise, and a
regular expression its message must match (so the message names the
argument or the problem, not a detail from deep inside).  A cell that does
not apply says why, in ``NOT_APPLICABLE``; one test checks that every cell
is either filled or explained, never both, never neither.

For every case, everything the call can reach is snapshotted before the
call (array bytes and flags, tensor and variable values, the loss-scale and
optimizer variables, model weights, config dicts in full, checkpoint file
bytes) and compared after the exception: a rejected call changes nothing.

The matrix size is reported in the terminal summary of the test run.
"""

import functools
import math
import pathlib
import re
import struct

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import core, ops
from lossscale import experimental as ls_experimental

NAN, INF = float("nan"), float("inf")
BF16 = np.dtype(ml_dtypes.bfloat16)

CLASSES = (
    "wrong type",
    "wrong dtype",
    "NaN scale",
    "inf scale",
    "zero scale",
    "negative scale",
    "empty list",
    "mismatched lists",
    "non-contiguous buffer",
    "read-only buffer",
    "corrupted config",
    "corrupted checkpoint",
)

ENTRY_POINTS = (
    "core.unscale_",
    "core.all_finite",
    "core.set_num_threads",
    "core.round_to_dtype",
    "ops.unscale_and_check",
    "ops.all_finite",
    "ops.update_loss_scale",
    "FixedLossScale",
    "DynamicLossScale",
    "DynamicLossScale.update",
    "LossScale.from_config",
    "get",
    "serialize",
    "deserialize",
    "Policy",
    "Policy.from_config",
    "LossScaleOptimizer",
    "LossScaleOptimizer.apply",
    "LossScaleOptimizer.from_config",
    "experimental.LossScaleOptimizer",
    "experimental.LossScaleOptimizer.apply_gradients",
    "experimental.LossScaleOptimizer.get_unscaled_gradients",
    "experimental.set_policy / get_layer_policy",
    "LossScaleMonitor",
    "checkpoint restore",
)


class Case:
    """One bad call: ``make()`` returns ``(call, inputs)``; ``call()`` must raise
    one of ``errors`` with a message matching ``match`` and change nothing in
    ``inputs``."""

    def __init__(self, entry, klass, name, make, errors, match, xfail=None):
        assert entry in ENTRY_POINTS and klass in CLASSES, (entry, klass)
        self.entry, self.klass, self.name = entry, klass, name
        self.make, self.errors, self.match, self.xfail = make, errors, match, xfail

    @property
    def id(self):
        return f"{self.entry}|{self.klass}|{self.name}"


CASES = []


def case(entry, klass, name, errors, match, xfail=None):
    """Decorator: registers the decorated input factory as a case."""
    def register(make):
        CASES.append(Case(entry, klass, name, make, errors, match, xfail))
        return make
    return register


def cases(entry, klass, table, errors, match):
    """Several cases of one cell from ``{name: make}``."""
    for name, make in table.items():
        CASES.append(Case(entry, klass, name, make, errors, match))


# ------------------------------------------------------------- snapshots

class GlobalPolicy:
    """Stands for Keras's global dtype policy in a list of inputs."""


def freeze(x, seen=None):
    """A comparable, deep, value-level picture of ``x``."""
    seen = set() if seen is None else seen
    if x is GlobalPolicy:
        return ("global policy", freeze(keras.mixed_precision.global_policy(), seen))
    if isinstance(x, (type(None), bool, int, str, bytes)):
        return x
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    if isinstance(x, np.generic):
        return ("npscalar", x.dtype.str, x.tobytes())
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.strides, x.flags.writeable,
                np.ascontiguousarray(x).tobytes() if x.dtype != object else repr(x))
    if id(x) in seen:
        return ("seen", type(x).__name__)
    seen.add(id(x))
    if isinstance(x, tf.IndexedSlices):
        return ("slices", freeze(x.values, seen), freeze(x.indices, seen),
                freeze(x.dense_shape, seen))
    if isinstance(x, (tf.Variable, keras.Variable)):
        value = x.value.numpy() if isinstance(x, keras.Variable) else x.numpy()
        return ("variable", getattr(x, "name", ""), str(x.dtype), value.tobytes())
    if isinstance(x, tf.SparseTensor):
        return ("sparse", freeze(x.indices, seen), freeze(x.values, seen))
    if tf.is_tensor(x):
        return ("tensor", x.dtype.name, tuple(x.shape), x.numpy().tobytes())
    if isinstance(x, dict):
        return ("dict", tuple((freeze(k, seen), freeze(v, seen)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(freeze(i, seen) for i in x))
    if isinstance(x, lossscale.LossScale):
        weights = sorted(x._weights.items(), key=lambda kv: repr(kv[0]))
        return ("loss_scale", type(x).__name__, freeze(x.get_config(), seen),
                tuple((k[0], freeze(v, seen)) for k, v in weights))
    if isinstance(x, keras.optimizers.Optimizer):
        inner = getattr(x, "inner_optimizer", None)
        ls = getattr(x, "_loss_scale_object", None)
        return ("optimizer", type(x).__name__, x.built, getattr(x, "_next_gradients_scaled", None),
                tuple(freeze(v, seen) for v in x.variables),
                freeze(inner, seen) if inner is not None else None,
                freeze(ls, seen) if ls is not None else None)
    if isinstance(x, keras.Model):
        return ("model", tuple(freeze(v, seen) for v in x.variables))
    if isinstance(x, keras.DTypePolicy):
        return ("policy", x.name, freeze(getattr(x, "loss_scale", None), seen))
    if isinstance(x, pathlib.Path):
        if x.is_dir():
            return ("dir", tuple((p.name, p.read_bytes()) for p in sorted(x.iterdir())))
        return ("file", x.read_bytes())
    return ("object", type(x).__name__, id(x))


# ---------------------------------------------------------------- inputs

def good_arrays():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(n).astype(d) for n, d in
            [(9, np.float16), (4096, BF16), (70_001, np.float32), (33, np.float64)]]


def with_bad(bad, at=2):
    arrays = good_arrays()
    return arrays[:at] + [bad] + arrays[at:]


def read_only(a):
    a.setflags(write=False)
    return a


def grads_tf():
    return [tf.constant([1.0, -2.0, 3.5]), None,
            tf.IndexedSlices(tf.constant([[1.0, 2.0]], tf.float16), tf.constant([0]),
                             tf.constant([3, 2]))]


def scale_vars(counter_dtype=tf.int64):
    return tf.Variable(512.0), tf.Variable(3, dtype=counter_dtype)


def stepped_dynamic(**kwargs):
    """A DynamicLossScale whose state is not its initial state."""
    ls = lossscale.DynamicLossScale(1024.0, 3, **kwargs)
    for finite in (1, 0, 1):
        ls.update([tf.constant([1.0 if finite else NAN])])
    return ls


def trained(opt, steps=3):
    """``(opt, model_variables)``: opt built and stepped, one step overflowing."""
    v = tf.Variable([[0.5, -0.25], [1.0, 2.0]])
    b = tf.Variable([0.125, 0.0])
    for i in range(steps):
        g = tf.fill([2, 2], NAN if i == 1 else 0.5)
        opt.apply([g, tf.constant([0.25, 0.5])], [v, b])
    return opt, [v, b]


def built_optimizer(**kwargs):
    return trained(lossscale.LossScaleOptimizer(keras.optimizers.Adam(0.01), **kwargs))


def built_experimental():
    opt = ls_experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                             lossscale.DynamicLossScale(256.0, 2))
    v = tf.Variable([[0.5, -0.25], [1.0, 2.0]])
    b = tf.Variable([0.125, 0.0])
    for i in range(3):
        g = tf.fill([2, 2], NAN if i == 1 else 0.5)
        opt.apply_gradients([(g, v), (tf.constant([0.25, 0.5]), b)])
    return opt, [v, b]


def sgd():
    return keras.optimizers.SGD(0.1)


# ------------------------------------------------------------- factories

def _call(fn, *args, watch=()):
    """A case calling ``fn(*args)`` on constant arguments; ``watch``: what
    else must come out of the call unchanged."""
    def make():
        return (lambda: fn(*args)), list(watch)
    return make


def _call_fresh(fn, build, *rest):
    """A case calling ``fn(build(), *rest)``: the first argument is built
    anew for every run, and must come out of the call unchanged."""
    def make():
        first = build()
        return (lambda: fn(first, *rest)), [first]
    return make


def arrays_with(make_bad, at=2):
    """A factory of the good arrays with a fresh ``make_bad()`` among them."""
    def build():
        return with_bad(make_bad(), at)
    return build


def _unscale(build, inv_scale=0.5):
    return _call_fresh(core.unscale_, build, inv_scale)


def _all_finite(build):
    return _call_fresh(core.all_finite, build)


# =================================================================== core

cases("core.unscale_", "wrong type", {
    "arrays=str": _call(core.unscale_, "abc", 0.5),
    "arrays=None": _call(core.unscale_, None, 0.5),
    "arrays=dict": _unscale(lambda: {"g": np.ones(3, np.float32)}),
}, TypeError, r"expected a numpy array")
cases("core.unscale_", "wrong type", {
    f"item={name}": _unscale(functools.partial(with_bad, item))
    for name, item in [("list", [1.0, 2.0]), ("float", 1.5), ("None", None), ("str", "x")]
}, TypeError, r"item 2 is \w+, not a numpy array")
cases("core.unscale_", "wrong type", {
    f"inv_scale={name}": _unscale(good_arrays, s)
    for name, s in [("str", "0.5"), ("None", None), ("bool", True), ("complex", 0.5j),
                    ("list", [0.5]), ("ndarray", np.array([0.5]))]
}, TypeError, r"inv_scale must be a real number")
cases("core.unscale_", "wrong dtype", {
    name: _unscale(arrays_with(bad))
    for name, bad in [
        ("int32", lambda: np.arange(5, dtype=np.int32)),
        ("uint16", lambda: np.arange(5, dtype=np.uint16)),
        ("bool", lambda: np.ones(5, bool)),
        ("complex64", lambda: np.ones(5, np.complex64)),
        ("float8_e4m3fn", lambda: np.ones(5, ml_dtypes.float8_e4m3fn)),
        ("object", lambda: np.array([1.0, None], dtype=object)),
    ]
}, TypeError, r"item 2 has unsupported dtype .*; supported: float16")
cases("core.unscale_", "wrong dtype", {
    "big-endian float32": _unscale(arrays_with(lambda: np.array([1.0, 2.0], dtype=">f4"))),
}, TypeError, r"item 2 has non-native byte order")


def _core_scale_cases(klass, values, match):
    cases("core.unscale_", klass, {f"inv_scale={v!r}": _unscale(good_arrays, v) for v in values},
          ValueError, match)


_core_scale_cases("NaN scale", [NAN, np.float32(NAN), np.float16(NAN)],
                  r"inv_scale must be finite, got nan")
_core_scale_cases("inf scale", [INF, -INF, np.float16(INF), 10 ** 400],
                  r"inv_scale must be finite")
_core_scale_cases("zero scale", [0.0, -0.0, 0, np.float32(0)],
                  r"inv_scale must be positive")
_core_scale_cases("negative scale", [-0.5, -1, np.float64(-2.0), -1e-300],
                  r"inv_scale must be positive")

def _aliased(pick):
    def make():
        base = np.arange(1000, dtype=np.float32)
        arrays = good_arrays()
        items = arrays[:1] + list(pick(base)) + arrays[1:]
        return (lambda: core.unscale_(items, 0.5)), [items, base]
    return make


cases("core.unscale_", "mismatched lists", {
    "same array twice": _aliased(lambda b: (b, b)),
    "overlapping slices": _aliased(lambda b: (b[10:600], b[500:])),
    "one element shared": _aliased(lambda b: (b[:500], b[499:])),
    "reinterpreted bytes": _aliased(lambda b: (b, b[100:200].view(np.float16))),
}, ValueError, r"two arrays in the list share memory")
cases("core.unscale_", "non-contiguous buffer", {
    name: _unscale(arrays_with(bad))
    for name, bad in [
        ("strided", lambda: np.arange(40, dtype=np.float32)[::2]),
        ("reversed", lambda: np.arange(40, dtype=np.float64)[::-1]),
        ("fortran", lambda: np.asfortranarray(np.ones((6, 5), np.float16))),
        ("column slice", lambda: np.ones((8, 5), BF16)[:, 1:3]),
        ("broadcast", lambda: np.broadcast_to(np.ones(1, np.float32), (10,))),
    ]
}, ValueError, r"item 2 is not C-contiguous")


def _read_only_last():
    return good_arrays()[:3] + [read_only(np.ones(5, np.float16))]


cases("core.unscale_", "read-only buffer", {
    "setflags(write=False)": _unscale(arrays_with(lambda: read_only(np.ones(100, np.float32)))),
    "frombuffer(bytes)": _unscale(arrays_with(
        lambda: np.frombuffer(bytes(np.ones(6)), np.float64))),
    "last of large goods": _unscale(_read_only_last),
}, ValueError, r"item \d is read-only")

cases("core.all_finite", "wrong type", {
    "arrays=str": _call(core.all_finite, "abc"),
    "arrays=generator": _all_finite(lambda: (a for a in good_arrays())),
    "item=memoryview": _all_finite(arrays_with(lambda: memoryview(bytearray(8)))),
}, TypeError, r"numpy array")
cases("core.all_finite", "wrong dtype", {
    "int64": _all_finite(arrays_with(lambda: np.arange(3, dtype=np.int64))),
    "complex128": _all_finite(arrays_with(lambda: np.ones(3, np.complex128))),
}, TypeError, r"item 2 has unsupported dtype")
cases("core.all_finite", "non-contiguous buffer", {
    "strided": _all_finite(arrays_with(lambda: np.arange(20, dtype=np.float32)[::3])),
}, ValueError, r"item 2 is not C-contiguous")

cases("core.set_num_threads", "wrong type", {
    f"n={v!r}": _call(core.set_num_threads, v) for v in ["2", 2.5, None, True]
}, TypeError, r"set_num_threads: n must be an integer")
cases("core.round_to_dtype", "wrong type", {
    "value=str": _call(core.round_to_dtype, "0.5", np.float16),
    "value=None": _call(core.round_to_dtype, None, np.float16),
    "dtype=bogus": _call(core.round_to_dtype, 0.5, "nope"),
}, TypeError, r"round_to_dtype: (value must be a real number|dtype 'nope' is not)")
cases("core.round_to_dtype", "wrong dtype", {
    "int32": _call(core.round_to_dtype, 0.5, np.int32),
    "complex64": _call(core.round_to_dtype, 0.5, np.complex64),
}, TypeError, r"unsupported dtype \w+; supported: float16")


# =================================================================== ops

def _ops_call(fn, grads_factory, *args, **kwargs):
    def make():
        grads = grads_factory()
        arg_values = [a() if callable(a) else a for a in args]
        return (lambda: fn(grads, *arg_values, **kwargs)), [grads, arg_values]
    return make


cases("ops.unscale_and_check", "wrong type", {
    "grads=tensor": _ops_call(ops.unscale_and_check, lambda: tf.constant([1.0]), 2.0),
    "grads=None": _ops_call(ops.unscale_and_check, lambda: None, 2.0),
    "grads=ndarray": _ops_call(ops.unscale_and_check, lambda: np.ones(3, np.float32), 2.0),
    "grads=int": _ops_call(ops.unscale_and_check, lambda: 3, 2.0),
    "grads=str": _ops_call(ops.unscale_and_check, lambda: "grads", 2.0),
    "grads=dict": _ops_call(ops.unscale_and_check, lambda: {"w": tf.constant([1.0])}, 2.0),
    "grads=set": _ops_call(ops.unscale_and_check, lambda: {tf.constant([1.0]).ref()}, 2.0),
}, TypeError, r"unscale_and_check: grads must be a list")
cases("ops.unscale_and_check", "wrong type", {
    "item=SparseTensor": _ops_call(ops.unscale_and_check,
                                   lambda: grads_tf() + [tf.sparse.from_dense([1.0, 0.0])], 2.0),
    "item=object": _ops_call(ops.unscale_and_check, lambda: grads_tf() + [object()], 2.0),
}, TypeError, r"grads\[3\] is not convertible to a tensor")
cases("ops.unscale_and_check", "wrong type", {
    "scale=str": _ops_call(ops.unscale_and_check, grads_tf, "2"),
    "scale=None": _ops_call(ops.unscale_and_check, grads_tf, None),
    "scale=bool": _ops_call(ops.unscale_and_check, grads_tf, True),
}, TypeError, r"unscale_and_check: scale must be")
cases("ops.unscale_and_check", "wrong dtype", {
    "int32 grad": _ops_call(ops.unscale_and_check, lambda: grads_tf() + [tf.constant([1, 2])],
                            2.0),
    "complex grad": _ops_call(ops.unscale_and_check,
                              lambda: grads_tf() + [tf.constant([1j])], 2.0),
    "string grad": _ops_call(ops.unscale_and_check, lambda: grads_tf() + [tf.constant(["a"])],
                             2.0),
    "int64 IndexedSlices": _ops_call(ops.unscale_and_check, lambda: grads_tf() + [
        tf.IndexedSlices(tf.constant([1, 2], tf.int64), tf.constant([0, 1]))], 2.0),
}, TypeError, r"grads\[3\] has dtype \w+; expected float16, bfloat16, float32 or float64")
cases("ops.unscale_and_check", "wrong dtype", {
    "float64 scale": _ops_call(ops.unscale_and_check, grads_tf,
                               lambda: tf.constant(2.0, tf.float64)),
    "float16 scale variable": _ops_call(ops.unscale_and_check, grads_tf,
                                        lambda: tf.Variable(2.0, dtype=tf.float16)),
    "int32 scale": _ops_call(ops.unscale_and_check, grads_tf, lambda: tf.constant(2)),
}, TypeError, r"scale must be float32 \(the loss scale, not its inverse\), got \w+")
cases("ops.unscale_and_check", "mismatched lists", {
    "scale of shape (1,)": _ops_call(ops.unscale_and_check, grads_tf,
                                     lambda: tf.constant([2.0])),
    "scale variable of shape (2,)": _ops_call(ops.unscale_and_check, grads_tf,
                                              lambda: tf.Variable([2.0, 4.0])),
}, ValueError, r"scale must be a scalar, got shape \(\d,\)")

cases("ops.all_finite", "wrong type", {
    "grads=None": _ops_call(ops.all_finite, lambda: None),
    "grads=tensor": _ops_call(ops.all_finite, lambda: tf.constant([1.0])),
    "grads=IndexedSlices": _ops_call(ops.all_finite, lambda: grads_tf()[2]),
    "grads=dict": _ops_call(ops.all_finite, lambda: {"w": tf.constant([1.0])}),
    "grads=bytes": _ops_call(ops.all_finite, lambda: b"\x00\x00\x80\x3f"),
}, TypeError, r"all_finite: grads must be a list")
cases("ops.all_finite", "wrong dtype", {
    "bool grad": _ops_call(ops.all_finite, lambda: grads_tf() + [tf.constant([True])]),
    "int8 grad": _ops_call(ops.all_finite, lambda: grads_tf() + [tf.constant([1], tf.int8)]),
    "str item": _ops_call(ops.all_finite, lambda: grads_tf() + ["x"]),
}, TypeError, r"all_finite: grads\[3\] has dtype \w+; expected float16")


def _update(**overrides):
    """update_loss_scale on fresh variables with one argument made bad."""
    def make():
        scale, counter = scale_vars()
        args = dict(finite=tf.constant(True), scale=scale, counter=counter,
                    overflow_run=None, skipped=tf.Variable(5, dtype=tf.int64))
        kwargs = {}
        for k, v in overrides.items():
            v = v() if callable(v) else v
            if k in args:
                args[k] = v
            else:
                kwargs[k] = v
        if isinstance(args["counter"], str):
            args["counter"] = args["scale"]
        call = (lambda: ops.update_loss_scale(args["finite"], args["scale"], args["counter"],
                                              overflow_run=args["overflow_run"],
                                              skipped=args["skipped"], **kwargs))
        return call, [args, kwargs, scale, counter]
    return make


cases("ops.update_loss_scale", "wrong type", {
    "scale=tensor": _update(scale=lambda: tf.constant(2.0)),
    "scale=float": _update(scale=2.0),
    "counter=ndarray": _update(counter=lambda: np.zeros((), np.int64)),
}, TypeError, r"update_loss_scale: (scale|counter) must be a tf.Variable")
cases("ops.update_loss_scale", "wrong type", {
    "finite=str": _update(finite="yes"),
    "finite=None": _update(finite=None),
    "finite=float tensor": _update(finite=lambda: tf.constant(1.0)),
}, TypeError, r"update_loss_scale: finite must be a bool scalar")
cases("ops.update_loss_scale", "wrong type", {
    "increment_period=str": _update(increment_period="10"),
    "increment_period=float": _update(increment_period=10.0),
    "hysteresis=bool": _update(hysteresis=True),
    "multiplier=str": _update(multiplier="2"),
    "min_loss_scale=None": _update(min_loss_scale=None),
}, TypeError, r"update_loss_scale: \w+ must be an? (integer|number)")
cases("ops.update_loss_scale", "wrong type", {
    "rule=unknown": _update(rule="tf2"),
    "rule=None": _update(rule=None),
}, ValueError, r"update_loss_scale: rule must be one of")
cases("ops.update_loss_scale", "wrong type", {
    "increment_period=2**64": _update(increment_period=2 ** 64),
}, ValueError, r"increment_period must be <= 2\*\*63 - 1")
cases("ops.update_loss_scale", "wrong dtype", {
    "scale float64": _update(scale=lambda: tf.Variable(2.0, dtype=tf.float64)),
    "scale float16": _update(scale=lambda: tf.Variable(2.0, dtype=tf.float16)),
    "counter float32": _update(counter=lambda: tf.Variable(0.0)),
    "counter uint8": _update(counter=lambda: tf.Variable(0, dtype=tf.uint8)),
    "skipped int32": _update(skipped=lambda: tf.Variable(0, dtype=tf.int32)),
    "overflow_run float": _update(overflow_run=lambda: tf.Variable(0.0)),
}, TypeError, r"update_loss_scale: \w+ must be a variable of dtype")
cases("ops.update_loss_scale", "NaN scale", {
    "multiplier=nan": _update(multiplier=NAN),
    "min_loss_scale=nan": _update(min_loss_scale=NAN),
    "backoff_factor=nan": _update(backoff_factor=NAN),
    "max_loss_scale=nan": _update(max_loss_scale=NAN),
}, ValueError, r"update_loss_scale: \w+( \(nan\))? must be")
cases("ops.update_loss_scale", "inf scale", {
    "multiplier=inf": _update(multiplier=INF),
    "multiplier=1e39 (inf in float32)": _update(multiplier=1e39),
    "min_loss_scale=inf": _update(min_loss_scale=INF),
}, ValueError, r"update_loss_scale: (multiplier|min_loss_scale) must be a (positive )?finite")
cases("ops.update_loss_scale", "zero scale", {
    "multiplier=0": _update(multiplier=0.0),
    "multiplier=1e-50 (0 in float32)": _update(multiplier=1e-50),
    "increment_period=0": _update(increment_period=0),
    "hysteresis=0": _update(hysteresis=0, overflow_run=lambda: tf.Variable(0, dtype=tf.int64)),
    "backoff_factor=0": _update(backoff_factor=0.0),
}, ValueError, r"update_loss_scale: (multiplier|increment_period|hysteresis|backoff_factor) "
               r"must be")
cases("ops.update_loss_scale", "negative scale", {
    "multiplier=-2": _update(multiplier=-2.0),
    "min_loss_scale=-1": _update(min_loss_scale=-1.0),
    "increment_period=-5": _update(increment_period=-5),
    "backoff_factor=-0.5": _update(backoff_factor=-0.5),
    "max below min": _update(max_loss_scale=0.5, min_loss_scale=1.0),
}, ValueError, r"update_loss_scale: \w+( \(.*\))? must be")
def _skipped_is_counter():
    scale, counter = scale_vars()
    return (lambda: ops.update_loss_scale(True, scale, counter, skipped=counter)), [scale, counter]


cases("ops.update_loss_scale", "mismatched lists", {
    "counter is scale": _update(counter="same-as-scale"),
}, (TypeError, ValueError), r"counter must be a variable of dtype int32 or int64|distinct")
cases("ops.update_loss_scale", "mismatched lists", {
    "skipped is counter": _skipped_is_counter,
}, ValueError, r"must be distinct variables")
cases("ops.update_loss_scale", "mismatched lists", {
    "finite of shape (2,)": _update(finite=lambda: tf.constant([True, False])),
    "scale of shape (1,)": _update(scale=lambda: tf.Variable([2.0])),
}, ValueError, r"update_loss_scale: (finite|scale) must be a scalar")
cases("ops.update_loss_scale", "mismatched lists", {
    "hysteresis without overflow_run": _update(hysteresis=3),
}, ValueError, r"hysteresis > 1 needs an overflow_run variable")


# ============================================================ loss scales

def _construct(cls, *args, **kwargs):
    def make():
        return (lambda: cls(*args, **kwargs)), [list(args), dict(kwargs)]
    return make


Fixed, Dynamic = lossscale.FixedLossScale, lossscale.DynamicLossScale

cases("FixedLossScale", "wrong type", {
    f"{v!r}": _construct(Fixed, v) for v in ["8", None, [8], np.array([8.0]), 8j]
}, ValueError, r"loss_scale_value must be a Python int or float")
cases("FixedLossScale", "wrong type", {
    "tensor": _call_fresh(Fixed, lambda: tf.constant(8.0)),
}, ValueError, r"loss_scale_value must be a Python int or float")
cases("FixedLossScale", "NaN scale", {"nan": _construct(Fixed, NAN),
                                      "np.float32 nan": _construct(Fixed, np.float32(NAN))},
      ValueError, r"loss_scale_value must be finite, got nan")
cases("FixedLossScale", "inf scale", {"inf": _construct(Fixed, INF),
                                      "1e39 (inf in float32)": _construct(Fixed, 1e39),
                                      "10**400": _construct(Fixed, 10 ** 400)},
      ValueError, r"loss_scale_value must (be finite|fit in float32)")
cases("FixedLossScale", "zero scale", {"0": _construct(Fixed, 0), "0.0": _construct(Fixed, 0.0),
                                       "0.5": _construct(Fixed, 0.5)},
      ValueError, r"loss_scale_value must be at least 1")
cases("FixedLossScale", "negative scale", {"-1": _construct(Fixed, -1),
                                           "-inf": _construct(Fixed, -INF)},
      ValueError, r"loss_scale_value must be at least 1")

cases("DynamicLossScale", "wrong type", {
    "initial_loss_scale=str": _construct(Dynamic, "big"),
    "initial_loss_scale=None": _construct(Dynamic, None),
    "increment_period=2.5": _construct(Dynamic, increment_period=2.5),
    "increment_period=str": _construct(Dynamic, increment_period="10"),
    "multiplier=list": _construct(Dynamic, multiplier=[2.0]),
    "hysteresis=1.5": _construct(Dynamic, hysteresis=1.5),
    "count_skipped_steps=str": _construct(Dynamic, count_skipped_steps="no"),
    "increment_period=2**64": _construct(Dynamic, increment_period=2 ** 64),
}, ValueError, r"^(initial_loss_scale|increment_period|multiplier|hysteresis|"
               r"count_skipped_steps) must be")
cases("DynamicLossScale", "NaN scale", {
    f"{k}=nan": _construct(Dynamic, **{k: NAN})
    for k in ("initial_loss_scale", "multiplier", "min_loss_scale", "max_loss_scale",
              "backoff_factor")
}, ValueError, r"^\w+ must be finite, got nan")
cases("DynamicLossScale", "inf scale", {
    "initial_loss_scale=inf": _construct(Dynamic, INF),
    "initial_loss_scale=1e39": _construct(Dynamic, 1e39),
    "initial_loss_scale=10**400": _construct(Dynamic, 10 ** 400),
    "multiplier=-10**400": _construct(Dynamic, multiplier=-10 ** 400),
    "multiplier=inf": _construct(Dynamic, multiplier=INF),
    "multiplier=1e39 (inf in float32)": _construct(Dynamic, multiplier=1e39),
    "min_loss_scale=1e50 (inf in float32)": _construct(Dynamic, min_loss_scale=1e50),
    "max_loss_scale=1e50 (inf in float32)": _construct(Dynamic, max_loss_scale=1e50),
}, ValueError, r"^(initial_loss_scale|multiplier|min_loss_scale|max_loss_scale) must "
               r"(be finite|fit in float32|be a positive float32)")
cases("DynamicLossScale", "zero scale", {
    "initial_loss_scale=0": _construct(Dynamic, 0.0),
    "initial_loss_scale=1e-50 (0 in float32)": _construct(Dynamic, 1e-50),
    "multiplier=0": _construct(Dynamic, multiplier=0),
    "multiplier=1e-50 (0 in float32)": _construct(Dynamic, multiplier=1e-50),
    "min_loss_scale=0": _construct(Dynamic, min_loss_scale=0.0),
    "min_loss_scale=1e-50 (0 in float32)": _construct(Dynamic, min_loss_scale=1e-50),
    "backoff_factor=0": _construct(Dynamic, backoff_factor=0.0),
    "backoff_factor=1e-50 (0 in float32)": _construct(Dynamic, backoff_factor=1e-50),
    "increment_period=0": _construct(Dynamic, increment_period=0),
    "hysteresis=0": _construct(Dynamic, hysteresis=0),
}, ValueError, r"^(initial_loss_scale|multiplier|min_loss_scale|backoff_factor|"
               r"increment_period|hysteresis) must be")
cases("DynamicLossScale", "negative scale", {
    "initial_loss_scale=-1": _construct(Dynamic, -1.0),
    "multiplier=-2": _construct(Dynamic, multiplier=-2.0),
    "min_loss_scale=-1": _construct(Dynamic, min_loss_scale=-1.0),
    "max_loss_scale=-1": _construct(Dynamic, max_loss_scale=-1.0),
    "backoff_factor=-0.5": _construct(Dynamic, backoff_factor=-0.5),
    "increment_period=-1": _construct(Dynamic, increment_period=-1),
    "hysteresis=-3": _construct(Dynamic, hysteresis=-3),
}, ValueError, r"^(initial_loss_scale|multiplier|min_loss_scale|max_loss_scale|"
               r"backoff_factor|increment_period|hysteresis)( \(-1.0\))? must be")
cases("DynamicLossScale", "mismatched lists", {
    "max below min": _construct(Dynamic, min_loss_scale=4.0, max_loss_scale=2.0),
    "max below initial": _construct(Dynamic, 2.0 ** 15, max_loss_scale=2.0 ** 14),
    "backoff_factor >= 1": _construct(Dynamic, backoff_factor=1.0),
}, ValueError, r"^(max_loss_scale \(.*\) must be >= (min|initial)_loss_scale|"
               r"backoff_factor must be < 1)")


def _update_call(grads_factory, **kwargs):
    def make():
        ls = stepped_dynamic(**kwargs)
        grads = grads_factory()
        return (lambda: ls.update(grads)), [ls, grads]
    return make


cases("DynamicLossScale.update", "wrong type", {
    "str item": _update_call(lambda: [tf.constant([1.0]), "abc"]),
    "int scalar": _update_call(lambda: 3),
    "object item": _update_call(lambda: [object()], hysteresis=2),
}, TypeError, r"all_finite: grads\[\d\] (has dtype \w+; expected float16|is not convertible)")
cases("DynamicLossScale.update", "wrong dtype", {
    "int32 tensor": _update_call(lambda: [tf.constant([1.0]), tf.constant([1, 2])]),
    "complex tensor": _update_call(lambda: [tf.constant([1j])], count_skipped_steps=True),
    "int IndexedSlices": _update_call(lambda: [tf.IndexedSlices(tf.constant([1]),
                                                                tf.constant([0]))]),
    "bool ndarray": _update_call(lambda: [np.array([True, False])]),
}, TypeError, r"all_finite: grads\[\d\] has dtype \w+; expected float16")


def _from_config(cls, config):
    def make():
        cfg = config() if callable(config) else config
        return (lambda: cls.from_config(cfg)), [cfg]
    return make


cases("LossScale.from_config", "corrupted config", {
    "Dynamic: None": _from_config(Dynamic, None),
    "Dynamic: list": _from_config(Dynamic, [("initial_loss_scale", 2.0)]),
    "Dynamic: str": _from_config(Dynamic, "initial_loss_scale=2"),
    "Dynamic: non-str key": _from_config(Dynamic, {1: 2.0}),
    "Fixed: None": _from_config(Fixed, None),
}, ValueError, r"\w+LossScale.from_config: config must be a dict")
cases("LossScale.from_config", "corrupted config", {
    "Dynamic: unknown key": _from_config(Dynamic, {"initial_loss_scale": 2.0, "bogus": 1}),
    "Fixed: missing key": _from_config(Fixed, {}),
    "Fixed: misspelt key": _from_config(Fixed, {"loss_scale": 2.0}),
}, TypeError, r"(unexpected keyword argument 'bogus'|missing 1 required positional argument: "
              r"'loss_scale_value'|unexpected keyword argument 'loss_scale')")
cases("LossScale.from_config", "corrupted config", {
    "Dynamic: increment_period str": _from_config(Dynamic, {"increment_period": "10"}),
    "Dynamic: hysteresis float": _from_config(Dynamic, {"hysteresis": 2.5}),
    "Fixed: value str": _from_config(Fixed, {"loss_scale_value": "8"}),
}, ValueError, r"^(increment_period|hysteresis|loss_scale_value) must be")
cases("LossScale.from_config", "NaN scale", {
    "Dynamic": _from_config(Dynamic, {"initial_loss_scale": NAN}),
    "Fixed": _from_config(Fixed, {"loss_scale_value": NAN}),
}, ValueError, r"(initial_loss_scale|loss_scale_value) must be finite")
cases("LossScale.from_config", "inf scale", {
    "Dynamic": _from_config(Dynamic, {"multiplier": INF}),
    "Fixed": _from_config(Fixed, {"loss_scale_value": INF}),
}, ValueError, r"(multiplier|loss_scale_value) must be finite")
cases("LossScale.from_config", "zero scale", {
    "Dynamic": _from_config(Dynamic, {"initial_loss_scale": 0.0, "increment_period": 5,
                                      "multiplier": 2.0}),
    "Fixed": _from_config(Fixed, {"loss_scale_value": 0}),
}, ValueError, r"(initial_loss_scale must be > 0|loss_scale_value must be at least 1)")
cases("LossScale.from_config", "negative scale", {
    "Dynamic": _from_config(Dynamic, {"increment_period": -4}),
    "Fixed": _from_config(Fixed, {"loss_scale_value": -8.0}),
}, ValueError, r"(increment_period must be in|loss_scale_value must be at least 1)")

cases("get", "wrong type", {
    name: _call_fresh(lossscale.get, v)
    for name, v in [("str Dynamic", lambda: "Dynamic"), ("str number", lambda: "8"),
                    ("list", lambda: [8]), ("object", object), ("tensor", lambda: tf.constant(8.0)),
                    ("ndarray", lambda: np.array([8.0])), ("complex", lambda: 8j),
                    ("bytes", lambda: b"dynamic")]
}, ValueError, r"Could not interpret loss scale identifier")
cases("get", "NaN scale", {"nan": _call(lossscale.get, NAN)},
      ValueError, r"loss_scale_value must be finite, got nan")
cases("get", "inf scale", {"inf": _call(lossscale.get, INF),
                           "1e39": _call(lossscale.get, 1e39)},
      ValueError, r"loss_scale_value must (be finite|fit in float32)")
cases("get", "zero scale", {"0": _call(lossscale.get, 0)},
      ValueError, r"loss_scale_value must be at least 1")
cases("get", "negative scale", {"-8": _call(lossscale.get, -8.0)},
      ValueError, r"loss_scale_value must be at least 1")
cases("get", "corrupted config", {
    "empty dict": _call_fresh(lossscale.get, dict),
    "config None": _call_fresh(lossscale.get,
                               lambda: {"class_name": "DynamicLossScale", "config": None}),
    "unknown class": _call_fresh(lossscale.get,
                                 lambda: {"class_name": "LossScale", "config": {}}),
}, ValueError, r"Improper config format|Unknown loss scale: LossScale")

cases("serialize", "wrong type", {
    f"{v!r}": _call(lossscale.serialize, v, watch=[v])
    for v in [3, "dynamic", [1.0]]
}, ValueError, r"Cannot serialize .*: it has no get_config\(\)")


def _deserialize(config, **kwargs):
    def make():
        cfg = config() if callable(config) else config
        kw = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
        return (lambda: lossscale.deserialize(cfg, **kw)), [cfg, kw]
    return make


cases("deserialize", "wrong type", {
    "int": _deserialize(5),
    "list": _deserialize([{"class_name": "FixedLossScale", "config": {}}]),
    "tuple of pairs": _deserialize((("class_name", "FixedLossScale"), ("config", {}))),
}, ValueError, r"Improper config format")
cases("deserialize", "wrong type", {
    "custom_objects=list": _deserialize("MyScale", custom_objects=lambda: [Fixed]),
    "custom_objects=str": _deserialize({"class_name": "X", "config": {}}, custom_objects="X"),
}, ValueError, r"custom_objects must be a dict")
cases("deserialize", "wrong type", {
    "custom class not a class": _deserialize({"class_name": "X", "config": {}},
                                             custom_objects=lambda: {"X": 3}),
}, ValueError, r"custom_objects\['X'\] is 3, not a loss-scale class")
cases("deserialize", "corrupted config", {
    "unknown class": _deserialize({"class_name": "Foo", "config": {}}),
    "unknown name": _deserialize("Foo"),
    "abstract class": _deserialize({"class_name": "LossScale", "config": {}}),
}, ValueError, r"Unknown loss scale: \w+")
cases("deserialize", "corrupted config", {
    "no class_name": _deserialize({"config": {}}),
    "no config": _deserialize({"class_name": "DynamicLossScale"}),
    "config None": _deserialize({"class_name": "DynamicLossScale", "config": None}),
    "config list": _deserialize({"class_name": "DynamicLossScale", "config": [1, 2]}),
    "config str": _deserialize({"class_name": "DynamicLossScale", "config": "ab"}),
    "class_name list": _deserialize({"class_name": ["DynamicLossScale"], "config": {}}),
    "class_name int": _deserialize({"class_name": 3, "config": {}}),
}, ValueError, r"Improper config format")
cases("deserialize", "corrupted config", {
    "unknown key": _deserialize({"class_name": "DynamicLossScale", "config": {"foo": 1}}),
    "missing value": _deserialize("FixedLossScale"),
}, TypeError, r"unexpected keyword argument 'foo'|missing 1 required positional argument: "
              r"'loss_scale_value'")
cases("deserialize", "NaN scale", {
    "Fixed": _deserialize({"class_name": "FixedLossScale", "config": {"loss_scale_value": NAN}}),
    "Dynamic": _deserialize({"class_name": "DynamicLossScale",
                             "config": {"initial_loss_scale": NAN}}),
}, ValueError, r"(loss_scale_value|initial_loss_scale) must be finite, got nan")
cases("deserialize", "inf scale", {
    "Dynamic multiplier": _deserialize({"class_name": "DynamicLossScale",
                                        "config": {"multiplier": INF}}),
}, ValueError, r"multiplier must be finite, got inf")
cases("deserialize", "zero scale", {
    "Dynamic period": _deserialize({"class_name": "DynamicLossScale",
                                    "config": {"increment_period": 0}}),
}, ValueError, r"increment_period must be in \[1")
cases("deserialize", "negative scale", {
    "Fixed": _deserialize({"class_name": "FixedLossScale", "config": {"loss_scale_value": -2}}),
}, ValueError, r"loss_scale_value must be at least 1")


# ================================================================ Policy

Policy = lossscale.Policy


def _policy(*args, **kwargs):
    def make():
        vals = [a() if callable(a) else a for a in args]
        return (lambda: Policy(*vals, **kwargs)), [vals, dict(kwargs)]
    return make


cases("Policy", "wrong type", {
    "name=int": _policy(3),
    "name=list": _policy(["mixed_float16"]),
}, TypeError, r"'name' must be a string")
cases("Policy", "wrong type", {
    "loss_scale=str": _policy("mixed_float16", "Dynamic"),
    "loss_scale=list": _policy("mixed_float16", [8]),
    "loss_scale=tensor": _policy("mixed_float16", lambda: tf.constant(8.0)),
}, ValueError, r"Could not interpret loss scale identifier")
cases("Policy", "wrong dtype", {
    "mixed_float17": _policy("mixed_float17"),
    "float17": _policy("float17"),
}, ValueError, r"Cannot convert '\w+' to a mixed precision DTypePolicy")
cases("Policy", "NaN scale", {"loss_scale=nan": _policy("mixed_float16", NAN)},
      ValueError, r"loss_scale_value must be finite")
cases("Policy", "inf scale", {"loss_scale=inf": _policy("mixed_float16", INF)},
      ValueError, r"loss_scale_value must be finite")
cases("Policy", "zero scale", {"loss_scale=0": _policy("mixed_float16", 0)},
      ValueError, r"loss_scale_value must be at least 1")
cases("Policy", "negative scale", {"loss_scale=-2": _policy("mixed_float16", -2)},
      ValueError, r"loss_scale_value must be at least 1")
cases("Policy", "corrupted config", {
    "loss_scale dict without config": _policy("mixed_float16", {"class_name": "Fixed"}),
}, ValueError, r"Improper config format")


def _policy_from_config(config):
    return _call_fresh(Policy.from_config, config)


cases("Policy.from_config", "corrupted config", {
    "None": _policy_from_config(lambda: None),
    "list": _policy_from_config(lambda: [("name", "float32")]),
}, ValueError, r"Policy.from_config: config must be a dict")
cases("Policy.from_config", "corrupted config", {
    "no name": _policy_from_config(lambda: {}),
    "unknown key": _policy_from_config(lambda: {"name": "float32", "bogus": 1}),
}, TypeError, r"missing 1 required positional argument: 'name'|unexpected keyword argument "
              r"'bogus'")
cases("Policy.from_config", "corrupted config", {
    "unknown loss scale class": _policy_from_config(lambda: {
        "name": "mixed_float16", "loss_scale": {"class_name": "Ten", "config": {}}}),
    "loss scale config None": _policy_from_config(lambda: {
        "name": "mixed_float16", "loss_scale": {"class_name": "DynamicLossScale",
                                                "config": None}}),
    "loss scale config bad key": _policy_from_config(lambda: {
        "name": "mixed_float16", "loss_scale": {"class_name": "DynamicLossScale",
                                                "config": {"initial_loss_scale": "x"}}}),
}, ValueError, r"Unknown loss scale: Ten|Improper config format|initial_loss_scale must be")
cases("Policy.from_config", "wrong type", {
    "name int": _policy_from_config(lambda: {"name": 5}),
}, TypeError, r"'name' must be a string")
cases("Policy.from_config", "NaN scale", {
    "loss_scale nan": _policy_from_config(lambda: {"name": "mixed_float16", "loss_scale": NAN}),
}, ValueError, r"loss_scale_value must be finite")
cases("Policy.from_config", "negative scale", {
    "loss_scale -3": _policy_from_config(lambda: {"name": "mixed_float16", "loss_scale": -3}),
}, ValueError, r"loss_scale_value must be at least 1")


# ============================================================= optimizers

LSO = lossscale.LossScaleOptimizer
XLSO = ls_experimental.LossScaleOptimizer


def _optimizer(cls, inner, *args, **kwargs):
    def make():
        opt = inner() if callable(inner) else inner
        return (lambda: cls(opt, *args, **kwargs)), [opt, list(args), dict(kwargs)]
    return make


cases("LossScaleOptimizer", "wrong type", {
    "inner=None": _optimizer(LSO, None),
    "inner=str": _optimizer(LSO, "sgd"),
    "inner=class, not instance": _optimizer(LSO, lambda: keras.optimizers.SGD),
}, TypeError, r"inner_optimizer must be a Keras 3 keras.optimizers.Optimizer, got \w+")
cases("LossScaleOptimizer", "wrong type", {
    "initial_scale=str": _optimizer(LSO, sgd, initial_scale="x"),
    "initial_scale=None": _optimizer(LSO, sgd, initial_scale=None),
    "dynamic_growth_steps=str": _optimizer(LSO, sgd, dynamic_growth_steps="10"),
    "dynamic_growth_steps=None": _optimizer(LSO, sgd, dynamic_growth_steps=None),
    "loss_scale=str": _optimizer(LSO, sgd, loss_scale="Dynamic"),
}, ValueError, r"(initial_scale must be a Python int or float|dynamic_growth_steps must be an "
               r"integer|Could not interpret loss scale identifier)")
cases("LossScaleOptimizer", "NaN scale", {
    "initial_scale=nan": _optimizer(LSO, sgd, initial_scale=NAN),
    "loss_scale=nan": _optimizer(LSO, sgd, loss_scale=NAN),
}, ValueError, r"initial_scale must be a positive finite float32|loss_scale_value must be finite")
cases("LossScaleOptimizer", "inf scale", {
    "initial_scale=inf": _optimizer(LSO, sgd, initial_scale=INF),
    "initial_scale=1e39": _optimizer(LSO, sgd, initial_scale=1e39),
    "initial_scale=10**400": _optimizer(LSO, sgd, initial_scale=10 ** 400),
    "loss_scale=inf": _optimizer(LSO, sgd, loss_scale=INF),
}, ValueError, r"initial_scale must be a positive finite float32|loss_scale_value must be finite")
cases("LossScaleOptimizer", "zero scale", {
    "initial_scale=0": _optimizer(LSO, sgd, initial_scale=0.0),
    "loss_scale=0": _optimizer(LSO, sgd, loss_scale=0),
}, ValueError, r"initial_scale must be a positive finite float32|loss_scale_value must be at "
               r"least 1")
cases("LossScaleOptimizer", "negative scale", {
    "initial_scale=-1": _optimizer(LSO, sgd, initial_scale=-1.0),
    "loss_scale=-4": _optimizer(LSO, sgd, loss_scale=-4.0),
}, ValueError, r"initial_scale must be a positive finite float32|loss_scale_value must be at "
               r"least 1")
cases("LossScaleOptimizer", "mismatched lists", {
    "loss_scale and initial_scale": _optimizer(LSO, sgd, initial_scale=8.0,
                                               loss_scale="dynamic"),
}, ValueError, r"Pass either loss_scale or initial_scale/dynamic_growth_steps, not both")


def _apply(grads, vars_=None, how="apply", **opt_kwargs):
    """A call on a built, stepped optimizer; grads/vars_ take the model variables."""
    def make():
        opt, variables = built_optimizer(**opt_kwargs)
        g = grads(variables)
        vs = variables if vars_ is None else vars_(variables)
        if how == "apply":
            call = lambda: opt.apply(g, vs)  # noqa: E731
        elif how == "apply-built":
            call = lambda: opt.apply(g)  # noqa: E731
        else:
            call = lambda: opt.apply_gradients(g)  # noqa: E731
        return call, [opt, variables, g]
    return make


def _good_grads(variables):
    return [tf.ones_like(v) * 0.5 for v in variables]


cases("LossScaleOptimizer.apply", "wrong type", {
    "grads=tensor": _apply(lambda vs: tf.ones([2, 2])),
    "grads=None": _apply(lambda vs: None),
    "grads=str": _apply(lambda vs: "ab"),
}, TypeError, r"apply: grads must be a list of gradients")
cases("LossScaleOptimizer.apply", "wrong type", {
    "grad=str": _apply(lambda vs: ["ab", tf.ones([2])]),
    "grad=object": _apply(lambda vs: [object(), tf.ones([2])]),
}, TypeError, r"apply: gradient 0 (has dtype string|is a object, not a tensor)")
cases("LossScaleOptimizer.apply", "wrong type", {
    "pairs=tensors": _apply(lambda vs: [tf.ones([2, 2]), tf.ones([2])], how="apply_gradients"),
    "pairs=triples": _apply(lambda vs: [(tf.ones([2, 2]), vs[0], None)],
                            how="apply_gradients"),
}, TypeError, r"apply_gradients: item 0 is a \w+, not a \(gradient, variable\) pair")
cases("LossScaleOptimizer.apply", "wrong dtype", {
    "complex grad": _apply(lambda vs: [tf.ones([2, 2], tf.complex64), tf.ones([2])]),
    "bool grad": _apply(lambda vs: [tf.ones([2, 2], tf.bool), tf.ones([2])]),
    "string grad, loss_scale=": _apply(lambda vs: [tf.fill([2, 2], "x"), tf.ones([2])],
                                       loss_scale=lossscale.DynamicLossScale(64.0, 2)),
}, TypeError, r"apply: gradient 0 has dtype \w+; expected a floating-point \(or integer\) "
              r"gradient")
cases("LossScaleOptimizer.apply", "empty list", {
    "apply_gradients([])": _apply(lambda vs: [], how="apply_gradients"),
}, ValueError, r"apply_gradients: grads_and_vars is empty")
cases("LossScaleOptimizer.apply", "mismatched lists", {
    "more grads than variables": _apply(lambda vs: _good_grads(vs) + [tf.ones([2])]),
    "fewer grads than variables": _apply(lambda vs: _good_grads(vs)[:1]),
    "built, fewer grads": _apply(lambda vs: _good_grads(vs)[:1], how="apply-built"),
    "variables empty": _apply(_good_grads, lambda vs: []),
}, ValueError, r"apply: got \d gradients for \d variables")
cases("LossScaleOptimizer.apply", "mismatched lists", {
    "wrong shape": _apply(lambda vs: [tf.ones([3, 2]), tf.ones([2])]),
    "transposed shape": _apply(lambda vs: [tf.ones([2]), tf.ones([2, 2])],
                               lambda vs: vs),
    "wrong shape, loss_scale=": _apply(lambda vs: [tf.ones([2, 2]), tf.ones([5])],
                                       loss_scale=lossscale.DynamicLossScale(
                                           64.0, 2, count_skipped_steps=True)),
    "swapped pairs": _apply(lambda vs: [(tf.ones([2]), vs[0]), (tf.ones([2, 2]), vs[1])],
                            how="apply_gradients"),
    "IndexedSlices of the wrong width": _apply(lambda vs: [
        tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]), tf.constant([2, 3])),
        tf.ones([2])]),
}, ValueError, r"apply: gradient \d has shape \(.*\), its variable '.*' has shape \(.*\)")


def _opt_from_config(cls, config):
    return _call_fresh(cls.from_config, config)


cases("LossScaleOptimizer.from_config", "corrupted config", {
    "empty": _opt_from_config(LSO, lambda: {}),
    "None": _opt_from_config(LSO, lambda: None),
    "inner under the wrong key": _opt_from_config(LSO, lambda: {
        "optimizer": keras.saving.serialize_keras_object(sgd())}),
}, ValueError, r"LossScaleOptimizer.from_config: config must be a dict with an "
               r"'inner_optimizer' entry")
cases("LossScaleOptimizer.from_config", "corrupted config", {
    "unknown inner class": _opt_from_config(LSO, lambda: {
        "inner_optimizer": {"class_name": "Nope", "config": {}, "module": None}}),
}, TypeError, r"Could not locate class 'Nope'")
cases("LossScaleOptimizer.from_config", "corrupted config", {
    "corrupted loss_scale": _opt_from_config(LSO, lambda: {
        "inner_optimizer": keras.saving.serialize_keras_object(sgd()),
        "loss_scale": {"class_name": "DynamicLossScale", "config": [1]}}),
}, ValueError, r"Improper config format")
cases("LossScaleOptimizer.from_config", "NaN scale", {
    "initial_scale nan": _opt_from_config(LSO, lambda: {
        "inner_optimizer": keras.saving.serialize_keras_object(sgd()), "initial_scale": NAN}),
}, ValueError, r"initial_scale must be a positive finite float32")
cases("LossScaleOptimizer.from_config", "negative scale", {
    "initial_scale -2": _opt_from_config(LSO, lambda: {
        "inner_optimizer": keras.saving.serialize_keras_object(sgd()), "initial_scale": -2.0}),
}, ValueError, r"initial_scale must be a positive finite float32")
cases("LossScaleOptimizer.from_config", "wrong type", {
    "initial_scale str": _opt_from_config(LSO, lambda: {
        "inner_optimizer": keras.saving.serialize_keras_object(sgd()), "initial_scale": "8"}),
}, ValueError, r"initial_scale must be a Python int or float")
cases("LossScaleOptimizer.from_config", "corrupted config", {
    "experimental: empty": _opt_from_config(XLSO, lambda: {}),
    "experimental: list": _opt_from_config(XLSO, lambda: [("optimizer", None)]),
}, ValueError, r"LossScaleOptimizer.from_config: config must be a dict with an 'optimizer' "
               r"entry")
cases("LossScaleOptimizer.from_config", "corrupted config", {
    "experimental: corrupted loss_scale": _opt_from_config(XLSO, lambda: {
        "optimizer": keras.saving.serialize_keras_object(sgd()),
        "loss_scale": {"class_name": "Dynamic", "config": {}}}),
}, ValueError, r"Unknown loss scale: Dynamic")

_SAVED_MODEL = {}


def _saved_model_files():
    """The files of a .keras archive of a model compiled with our optimizer (made once)."""
    if not _SAVED_MODEL:
        import zipfile
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=LSO(keras.optimizers.SGD(0.1), initial_scale=64.0), loss="mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
        path = _checkpoint_dir() / "m.keras"
        model.save(path)
        with zipfile.ZipFile(path) as archive:
            _SAVED_MODEL.update({n: archive.read(n) for n in archive.namelist()})
    return _SAVED_MODEL


def _load_corrupted_model(mutate):
    """keras.saving.load_model of a .keras file whose optimizer config was damaged."""
    def make():
        import json
        import zipfile
        files = _saved_model_files()
        config = json.loads(files["config.json"])
        mutate(config["compile_config"]["optimizer"]["config"])
        path = _checkpoint_dir() / "damaged.keras"
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in files.items():
                archive.writestr(name, json.dumps(config) if name == "config.json" else data)
        return (lambda: keras.saving.load_model(path)), [path, GlobalPolicy]
    return make


cases("LossScaleOptimizer.from_config", "corrupted config", {
    "load_model: inner optimizer removed": _load_corrupted_model(
        lambda c: c.pop("inner_optimizer")),
    "load_model: initial_scale str": _load_corrupted_model(
        lambda c: c.__setitem__("initial_scale", "x")),
    "load_model: initial_scale -1": _load_corrupted_model(
        lambda c: c.__setitem__("initial_scale", -1.0)),
    "load_model: unknown loss scale": _load_corrupted_model(
        lambda c: c.__setitem__("loss_scale", {"class_name": "Foo", "config": {}})),
}, ValueError, r"'inner_optimizer' entry|initial_scale must be|Unknown loss scale: Foo")


cases("experimental.LossScaleOptimizer", "wrong type", {
    "optimizer=None": _optimizer(XLSO, None),
    "optimizer=str": _optimizer(XLSO, "sgd"),
}, TypeError, r"inner_optimizer must be a Keras 3 keras.optimizers.Optimizer")
cases("experimental.LossScaleOptimizer", "wrong type", {
    "loss_scale=None": _optimizer(XLSO, sgd, None),
    "loss_scale=str": _optimizer(XLSO, sgd, "Dynamic"),
    "loss_scale=list": _optimizer(XLSO, sgd, [8]),
}, ValueError, r"loss_scale must be \"dynamic\", a number or a LossScale, got None|"
               r"Could not interpret loss scale identifier")
cases("experimental.LossScaleOptimizer", "NaN scale",
      {"loss_scale=nan": _optimizer(XLSO, sgd, NAN)},
      ValueError, r"loss_scale_value must be finite")
cases("experimental.LossScaleOptimizer", "inf scale",
      {"loss_scale=inf": _optimizer(XLSO, sgd, INF)},
      ValueError, r"loss_scale_value must be finite")
cases("experimental.LossScaleOptimizer", "zero scale",
      {"loss_scale=0": _optimizer(XLSO, sgd, 0.0)},
      ValueError, r"loss_scale_value must be at least 1")
cases("experimental.LossScaleOptimizer", "negative scale",
      {"loss_scale=-1": _optimizer(XLSO, sgd, -1)},
      ValueError, r"loss_scale_value must be at least 1")
cases("experimental.LossScaleOptimizer", "corrupted config", {
    "loss_scale dict": _optimizer(XLSO, sgd, {"class_name": "DynamicLossScale", "config": None}),
}, ValueError, r"Improper config format")


def _xapply(pairs, method="apply_gradients"):
    def make():
        opt, variables = built_experimental()
        p = pairs(variables)
        return (lambda: getattr(opt, method)(p)), [opt, variables, p]
    return make


cases("experimental.LossScaleOptimizer.apply_gradients", "wrong type", {
    "pairs=tensors": _xapply(lambda vs: [tf.ones([2, 2]), tf.ones([2])]),
}, TypeError, r"apply_gradients: item 0 is a \w+, not a \(gradient, variable\) pair")
cases("experimental.LossScaleOptimizer.apply_gradients", "wrong type", {
    "grad=str": _xapply(lambda vs: [("ab", vs[0])]),
}, TypeError, r"apply_gradients: gradient 0 has dtype string")
cases("experimental.LossScaleOptimizer.apply_gradients", "wrong dtype", {
    "complex": _xapply(lambda vs: [(tf.ones([2, 2], tf.complex64), vs[0])]),
}, TypeError, r"apply_gradients: gradient 0 has dtype complex64")
cases("experimental.LossScaleOptimizer.apply_gradients", "mismatched lists", {
    "wrong shape": _xapply(lambda vs: [(tf.ones([2, 2]), vs[0]), (tf.ones([3]), vs[1])]),
    "swapped": _xapply(lambda vs: [(tf.ones([2]), vs[0]), (tf.ones([2, 2]), vs[1])]),
}, ValueError, r"apply_gradients: gradient \d has shape \([\d, ]+\), its variable")
def _after_scale_loss(pairs):
    """apply_gradients of Keras 3's train step (scale_loss first, so scaled gradients)."""
    def make():
        opt, variables = built_experimental()
        opt.scale_loss(tf.constant(2.0))
        p = pairs(variables)
        return (lambda: opt.apply_gradients(p)), [opt, variables, p]
    return make


cases("experimental.LossScaleOptimizer.apply_gradients", "mismatched lists", {
    "after scale_loss: wrong shape": _after_scale_loss(
        lambda vs: [(tf.ones([2, 2]), vs[0]), (tf.ones([4]), vs[1])]),
}, ValueError, r"apply: gradient 1 has shape \(4,\), its variable")
cases("experimental.LossScaleOptimizer.apply_gradients", "empty list", {
    "after scale_loss": _after_scale_loss(lambda vs: []),
}, ValueError, r"apply_gradients: grads_and_vars is empty")
cases("experimental.LossScaleOptimizer.get_unscaled_gradients", "wrong type", {
    "None": _xapply(lambda vs: None, "get_unscaled_gradients"),
    "tensor": _xapply(lambda vs: tf.ones([2]), "get_unscaled_gradients"),
}, TypeError, r"get_unscaled_gradients: grads must be a list of gradients")
cases("experimental.LossScaleOptimizer.get_unscaled_gradients", "wrong dtype", {
    "int grads": _xapply(lambda vs: [tf.ones([2], tf.int32)], "get_unscaled_gradients"),
}, TypeError, r"unscale_and_check: grads\[0\] has dtype int32")
cases("experimental.LossScaleOptimizer.get_unscaled_gradients", "wrong type", {
    "get_scaled_loss(str)": _xapply(lambda vs: "loss", "get_scaled_loss"),
}, TypeError, r"get_scaled_loss: loss must be a tensor or a callable")


cases("experimental.set_policy / get_layer_policy", "wrong type", {
    "set_policy(3)": _call(ls_experimental.set_policy, 3, watch=[GlobalPolicy]),
    "set_policy([])": _call(ls_experimental.set_policy, [], watch=[GlobalPolicy]),
}, ValueError, r"Invalid `policy` argument")
cases("experimental.set_policy / get_layer_policy", "wrong type", {
    "get_layer_policy(model variable)": _call_fresh(ls_experimental.get_layer_policy,
                                                    lambda: tf.Variable(1.0)),
    "get_layer_policy(str)": _call(ls_experimental.get_layer_policy, "dense"),
}, ValueError, r"get_policy can only be called on a layer")
cases("experimental.set_policy / get_layer_policy", "wrong dtype", {
    "set_policy('float17')": _call(ls_experimental.set_policy, "float17",
                                   watch=[GlobalPolicy]),
    "set_policy('mixed_int8')": _call(ls_experimental.set_policy, "mixed_int8",
                                      watch=[GlobalPolicy]),
}, ValueError, r"Cannot convert '\w+' to a mixed precision DTypePolicy")

Monitor = lossscale.LossScaleMonitor
cases("LossScaleMonitor", "wrong type", {
    "patience=str": _construct(Monitor, patience="3"),
    "patience=float": _construct(Monitor, patience=2.5),
    "patience=bool": _construct(Monitor, patience=True),
    "min_scale=str": _construct(Monitor, min_scale="1"),
    "min_scale=bool": _construct(Monitor, min_scale=True),
}, ValueError, r"^(patience must be an int >= 1|min_scale must be a finite number) or None")
cases("LossScaleMonitor", "NaN scale", {
    "min_scale=nan": _construct(Monitor, min_scale=NAN),
    "min_scale=np.float32 nan": _construct(Monitor, min_scale=np.float32(NAN)),
}, ValueError, r"^min_scale must be a finite number or None, got")
cases("LossScaleMonitor", "inf scale", {
    "min_scale=inf": _construct(Monitor, min_scale=INF),
    "min_scale=10**400": _construct(Monitor, min_scale=10 ** 400),
}, ValueError, r"^min_scale must be a finite number or None, got")
cases("LossScaleMonitor", "zero scale", {"patience=0": _construct(Monitor, patience=0)},
      ValueError, r"^patience must be an int >= 1 or None, got 0")
cases("LossScaleMonitor", "negative scale", {"patience=-5": _construct(Monitor, patience=-5)},
      ValueError, r"^patience must be an int >= 1 or None, got -5")


# ============================================================ checkpoints

def _corrupt(prefix, how):
    data = pathlib.Path(prefix + ".data-00000-of-00001")
    index = pathlib.Path(prefix + ".index")
    if how == "truncated data":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif how == "flipped data bytes":
        b = bytearray(data.read_bytes())
        for i in range(0, len(b), 5):
            b[i] ^= 0xA5
        data.write_bytes(bytes(b))
    elif how == "truncated index":
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    elif how == "flipped index bytes":
        b = bytearray(index.read_bytes())
        b[len(b) // 3] ^= 0xFF
        b[len(b) // 2] ^= 0xFF
        index.write_bytes(bytes(b))
    elif how == "missing data file":
        data.unlink()
    elif how == "empty index":
        index.write_bytes(b"")
    else:
        raise AssertionError(how)


CHECKPOINT_ERRORS = (tf.errors.OpError, ValueError, IndexError)
CHECKPOINT_MESSAGE = (r"(?i)checksum|corrupt|sstable|less bytes|no such file|not found|"
                      r"dtype|shape|data loss|truncated|unable to (open|read)")
FILE_DAMAGE = ("truncated data", "flipped data bytes", "truncated index",
               "flipped index bytes", "missing data file", "empty index")


_TMP = []  # the running test's tmp_path (see the autouse fixture below)


@pytest.fixture(autouse=True)
def _tmp_for_checkpoints(tmp_path):
    _TMP.append(tmp_path)
    yield
    _TMP.pop()


def _checkpoint_dir():
    folder = _TMP[-1] / f"ckpt{len(list(_TMP[-1].iterdir()))}"
    folder.mkdir()
    return folder


def _loss_scale_checkpoint(damage):
    def make():
        src = stepped_dynamic(hysteresis=3, count_skipped_steps=True)
        src.update([tf.constant([NAN])])
        folder = _checkpoint_dir()
        prefix = tf.train.Checkpoint(loss_scale=src).write(str(folder / "ckpt"))
        _corrupt(prefix, damage)
        live = lossscale.DynamicLossScale(1024.0, 3, hysteresis=3, count_skipped_steps=True)
        for finite in (0, 1, 1):
            live.update([tf.constant([1.0 if finite else INF])])
        return (lambda: tf.train.Checkpoint(loss_scale=live).read(prefix)), [live, folder]
    return make


def _forged_loss_scale_checkpoint(**forged):
    """A checkpoint with the loss-scale keys, one of them holding the wrong thing."""
    def make():
        values = dict(current_loss_scale=tf.Variable(3.0),
                      good_steps=tf.Variable(1, dtype=tf.int64),
                      overflow_run=tf.Variable(1, dtype=tf.int64),
                      skipped_steps=tf.Variable(2, dtype=tf.int64))
        values.update({k: v() for k, v in forged.items()})
        folder = _checkpoint_dir()
        prefix = tf.train.Checkpoint(loss_scale=tf.train.Checkpoint(**values)).write(
            str(folder / "ckpt"))
        live = stepped_dynamic(hysteresis=3, count_skipped_steps=True)
        return (lambda: tf.train.Checkpoint(loss_scale=live).read(prefix)), [live, folder]
    return make


for _damage in FILE_DAMAGE:
    cases("checkpoint restore", "corrupted checkpoint", {
        f"DynamicLossScale: {_damage}": _loss_scale_checkpoint(_damage),
    }, CHECKPOINT_ERRORS, CHECKPOINT_MESSAGE)
cases("checkpoint restore", "corrupted checkpoint", {
    "DynamicLossScale: good_steps float32": _forged_loss_scale_checkpoint(
        good_steps=lambda: tf.Variable(1.5)),
    "DynamicLossScale: current_loss_scale float64": _forged_loss_scale_checkpoint(
        current_loss_scale=lambda: tf.Variable(3.0, dtype=tf.float64)),
    "DynamicLossScale: skipped_steps int32": _forged_loss_scale_checkpoint(
        skipped_steps=lambda: tf.Variable(2)),
    "DynamicLossScale: current_loss_scale of shape (2,)": _forged_loss_scale_checkpoint(
        current_loss_scale=lambda: tf.Variable([3.0, 4.0])),
}, CHECKPOINT_ERRORS, CHECKPOINT_MESSAGE)
# TensorFlow restores a checkpoint variable by variable once every tensor has
# been read: a tensor of the wrong *shape* under a later key is found only
# after the earlier variables were assigned.  Known; outside this package.
CASES.append(Case(
    "checkpoint restore", "corrupted checkpoint", "DynamicLossScale: good_steps of shape (2,)",
    _forged_loss_scale_checkpoint(good_steps=lambda: tf.Variable([1, 2], dtype=tf.int64)),
    CHECKPOINT_ERRORS, CHECKPOINT_MESSAGE,
    xfail="TensorFlow's restore assigns the variables one at a time; a wrong shape under "
          "a later key leaves the earlier ones restored"))


def _optimizer_checkpoint(damage=None, forge=None):
    def make():
        src, src_vars = built_optimizer(initial_scale=2.0 ** 10, dynamic_growth_steps=2)
        folder = _checkpoint_dir()
        if forge is None:
            prefix = tf.train.Checkpoint(optimizer=src).write(str(folder / "ckpt"))
            _corrupt(prefix, damage)
        else:
            # The optimizer's variables as saved, with one replaced by a forgery
            # under the same key.
            ckpt = tf.train.Checkpoint(optimizer=src)
            prefix = ckpt.write(str(folder / "good"))
            names = dict(tf.train.list_variables(prefix))
            reader = tf.train.load_checkpoint(prefix)
            key = next(k for k in names if forge[0] in k)
            forged = {}
            for k in names:
                if k.startswith("_CHECKPOINTABLE_OBJECT_GRAPH"):
                    continue
                value = reader.get_tensor(k)
                forged[k] = forge[1](value) if k == key else value
            prefix = _write_raw_checkpoint(folder / "forged", prefix, forged)
        live, live_vars = built_optimizer(initial_scale=2.0 ** 10, dynamic_growth_steps=2)
        return (lambda: tf.train.Checkpoint(optimizer=live).read(prefix)), [
            live, live_vars, folder]
    return make


def _write_raw_checkpoint(path, template_prefix, tensors):
    """A copy of the checkpoint at ``template_prefix`` with ``tensors`` (by key)
    written under the same keys, the object graph kept."""
    reader = tf.train.load_checkpoint(template_prefix)
    graph_key = "_CHECKPOINTABLE_OBJECT_GRAPH"
    keys = [graph_key] + sorted(tensors)
    values = [tf.constant(reader.get_tensor(graph_key))] + [
        tf.constant(tensors[k]) for k in sorted(tensors)]
    tf.raw_ops.SaveV2(prefix=str(path), tensor_names=keys, shape_and_slices=[""] * len(keys),
                      tensors=values)
    return str(path)


for _damage in ("truncated data", "flipped data bytes", "truncated index", "missing data file"):
    cases("checkpoint restore", "corrupted checkpoint", {
        f"LossScaleOptimizer: {_damage}": _optimizer_checkpoint(_damage),
    }, CHECKPOINT_ERRORS, CHECKPOINT_MESSAGE)
cases("checkpoint restore", "corrupted checkpoint", {
    "LossScaleOptimizer: dynamic_scale as float64": _optimizer_checkpoint(
        forge=("dynamic_scale", lambda v: np.float64(v))),
    "LossScaleOptimizer: step_counter as float32": _optimizer_checkpoint(
        forge=("step_counter", lambda v: np.float32(v))),
}, CHECKPOINT_ERRORS, CHECKPOINT_MESSAGE)


# ====================================================== not applicable

_NO_BUFFER = ("takes no numpy buffer of its own to write into or read in place")
_CONVERTED = ("numpy input is converted by tf.convert_to_tensor (a copy), so any layout "
              "and a read-only array are valid input; see test_valid_elsewhere")
_NO_CONFIG = "takes no config dict"
_NO_CKPT = "has no state to restore; checkpoint corruption is in the 'checkpoint restore' row"
_NO_SCALE = "takes no scale or count argument"
_OP_SCALE = ("a non-finite, zero or negative scale is valid input: the op computes exactly "
             "TensorFlow's g * cast(1 / scale) for any float32 scale, with a False flag when "
             "the results are not finite (test_ops checks these scales bit for bit)")
_EMPTY_OK = "an empty (or all-None) gradient list is valid: finite (SPEC 3, 4)"
_EMPTY_CORE_OK = ("an empty list or a zero-length array is valid: finite, as numpy's all() "
                  "of nothing (test_core_errors.test_empty_list_and_tuple_are_finite)")

NOT_APPLICABLE = {}


def not_applicable(entry, klasses, why):
    for k in klasses:
        NOT_APPLICABLE[(entry, k)] = why


_SCALES = ("NaN scale", "inf scale", "zero scale", "negative scale")
_BUFFERS = ("non-contiguous buffer", "read-only buffer")

not_applicable("core.unscale_", ("corrupted config",), _NO_CONFIG)
not_applicable("core.unscale_", ("corrupted checkpoint",), _NO_CKPT)
not_applicable("core.unscale_", ("empty list",), _EMPTY_CORE_OK)
not_applicable("core.all_finite", ("empty list",), _EMPTY_CORE_OK)
not_applicable("core.all_finite", _SCALES, _NO_SCALE)
not_applicable("core.all_finite", ("read-only buffer",), "reads only: a read-only array is "
               "valid input (test_core_errors.test_read_only)")
not_applicable("core.all_finite", ("mismatched lists",), "reads only: the same memory twice "
               "is harmless and valid")
not_applicable("core.all_finite", ("corrupted config",), _NO_CONFIG)
not_applicable("core.all_finite", ("corrupted checkpoint",), _NO_CKPT)
for _entry in ("core.set_num_threads", "core.round_to_dtype"):
    not_applicable(_entry, ("empty list", "mismatched lists") + _BUFFERS,
                   "takes a single number, no list or buffer")
    not_applicable(_entry, ("corrupted config",), _NO_CONFIG)
    not_applicable(_entry, ("corrupted checkpoint",), _NO_CKPT)
not_applicable("core.set_num_threads", ("wrong dtype",), "takes no array or dtype")
not_applicable("core.set_num_threads", ("NaN scale", "inf scale"),
               "a NaN or inf is a float: rejected as a wrong type")
not_applicable("core.set_num_threads", ("zero scale", "negative scale"),
               "n <= 0 is valid and documented: it restores the default thread count")
not_applicable("core.round_to_dtype", _SCALES,
               "rounds any double: NaN, inf, 0 and negative values have exact roundings "
               "(test_core_exact)")
not_applicable("ops.unscale_and_check", _SCALES, _OP_SCALE)
not_applicable("ops.unscale_and_check", ("empty list",), _EMPTY_OK)
not_applicable("ops.unscale_and_check", _BUFFERS, _CONVERTED)
not_applicable("ops.unscale_and_check", ("corrupted config",), _NO_CONFIG)
not_applicable("ops.unscale_and_check", ("corrupted checkpoint",), _NO_CKPT)
not_applicable("ops.all_finite", _SCALES, _NO_SCALE)
not_applicable("ops.all_finite", ("empty list",), _EMPTY_OK)
not_applicable("ops.all_finite", ("mismatched lists",), "reads a single list; nothing to pair")
not_applicable("ops.all_finite", _BUFFERS, _CONVERTED)
not_applicable("ops.all_finite", ("corrupted config",), _NO_CONFIG)
not_applicable("ops.all_finite", ("corrupted checkpoint",), _NO_CKPT)
not_applicable("ops.update_loss_scale", ("empty list",), "takes no list")
not_applicable("ops.update_loss_scale", _BUFFERS, "takes variables, not buffers")
not_applicable("ops.update_loss_scale", ("corrupted config",),
               "takes keyword arguments, not a config dict (bad values are in the other "
               "columns)")
not_applicable("ops.update_loss_scale", ("corrupted checkpoint",),
               "works on the caller's variables; their restore is the 'checkpoint restore' row")
for _entry in ("FixedLossScale", "DynamicLossScale"):
    not_applicable(_entry, ("empty list",) + _BUFFERS, "takes numbers, no list or buffer")
    not_applicable(_entry, ("corrupted config",),
                   "takes arguments; configs are the LossScale.from_config row")
    not_applicable(_entry, ("corrupted checkpoint",),
                   "a fresh object; restoring into one is the 'checkpoint restore' row")
    not_applicable(_entry, ("wrong dtype",), "takes Python numbers, which have no dtype")
not_applicable("FixedLossScale", ("mismatched lists",), "takes one argument")
not_applicable("DynamicLossScale.update", _SCALES, _NO_SCALE)
not_applicable("DynamicLossScale.update", ("empty list",), _EMPTY_OK)
not_applicable("DynamicLossScale.update", ("mismatched lists",),
               "takes any nested structure of gradients; nothing to pair")
not_applicable("DynamicLossScale.update", _BUFFERS, _CONVERTED)
not_applicable("DynamicLossScale.update", ("corrupted config",), _NO_CONFIG)
not_applicable("DynamicLossScale.update", ("corrupted checkpoint",),
               "restoring its state is the 'checkpoint restore' row")
for _entry in ("LossScale.from_config", "get", "serialize", "deserialize", "Policy",
               "Policy.from_config", "LossScaleOptimizer", "LossScaleOptimizer.from_config",
               "experimental.LossScaleOptimizer"):
    not_applicable(_entry, ("empty list",) + _BUFFERS, "takes no list of tensors or buffer")
    not_applicable(_entry, ("corrupted checkpoint",),
                   "builds a new object; restoring state is the 'checkpoint restore' row")
for _entry in ("LossScale.from_config", "get", "serialize", "deserialize",
               "Policy.from_config", "LossScaleOptimizer.from_config",
               "experimental.LossScaleOptimizer"):
    not_applicable(_entry, ("wrong dtype",), "takes Python objects, which have no dtype")
for _entry in ("LossScale.from_config", "get", "serialize", "deserialize", "Policy",
               "Policy.from_config", "LossScaleOptimizer.from_config",
               "experimental.LossScaleOptimizer"):
    not_applicable(_entry, ("mismatched lists",), "takes no pair of lists")
not_applicable("LossScale.from_config", ("wrong type",),
               "a config that is not a dict, or holds values of the wrong type, is a "
               "corrupted config")
not_applicable("serialize", _SCALES, "takes an object, not a number")
not_applicable("serialize", ("corrupted config",), "writes a config; reads none")
not_applicable("LossScaleOptimizer", ("wrong dtype",),
               "takes Python numbers and objects, which have no dtype")
not_applicable("LossScaleOptimizer", ("corrupted config",),
               "takes arguments; configs are the LossScaleOptimizer.from_config row")
not_applicable("LossScaleOptimizer.apply", _SCALES,
               "takes gradients, not a scale; the scale it reads is its own variable")
not_applicable("LossScaleOptimizer.apply", _BUFFERS, _CONVERTED)
not_applicable("LossScaleOptimizer.apply", ("corrupted config",), _NO_CONFIG)
not_applicable("LossScaleOptimizer.apply", ("corrupted checkpoint",),
               "restoring the optimizer is the 'checkpoint restore' row")
not_applicable("LossScaleOptimizer.from_config", ("zero scale", "inf scale"),
               "the same check as the NaN and negative cells of this row, through the "
               "constructor row")
not_applicable("Policy.from_config", ("zero scale", "inf scale"),
               "the same check as the NaN and negative cells of this row, through the "
               "Policy row")
not_applicable("experimental.LossScaleOptimizer.apply_gradients", _SCALES,
               "takes gradients, not a scale")
not_applicable("experimental.LossScaleOptimizer.apply_gradients", _BUFFERS, _CONVERTED)
not_applicable("experimental.LossScaleOptimizer.apply_gradients", ("corrupted config",),
               _NO_CONFIG)
not_applicable("experimental.LossScaleOptimizer.apply_gradients", ("corrupted checkpoint",),
               "restoring the optimizer is the 'checkpoint restore' row")
not_applicable("experimental.LossScaleOptimizer.get_unscaled_gradients", _SCALES,
               "takes gradients, not a scale")
not_applicable("experimental.LossScaleOptimizer.get_unscaled_gradients",
               ("empty list",), _EMPTY_OK)
not_applicable("experimental.LossScaleOptimizer.get_unscaled_gradients",
               ("mismatched lists",), "one list; nothing to pair")
not_applicable("experimental.LossScaleOptimizer.get_unscaled_gradients", _BUFFERS, _CONVERTED)
not_applicable("experimental.LossScaleOptimizer.get_unscaled_gradients",
               ("corrupted config", "corrupted checkpoint"), "reads no config or checkpoint")
not_applicable("experimental.set_policy / get_layer_policy",
               _SCALES + ("empty list", "mismatched lists") + _BUFFERS,
               "takes one policy name or layer")
not_applicable("experimental.set_policy / get_layer_policy",
               ("corrupted config", "corrupted checkpoint"), "reads no config or checkpoint")
not_applicable("LossScaleMonitor", ("wrong dtype",), "takes Python numbers")
not_applicable("LossScaleMonitor", ("empty list", "mismatched lists") + _BUFFERS,
               "takes numbers, no list or buffer")
not_applicable("LossScaleMonitor", ("corrupted config", "corrupted checkpoint"),
               "a callback with no config of its own and no state to restore")
not_applicable("checkpoint restore", [k for k in CLASSES if k != "corrupted checkpoint"],
               "reads a checkpoint; its other inputs are the live objects")


# ================================================================= tests

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "duplicate case ids"


def _params():
    for c in CASES:
        marks = [pytest.mark.xfail(reason=c.xfail, strict=True)] if c.xfail else []
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("bad", list(_params()))
def test_bad_input_raises_clearly_and_changes_nothing(bad):
    call, inputs = bad.make()
    before = freeze(inputs)
    with pytest.raises(bad.errors) as info:
        call()
    message = str(info.value)
    assert message.strip(), f"{type(info.value).__name__} without a message"
    assert re.search(bad.match, message), (
        f"unclear message for {bad.id}: {type(info.value).__name__}: {message!r}")
    assert freeze(inputs) == before, f"{bad.id}: a rejected call changed its inputs or state"


def test_every_cell_is_covered_or_explained(record_property):
    filled = {(c.entry, c.klass) for c in CASES}
    both = filled & set(NOT_APPLICABLE)
    assert not both, f"cells both tested and marked not applicable: {sorted(both)}"
    cells = {(e, k) for e in ENTRY_POINTS for k in CLASSES}
    missing = cells - filled - set(NOT_APPLICABLE)
    assert not missing, f"cells neither tested nor explained: {sorted(missing)}"
    assert set(NOT_APPLICABLE) <= cells
    assert all(why.strip() for why in NOT_APPLICABLE.values())
    record_property("terminal_summary",
                    f"bad-input matrix: {len(ENTRY_POINTS)} entry points x {len(CLASSES)} "
                    f"input classes = {len(cells)} cells; {len(filled)} applicable, "
                    f"{len(NOT_APPLICABLE)} not applicable (each with its reason); "
                    f"{len(CASES)} cases "
                    f"({sum(1 for c in CASES if c.xfail)} known TensorFlow limitation), "
                    f"{sum(1 for c in CASES if c.entry in TRACED_ENTRIES)} of them also "
                    f"inside tf.function")


def test_every_class_and_entry_point_has_cases():
    """No row and no column is all 'not applicable'."""
    assert {c.klass for c in CASES} == set(CLASSES)
    assert {c.entry for c in CASES} == set(ENTRY_POINTS)


# The other side of the not-applicable cells: the input is valid there.
def test_valid_elsewhere():
    """Layouts the core refuses and scales it refuses are valid input to the
    TensorFlow layer: the same answers as TensorFlow's own ops, inputs untouched."""
    strided = np.arange(40, dtype=np.float32)[::3]
    frozen = read_only(np.linspace(-3, 3, 11).astype(np.float16))
    before = freeze([strided, frozen])
    (a, b), finite = ops.unscale_and_check([strided, frozen], 4.0)
    assert bool(finite)
    np.testing.assert_array_equal(a.numpy(), (tf.constant(strided) * (1 / 4.0)).numpy())
    np.testing.assert_array_equal(
        b.numpy(), (tf.constant(frozen) * tf.cast(1 / 4.0, tf.float16)).numpy())
    assert bool(ops.all_finite([strided, frozen]))
    assert freeze([strided, frozen]) == before
    for scale in (0.0, -2.0, INF, NAN):
        (out,), finite = ops.unscale_and_check([tf.constant([1.0, -2.0])], scale)
        ref = tf.constant([1.0, -2.0]) * tf.cast(1 / tf.constant(scale, tf.float32), tf.float32)
        np.testing.assert_array_equal(out.numpy(), ref.numpy())
        assert bool(finite) == bool(np.isfinite(ref.numpy()).all())
    assert core.all_finite(frozen) is True
    for dtype in (np.float16, BF16, np.float32, np.float64):
        # Unaligned (but contiguous) buffers are valid input to the core.
        size = np.dtype(dtype).itemsize
        buf = np.frombuffer(bytearray(size * 70_001 + 1), np.uint8)[1:]
        unaligned = buf.view(dtype)
        assert not unaligned.flags.aligned
        unaligned[:] = (np.arange(unaligned.size) % 13 - 6).astype(dtype)
        want = (unaligned.astype(np.float64) * 0.25).astype(dtype)
        assert core.unscale_(unaligned, 0.25) is True
        assert unaligned.tobytes() == want.tobytes()
    assert core.all_finite([strided.copy(), strided.copy()]) is True
    core.set_num_threads(-3)
    core.set_num_threads(0)
    assert core.get_num_threads() >= 1
    assert math.isnan(core.round_to_dtype(NAN, np.float16))
    empty_unscaled, empty_finite = ops.unscale_and_check([], 2.0)
    assert empty_unscaled == [] and bool(empty_finite)
    assert bool(ops.all_finite([None]))
    ls = stepped_dynamic()
    state = freeze(ls)
    _, should_apply = ls.update([])
    assert bool(should_apply) and freeze(ls) != state  # a finite step counts
    opt, variables = built_experimental()
    snapshot = freeze([opt, variables])
    opt.apply_gradients([])
    assert freeze([opt, variables]) == snapshot



TRACED_ENTRIES = ("ops.unscale_and_check", "ops.all_finite", "ops.update_loss_scale",
                  "DynamicLossScale.update", "LossScaleOptimizer.apply",
                  "experimental.LossScaleOptimizer.apply_gradients",
                  "experimental.LossScaleOptimizer.get_unscaled_gradients")


@pytest.mark.parametrize("bad", [pytest.param(c, id=c.id) for c in CASES
                                 if c.entry in TRACED_ENTRIES])
def test_bad_input_inside_tf_function(bad):
    """The same calls traced by ``tf.function``: the same error, at trace time,
    and nothing changed."""
    call, inputs = bad.make()
    before = freeze(inputs)
    traced = tf.function(call)
    with pytest.raises(bad.errors) as info:
        traced()
    assert re.search(bad.match, str(info.value)), (
        f"unclear message for {bad.id} in tf.function: {type(info.value).__name__}: "
        f"{str(info.value)!r}")
    assert freeze(inputs) == before, f"{bad.id}: a rejected call changed its inputs or state"
