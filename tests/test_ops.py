"""lossscale.ops on the native path, checked against TensorFlow's own ops.

Oracles: TensorFlow computing ``g * tf.cast(1 / scale, g.dtype)`` and
``reduce_all(is_finite(...))`` itself (with its CPU flushing of subnormals),
``tf.compat.v1.mixed_precision.DynamicLossScale`` and Keras 3's stock
``LossScaleOptimizer`` for the update rules, and a float32 numpy model of
the documented rule where TensorFlow has no reference (the extensions); for
the fused step's sparse gradients, ``optim_model``'s Keras model on the
slices densified as TensorFlow's own IndexedSlices conversion densifies
them.
"""

import threading

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from helpers import UINT, assert_same_bits
from lossscale import _loader, ops
from optim_model import (CONFIGS, FAMILIES, decay_mask, densify, keras_sparse_form,
                         make_grads, make_indices, make_slices, make_state, slot_names,
                         sparse_keras_step, unscaled)
from rule_model import keras3_step, tf24_step

FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
NATIVE_OPS = {"LossScaleUnscaleAndCheck", "LossScaleAllFinite", "LossScaleUpdate"}

# Loss scales: powers of two, non-powers of two, below 1, and degenerate
# ones (1/scale subnormal -> flushed to 0; 1/scale inf or NaN).
SCALES = [1.0, 3.0, 1000.0, 2.0 ** 15, 0.75, 1e-3, 65504.0 * 3, 2.0 ** 100,
          2.0 ** 127, 3e38, -3.0, 0.0, 1e-45, 2.0 ** -130, float("inf"), float("nan")]


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.delenv(_loader.FORCE_FALLBACK_ENV, raising=False)
    status = ops.native_available()
    assert status, f"native op library not usable: {status.reason}"


def bit_patterns(dtype, n=200_000, seed=0):
    """Every pattern of a 16-bit float, else random bits (every class of value)."""
    if dtype.size == 2:
        return tf.bitcast(tf.constant(np.arange(65536, dtype=np.uint16)), dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, np.iinfo(UINT[dtype.size]).max, n, dtype=UINT[dtype.size],
                       endpoint=True)
    return tf.bitcast(tf.constant(raw), dtype)


def reference(grads, scale):
    """TensorFlow's own unscale: g * tf.cast(1 / scale, g.dtype)."""
    inv = 1 / tf.constant(scale, tf.float32)
    return [g * tf.cast(inv, g.dtype) for g in grads]


def reference_finite(tensors):
    return bool(tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def native_op_types(graph):
    return [op.type for op in graph.get_operations() if op.type in NATIVE_OPS]


# ------------------------------------------------------------ availability

def test_native_available_says_loaded():
    status = ops.native_available()
    assert bool(status) is True
    assert status.reason == "loaded"
    assert "True" in repr(status) and "loaded" in repr(status)


# ------------------------------------------------------- unscale: exactness

@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_unscale_bit_identical_to_tensorflow(dtype):
    x = bit_patterns(dtype)
    before = x.numpy().copy()
    for scale in SCALES:
        (out,), finite = ops.unscale_and_check([x], scale)
        (ref,) = reference([x], scale)
        assert_same_bits(out, ref)
        assert bool(finite) == reference_finite([ref]), scale
    # the caller's tensor is still alive, so it was not overwritten
    np.testing.assert_array_equal(x.numpy().view(UINT[dtype.size]),
                                  before.view(UINT[dtype.size]))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_divide_bit_identical_to_tensorflow_division(dtype):
    """divide=True gives TensorFlow's g / tf.cast(scale, g.dtype) for every
    scale: the fused pass where that equals multiplying by 1/scale, a
    division everywhere else."""
    x = bit_patterns(dtype)
    for scale in SCALES:
        ref = x / tf.cast(tf.constant(scale, tf.float32), dtype)
        for check_inputs in (False, True):
            (out,), finite = ops.unscale_and_check([x], scale, check_inputs=check_inputs,
                                                   divide=True)
            assert_same_bits(out, ref)
            assert bool(finite) == reference_finite([x if check_inputs else ref]), scale


def test_divide_in_a_mixed_list_and_in_a_graph():
    """A 16-bit gradient beside float32 ones, and the op inside tf.function."""
    rng = np.random.default_rng(5)
    grads = [tf.constant(rng.standard_normal(n).astype(d.as_numpy_dtype))
             for n, d in zip([70_000, 1000, 333], [tf.float32, tf.float16, tf.float64])]
    fn = tf.function(lambda g, s: ops.unscale_and_check(g, s, check_inputs=True, divide=True))
    for scale in [2.0 ** 15, 1000.0, 2.0 ** 127, 2.0 ** -127]:
        refs = [g / tf.cast(tf.constant(scale, tf.float32), g.dtype) for g in grads]
        for run in (ops.unscale_and_check(grads, scale, check_inputs=True, divide=True),
                    fn(grads, tf.constant(scale))):
            outs, finite = run
            for out, ref in zip(outs, refs):
                assert_same_bits(out, ref)
            assert bool(finite) is True


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_subnormals_follow_tensorflow_not_ieee(dtype):
    """TensorFlow's CPU kernels flush subnormal float32/float64/bfloat16 inputs
    and results (float16 arithmetic happens in float32, where its subnormals
    are normal); the op must give TensorFlow's answer."""
    info = ml_dtypes.finfo(dtype.as_numpy_dtype)
    tiny = float(info.smallest_normal)
    values = np.array([tiny, tiny / 2, tiny / 4, -tiny / 8, float(info.smallest_subnormal),
                       tiny * 1.5, 0.0, -0.0], dtype=np.float64)
    x = tf.constant(values.astype(dtype.as_numpy_dtype))
    for scale in [1.0, 3.0, 0.75, 2.0, 2.0 ** 15]:
        (out,), _ = ops.unscale_and_check([x], scale)
        assert_same_bits(out, reference([x], scale)[0])
    if dtype in (tf.float32, tf.float64, tf.bfloat16):
        (out,), _ = ops.unscale_and_check([x], 1.0)
        assert out.numpy()[1].astype(np.float64) == 0.0  # IEEE would keep tiny / 2


def test_finite_flag_results_versus_inputs():
    big = tf.constant([60000.0, 1.0], tf.float16)
    # 60000 * (1 / 0.5) overflows float16: results not finite, inputs finite
    (out,), finite = ops.unscale_and_check([big], 0.5)
    assert bool(finite) == reference_finite(reference([big], 0.5)) is False
    (out2,), finite_in = ops.unscale_and_check([big], 0.5, check_inputs=True)
    assert bool(finite_in) == reference_finite([big]) is True
    assert_same_bits(out2, reference([big], 0.5)[0])
    nan = tf.constant([1.0, float("nan")])
    assert not bool(ops.unscale_and_check([nan], 2.0, check_inputs=True)[1])


def test_mixed_dtypes_and_sizes_in_one_list():
    """One call over a list mixing dtypes and sizes across the thread-pool
    block boundary; a single bad value anywhere clears the flag."""
    rng = np.random.default_rng(1)
    sizes = [0, 1, 7, 32767, 32768, 32769, 100_003, 1 << 20]
    grads = []
    for i, n in enumerate(sizes):
        dtype = FLOATS[i % 4]
        grads.append(tf.constant((rng.standard_normal(n) * 100).astype(dtype.as_numpy_dtype)))
    for scale in [3.0, 2.0 ** 15, 0.75]:
        outs, finite = ops.unscale_and_check(grads, scale)
        for out, ref in zip(outs, reference(grads, scale)):
            assert_same_bits(out, ref)
        assert bool(finite) is True
    for which, where in [(7, 0), (7, (1 << 20) - 1), (7, 600_000), (6, 50_000), (1, 0)]:
        bad = list(grads)
        arr = bad[which].numpy().copy()
        arr[where] = np.inf
        bad[which] = tf.constant(arr)
        _, finite = ops.unscale_and_check(bad, 3.0)
        assert bool(finite) is False
        assert bool(ops.all_finite(bad)) is False


def test_many_small_tensors_of_every_dtype():
    """Hundreds of small outputs (packed into shared allocations when they
    cannot reuse their inputs), every shape kind, eager and in a graph where
    TensorFlow ops consume them."""
    rng = np.random.default_rng(6)
    shapes = [(), (0,), (1,), (3, 5), (64,), (7, 0, 2), (129,), (2, 2, 2), (1000,), (4097,)]
    grads = []
    for i in range(400):
        dtype = FLOATS[(i * 7) % 4]
        shape = shapes[i % len(shapes)]
        grads.append(tf.constant((rng.standard_normal(shape) * 1e3).astype(dtype.as_numpy_dtype)))
    refs = reference(grads, 3.0)
    outs, finite = ops.unscale_and_check(grads, 3.0)
    for out, ref in zip(outs, refs):
        assert_same_bits(out, ref)

    @tf.function
    def consume(gs):
        fresh = [g * tf.cast(1.0, g.dtype) for g in gs]  # forwardable intermediates
        outs, finite = ops.unscale_and_check(fresh, tf.constant(3.0))
        return [o + tf.cast(1.0, o.dtype) for o in outs], finite

    outs, finite = consume(grads)
    for out, ref in zip(outs, refs):
        assert_same_bits(out, ref + tf.cast(1.0, ref.dtype))
    assert bool(finite)


def test_none_and_indexed_slices_keep_their_places():
    dense = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    values = tf.constant([[30.0, 60.0]], tf.bfloat16)
    indices = tf.constant([1], tf.int64)
    shape = tf.constant([5, 2], tf.int64)
    sparse = tf.IndexedSlices(values, indices, shape)
    outs, finite = ops.unscale_and_check([None, dense, sparse, None], 3.0)
    assert outs[0] is None and outs[3] is None
    assert_same_bits(outs[1], reference([dense], 3.0)[0])
    assert isinstance(outs[2], tf.IndexedSlices)
    assert_same_bits(outs[2].values, reference([values], 3.0)[0])
    assert outs[2].indices is indices and outs[2].dense_shape is shape
    assert bool(finite) is True
    inf_sparse = tf.IndexedSlices(tf.constant([[np.inf, 0.0]]), indices, shape)
    assert bool(ops.all_finite([None, inf_sparse])) is False
    assert bool(ops.unscale_and_check([inf_sparse], 1.0)[1]) is False


def test_variables_as_gradients():
    v = tf.Variable([1.0, 5.0, -7.0])
    (out,), finite = ops.unscale_and_check([v], 3.0)
    assert_same_bits(out, reference([v.read_value()], 3.0)[0])
    np.testing.assert_array_equal(v.numpy(), [1.0, 5.0, -7.0])


def test_empty_and_all_none_lists():
    outs, finite = ops.unscale_and_check([], 2.0)
    assert outs == [] and bool(finite) is True
    outs, finite = ops.unscale_and_check([None, None], 2.0)
    assert outs == [None, None] and bool(finite) is True
    assert bool(ops.all_finite([])) is True
    assert bool(ops.all_finite([None])) is True


def test_scale_as_variable_and_tensor():
    x = tf.constant([1.0, 3.0, 5.0], tf.float16)
    for scale in [tf.Variable(1000.0), tf.constant(1000.0), keras.Variable(1000.0)]:
        (out,), _ = ops.unscale_and_check([x], scale)
        assert_same_bits(out, reference([x], 1000.0)[0])


# -------------------------------------------------------- all_finite

@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_all_finite_matches_tensorflow(dtype):
    x = bit_patterns(dtype)
    finite_part = tf.boolean_mask(x, tf.math.is_finite(x))
    assert bool(ops.all_finite([x])) == reference_finite([x]) is False
    assert bool(ops.all_finite([finite_part, finite_part])) is True
    for special in [np.inf, -np.inf, np.nan]:
        arr = finite_part.numpy().copy()
        arr[len(arr) // 3] = special
        assert bool(ops.all_finite([finite_part, tf.constant(arr)])) is False


# A grouped check's op runs a list of fewer bytes than
# ops.SPLIT_GROUP_FROM_BYTES on its own thread and splits a larger one over
# the intra-op pool (unscale_and_check_op.cc); `all_finite`'s op always
# splits: the same answer every way, wherever the non-finite value lies.
@pytest.mark.parametrize("nbytes", [ops.SPLIT_GROUP_FROM_BYTES - 256,
                                    ops.SPLIT_GROUP_FROM_BYTES + 256],
                         ids=["on_its_thread", "split"])
def test_all_finite_either_side_of_the_split(nbytes):
    n = nbytes // 4
    values = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    cuts = [0, n // 7, n // 2, n]

    def checks(arr):
        grads = [tf.constant(arr[a:b]) for a, b in zip(cuts, cuts[1:])]
        # One group of the three tensors, as in a step; each in its own
        # group; one op that splits.
        return grads, [bool(ops.all_finite_grouped(grads, group_bytes=1 << 40)),
                       bool(ops.all_finite_grouped(grads, group_bytes=1)),
                       bool(ops.all_finite(grads))]

    assert checks(values)[1] == [True] * 3
    for where in [0, n // 7 - 1, n // 2 + 12_345, n - 1]:
        for special in [np.inf, np.nan]:
            arr = values.copy()
            arr[where] = special
            grads, got = checks(arr)
            assert got == [reference_finite(grads)] * 3 == [False] * 3


# -------------------------------------------------------- tf.function

def test_inside_tf_function_matches_eager_tensorflow():
    rng = np.random.default_rng(2)
    grads = [tf.constant(rng.standard_normal(s).astype(d.as_numpy_dtype))
             for s, d in zip([(3, 4), (1000,), (70_000,), (5,)], FLOATS)]

    @tf.function
    def step(gs, scale):
        outs, finite = ops.unscale_and_check(gs, scale)
        return outs, finite, ops.all_finite(gs)

    for scale in [3.0, 1000.0, 2.0 ** 15]:
        outs, finite, all_fin = step(grads, tf.constant(scale))
        for out, ref in zip(outs, reference(grads, scale)):
            assert_same_bits(out, ref)
        assert bool(finite) and bool(all_fin)
    graph = step.get_concrete_function(grads, tf.constant(1.0)).graph
    assert sorted(native_op_types(graph)) == ["LossScaleAllFinite", "LossScaleUnscaleAndCheck"]


def test_one_native_op_for_the_whole_list():
    """The traced graph has the same ops for 2 and for 200 gradients,
    besides the N inputs: one native op, not N."""

    def traced(n):
        specs = [tf.TensorSpec([8], tf.float16 if i % 2 else tf.float32) for i in range(n)]
        scale = tf.Variable(2.0 ** 15)
        counter = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step(gs):
            outs, finite = ops.unscale_and_check(gs, scale)
            applied = ops.update_loss_scale(finite, scale, counter)
            return outs, applied, ops.all_finite(gs)

        graph = step.get_concrete_function(specs).graph
        per_tensor = {"Placeholder", "Identity"}
        kinds = {}
        for op in graph.get_operations():
            if op.type not in per_tensor:
                kinds[op.type] = kinds.get(op.type, 0) + 1
        return kinds

    small, large = traced(2), traced(200)
    assert small == large
    assert large["LossScaleUnscaleAndCheck"] == 1
    assert large["LossScaleAllFinite"] == 1
    assert large["LossScaleUpdate"] == 1


# ------------------------------------------------------------ in place

def test_output_reuses_a_forwardable_input_buffer():
    """Inside a graph an intermediate gradient has no other consumer, so
    TensorFlow lets the op write into it: the address seen just before the
    op equals the address of its output.  LossScaleDebugBufferAddress passes
    a tensor through (same buffer) and reports its address."""
    x = tf.constant(np.random.default_rng(3).standard_normal(1 << 16).astype(np.float32))

    @tf.function
    def forwarded(x, scale):
        g = x * 2.0                                   # a fresh intermediate buffer
        g, address_in = ops._debug_buffer_address(g)
        (out,), finite = ops.unscale_and_check([g], scale)
        out, address_out = ops._debug_buffer_address(out)
        return out, address_in, address_out

    out, address_in, address_out = forwarded(x, tf.constant(3.0))
    assert int(address_in) == int(address_out) != 0
    assert_same_bits(out, reference([x * 2.0], 3.0)[0])

    @tf.function
    def still_needed(x, scale):
        g = x * 2.0
        g, address_in = ops._debug_buffer_address(g)
        (out,), finite = ops.unscale_and_check([g], scale)
        out, address_out = ops._debug_buffer_address(out)
        return out, g, address_in, address_out       # g is returned: not forwardable

    out, g, address_in, address_out = still_needed(x, tf.constant(3.0))
    assert int(address_in) != int(address_out)
    assert_same_bits(g, x * 2.0)                      # the input was left intact
    assert_same_bits(out, reference([x * 2.0], 3.0)[0])


def test_eager_inputs_are_never_overwritten():
    x = tf.constant([1.0, 2.0, 3.0])
    before = x.numpy().copy()
    (out,), _ = ops.unscale_and_check([x], 4.0)
    np.testing.assert_array_equal(x.numpy(), before)
    np.testing.assert_array_equal(out.numpy(), before / 4)


# ------------------------------------------------------------ bad input

def test_bad_inputs_raise_and_change_nothing():
    x = tf.constant([1.0, 2.0])
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype int32"):
        ops.unscale_and_check([x, tf.constant([1, 2])], 2.0)
    with pytest.raises(TypeError, match="int32"):
        ops.all_finite([tf.constant([1, 2])])
    with pytest.raises(ValueError, match="scalar"):
        ops.unscale_and_check([x], tf.constant([2.0, 3.0]))
    with pytest.raises(TypeError, match="float32"):
        ops.unscale_and_check([x], tf.constant(2.0, tf.float64))
    with pytest.raises(TypeError, match="list"):
        ops.unscale_and_check(x, 2.0)
    with pytest.raises(TypeError):
        ops.unscale_and_check([x], "2")
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])


def test_scale_of_unknown_rank_checked_by_the_kernel():
    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def step(scale):
        return ops.unscale_and_check([tf.constant([1.0])], scale)[1]

    assert bool(step(tf.constant(2.0)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="scale must be a scalar"):
        step(tf.constant([2.0, 2.0]))


# ---------------------------------------------------------------- update

def finite_sequence(n, rate, seed):
    return (np.random.default_rng(seed).random(n) >= rate).tolist()


@pytest.mark.parametrize("initial,period,multiplier", [
    (2.0 ** 15, 3, 2.0), (0.5, 1, 2.0), (1000.0, 7, 3.0), (2.0 ** 126, 1, 2.0)])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_update_matches_tf_v1_dynamic_loss_scale(initial, period, multiplier, in_function):
    """The reference runs eagerly: that is the rule as written (scale /
    multiplier).  See the next test for the reference inside a graph."""
    ref = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=initial, increment_period=period, multiplier=multiplier)
    scale = tf.Variable(initial, dtype=tf.float32)
    counter = tf.Variable(0, dtype=tf.int64)
    good, bad = [tf.constant([1.0])], [tf.constant([np.inf])]

    def ours(finite):
        return ops.update_loss_scale(finite, scale, counter, increment_period=period,
                                     multiplier=multiplier)

    if in_function:
        ours = tf.function(ours)
    for step, finite in enumerate(finite_sequence(150, 0.3, seed=period)):
        applied = ours(tf.constant(finite))
        expected = ref.update(good if finite else bad)[1]
        assert bool(applied) == bool(expected) == finite, step
        assert scale.numpy().tobytes() == ref().numpy().tobytes(), step
        assert int(counter.numpy()) == int(ref._num_good_steps.numpy()), step


def test_reference_in_a_graph_multiplies_by_the_reciprocal():
    """Inside tf.function, Grappler rewrites the reference's `scale / 3.0`
    into `scale * float32(1 / 3)`, which rounds differently.  Callers that
    want that graph-mode trajectory get it with backoff_factor = 1/multiplier."""
    multiplier = 3.0
    ref = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=1000.0, increment_period=2, multiplier=multiplier)
    scale = tf.Variable(1000.0)
    counter = tf.Variable(0, dtype=tf.int64)
    reciprocal = float(np.float32(1) / np.float32(multiplier))
    theirs = tf.function(lambda grads: ref.update(grads)[1])
    ours = tf.function(lambda f: ops.update_loss_scale(
        f, scale, counter, increment_period=2, multiplier=multiplier,
        backoff_factor=reciprocal, min_loss_scale=1.0))
    differs_from_division = False
    for step, finite in enumerate(finite_sequence(120, 0.3, seed=9)):
        before = np.float32(scale.numpy())
        theirs([tf.constant([1.0 if finite else np.inf])])
        ours(tf.constant(finite))
        assert scale.numpy().tobytes() == ref().numpy().tobytes(), step
        if not finite and np.float32(before / np.float32(multiplier)) != scale.numpy():
            differs_from_division |= before / np.float32(multiplier) > 1
    assert differs_from_division  # the two roundings do meet on this sequence


@pytest.mark.parametrize("counter_dtype", ["int32", "int64"])
def test_keras3_rule_matches_stock_keras_optimizer(counter_dtype):
    weights = keras.Variable(np.ones(3, np.float32))
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0),
                                                initial_scale=2.0 ** 10,
                                                dynamic_growth_steps=3)
    stock.build([weights])
    scale = keras.Variable(2.0 ** 10, dtype="float32")
    counter = keras.Variable(0, dtype=counter_dtype)
    for step, finite in enumerate(finite_sequence(60, 0.25, seed=4)):
        grad = tf.constant([1.0, 1.0, 1.0] if finite else [1.0, np.nan, 1.0])
        stock.apply([grad], [weights])
        applied = ops.update_loss_scale(ops.all_finite([grad]), scale, counter, rule="keras3",
                                        increment_period=3)
        assert bool(applied) == finite
        assert scale.numpy().tobytes() == stock.dynamic_scale.numpy().tobytes(), step
        assert int(counter.numpy()) == int(stock.step_counter.numpy()), step


def model_step(state, finite, *, rule="tf24", period=2000, multiplier=2.0, backoff=None,
               min_scale=1.0, max_scale=None, hysteresis=1):
    """The documented rule (``rule_model``), one step."""
    if rule == "keras3":
        return keras3_step(state, finite, period=period, multiplier=multiplier)
    return tf24_step(state, finite, period=period, multiplier=multiplier,
                     backoff_factor=backoff, min_loss_scale=min_scale,
                     max_loss_scale=max_scale, hysteresis=hysteresis)


@pytest.mark.parametrize("config", [
    dict(period=2, min_scale=4.0, max_scale=2.0 ** 12, hysteresis=3),
    dict(period=3, backoff=0.25, multiplier=3.0, hysteresis=2),
    dict(period=1, max_scale=100.0),
    dict(rule="keras3", period=2, multiplier=4.0),
], ids=["floor-cap-hysteresis", "backoff", "cap", "keras3"])
def test_update_extensions_follow_the_documented_rule(config):
    kwargs = dict(config)
    rule = kwargs.pop("rule", "tf24")
    scale = tf.Variable(64.0)
    counter = tf.Variable(0, dtype=tf.int64)
    run = tf.Variable(0, dtype=tf.int64)
    skipped = tf.Variable(0, dtype=tf.int64)
    state = (np.float32(64.0), 0, 0, 0)
    names = dict(period="increment_period", backoff="backoff_factor",
                 min_scale="min_loss_scale", max_scale="max_loss_scale")
    op_kwargs = {names.get(k, k): v for k, v in kwargs.items()}

    @tf.function
    def step(finite):
        return ops.update_loss_scale(finite, scale, counter, overflow_run=run, skipped=skipped,
                                     rule=rule, **op_kwargs)

    for i, finite in enumerate(finite_sequence(200, 0.4, seed=5)):
        assert bool(step(tf.constant(finite))) == finite
        state = model_step(state, finite, rule=rule, **kwargs)
        got = (scale.numpy(), int(counter.numpy()), int(run.numpy()), int(skipped.numpy()))
        assert got[0].tobytes() == np.float32(state[0]).tobytes(), (i, got, state)
        assert got[1:] == tuple(state[1:]), (i, got, state)


def test_update_locks_its_variables():
    """Concurrent updates of the same variables lose no step."""
    scale = tf.Variable(8.0)
    counter = tf.Variable(0, dtype=tf.int64)
    skipped = tf.Variable(0, dtype=tf.int64)
    step = tf.function(lambda f: ops.update_loss_scale(f, scale, counter, skipped=skipped,
                                                       increment_period=10 ** 9))
    step(tf.constant(True))
    errors = []

    def worker(finite):
        try:
            for _ in range(100):
                step(tf.constant(finite))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i % 4 != 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # 2 of 8 threads report overflow: 200 skipped steps in all.
    assert int(skipped.numpy()) == 200
    assert 0 <= int(counter.numpy()) <= 601


def test_update_does_not_change_a_value_read_before():
    scale = tf.Variable(2.0 ** 15)
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        before = scale.read_value()
        ops.update_loss_scale(False, scale, counter)
        return before, scale.read_value()

    before, after = step()
    assert float(before) == 2.0 ** 15 and float(after) == 2.0 ** 14


def test_update_bad_configuration_raises_and_changes_nothing():
    scale = tf.Variable(8.0)
    counter = tf.Variable(3, dtype=tf.int64)
    run = tf.Variable(0, dtype=tf.int64)
    cases = [
        (TypeError, dict(scale=tf.Variable(8.0, dtype=tf.float64))),
        (TypeError, dict(counter=tf.Variable(0.0))),
        (TypeError, dict(scale=tf.constant(8.0))),
        (TypeError, dict(overflow_run=tf.Variable(0, dtype=tf.int32))),
        (ValueError, dict(hysteresis=2)),
        (ValueError, dict(hysteresis=0)),
        (ValueError, dict(increment_period=0)),
        (ValueError, dict(multiplier=0.0)),
        (ValueError, dict(multiplier=float("inf"))),
        (ValueError, dict(backoff_factor=1.5)),
        (ValueError, dict(min_loss_scale=-1.0)),
        (ValueError, dict(min_loss_scale=4.0, max_loss_scale=2.0)),
        (ValueError, dict(rule="pytorch")),
        (ValueError, dict(overflow_run=run, skipped=run)),
        (ValueError, dict(finite=tf.constant([True, False]))),
    ]
    for error, change in cases:
        kwargs = dict(finite=False, scale=scale, counter=counter)
        kwargs.update(change)
        with pytest.raises(error):
            ops.update_loss_scale(kwargs.pop("finite"), kwargs.pop("scale"),
                                  kwargs.pop("counter"), **kwargs)
        assert float(scale.numpy()) == 8.0 and int(counter.numpy()) == 3, change
    raw = _loader.load()[0]
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be int32"):
        raw.loss_scale_update(False, scale.handle, counter.handle, [], [], Tcounter=tf.int32,
                              max_loss_scale=float("inf"))
    assert float(scale.numpy()) == 8.0 and int(counter.numpy()) == 3


def test_update_uninitialized_variable_is_an_error():
    raw = _loader.load()[0]
    handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="ls_uninit")
    counter = tf.Variable(0, dtype=tf.int64)
    with pytest.raises((tf.errors.NotFoundError, tf.errors.FailedPreconditionError),
                       match="ls_uninit|not initialized"):
        raw.loss_scale_update(True, handle, counter.handle, [], [],
                              max_loss_scale=float("inf"))


@pytest.mark.parametrize("twice", ["variable", "slot", "variable as its slot", "average",
                                   "variable as its average", "slot as an average"])
def test_fused_step_refuses_a_variable_passed_twice(twice):
    """The fused step's op names a variable that comes twice (once it took the
    process down), among the variables, slots and EMA averages, and changes
    nothing."""
    module, _ = _loader.load()
    a = tf.Variable(np.arange(4, dtype=np.float32), name="a")
    b = tf.Variable(np.ones(4, np.float32), name="b")
    ma = tf.Variable(np.zeros(4, np.float32), name="ma")
    mb = tf.Variable(np.zeros(4, np.float32), name="mb")
    ea = tf.Variable(np.full(4, 2.0, np.float32), name="ea")
    eb = tf.Variable(np.full(4, 3.0, np.float32), name="eb")
    variables, slots, averages = {
        "variable": ([a, a], [ma, mb], []), "slot": ([a, b], [ma, ma], []),
        "variable as its slot": ([a, b], [ma, a], []), "average": ([a, b], [ma, mb], [ea, ea]),
        "variable as its average": ([a, b], [ma, mb], [ea, b]),
        "slot as an average": ([a, b], [ma, mb], [mb, eb])}[twice]
    before = [v.numpy().copy() for v in (a, b, ma, mb, ea, eb)]
    grads = [tf.ones(4), tf.ones(4)]
    ema = [tf.constant(0.9), tf.constant(0.1)] if averages else []
    with pytest.raises(tf.errors.InvalidArgumentError, match="passed twice"):
        module.loss_scale_apply_optimizer(
            tf.constant(True), [v.handle for v in variables], [s.handle for s in slots],
            grads, tf.constant(1.0), tf.constant(0.1), tf.constant(0.0), [], [], [],
            [e.handle for e in averages], ema, [], [], [], family="sgd", hyper=[0.9, 0.0],
            decay=[0, 0], unscale="divide")
    for v, want in zip((a, b, ma, mb, ea, eb), before):
        assert_same_bits(v.numpy(), want)


@pytest.mark.parametrize("which", ["scale", "learning_rate", "weight_decay", "ema", "clip"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_fused_step_refuses_a_number_that_is_not_a_scalar(which, mode):
    """Each number the fused step's op takes as a scalar, given as a vector,
    is an error naming the input, and nothing moves (read as a scalar, it
    once took the process down in an eager call, where no shape function
    runs first)."""
    module, _ = _loader.load()
    w = tf.Variable(np.arange(4, dtype=np.float32), name="w")
    m = tf.Variable(np.zeros(4, np.float32), name="m")
    e = tf.Variable(np.ones(4, np.float32), name="e")
    before = [v.numpy().copy() for v in (w, m, e)]
    numbers = {"scale": tf.constant(1.0), "learning_rate": tf.constant(0.1),
               "weight_decay": tf.constant(0.0), "ema": tf.constant(0.9),
               "clip": tf.constant(2.0)}
    numbers[which] = tf.constant([1.0, 2.0])

    def call():
        module.loss_scale_apply_optimizer(
            tf.constant(True), [w.handle], [m.handle], [tf.ones(4)], numbers["scale"],
            numbers["learning_rate"], numbers["weight_decay"], [], [numbers["clip"]], [],
            [e.handle], [numbers["ema"], tf.constant(0.1)], [], [], [], family="sgd",
            hyper=[0.9, 0.0], decay=[0], unscale="divide", clip="norm", clip_value=1.0)

    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="scalar|rank 0"):
        call() if mode == "eager" else tf.function(call)()
    for v, want in zip((w, m, e), before):
        assert_same_bits(v.numpy(), want)


def test_fused_step_averages_checked_before_anything_moves():
    """EMA averages: one per variable with the op's two numbers, each an
    initialized float32 variable of its variable's shape, or an error naming
    it and no write; then each moves as Keras moves it after the update."""
    module, _ = _loader.load()
    w = tf.Variable(np.arange(4, dtype=np.float32), name="w")
    m = tf.Variable(np.zeros(4, np.float32), name="m")
    good = tf.Variable(np.full(4, 2.0, np.float32), name="good")
    short = tf.Variable(np.zeros(3, np.float32), name="short")
    wide = tf.Variable(np.zeros(4, np.float64), name="wide")

    def call(averages, ema):
        module.loss_scale_apply_optimizer(
            tf.constant(True), [w.handle], [m.handle], [tf.ones(4)], tf.constant(1.0),
            tf.constant(0.5), tf.constant(0.0), [], [], [], [a.handle for a in averages],
            [tf.constant(x) for x in ema], [], [], [], family="sgd", hyper=[0.9, 0.0],
            decay=[0], unscale="divide")

    before = [v.numpy().copy() for v in (w, m, good)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="'short[^']*' has shape"):
        call([short], [0.9, 0.1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="'wide[^']*' must be float32"):
        call([wide], [0.9, 0.1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 EMA numbers"):
        call([good], [0.9])
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 EMA numbers"):
        call([], [0.9, 0.1])
    for v, want in zip((w, m, good), before):
        assert_same_bits(v.numpy(), want)
    momentum = np.float32(0.75)
    rest = np.float32(1) - momentum
    call([good], [momentum, rest])
    # SGD with momentum from zero: m = -g * lr, w = w + m.
    want_w = np.arange(4, dtype=np.float32) + (-np.float32(0.5))
    assert_same_bits(w.numpy(), want_w)
    assert_same_bits(good.numpy(), momentum * np.full(4, 2.0, np.float32) + rest * want_w)


# ------------------------------------------------ fused step: sparse gradients

# (shape, slices; None: dense): sparse gradients around a dense one, one
# over several of the core's blocks with rows straddling them.
OP_SPARSE_LAYOUT = [((300, 37), 450), ((33,), None), ((5, 3, 4), 9)]


def subnormal(a):
    a = np.asarray(a, np.float32)
    return bool(np.any((a != 0) & (np.abs(a) < np.finfo(np.float32).tiny)))


def sparse_op_call(module, variables, slots, grads, indices, *, family, hyper, sparse,
                   slice_factor=(1.0,), scale=1024.0, learning_rate=0.001, weight_decay=0.0,
                   decay=None, clip="none", clip_scalars=()):
    """The raw fused step, its gradients ``grads`` (slices where ``sparse``
    names the variable, with ``indices``, one per sparse variable)."""
    module.loss_scale_apply_optimizer(
        tf.constant(True), [v.handle for v in variables], [s.handle for s in slots],
        [tf.constant(g) for g in grads], tf.constant(scale, tf.float32),
        tf.constant(learning_rate, tf.float32), tf.constant(weight_decay, tf.float32), [],
        [tf.constant(c, tf.float32) for c in clip_scalars], [], [], [],
        [tf.constant(i) for i in indices], [tf.constant(f, tf.float32) for f in slice_factor],
        [], family=family, hyper=hyper, decay=decay or [0] * len(variables), unscale="divide",
        clip=clip, sparse=sparse)


@pytest.mark.parametrize("name", ["sgd_momentum", "adam_amsgrad", "adamw", "lion"])
def test_fused_step_sparse_gradients_match_the_numpy_model(name):
    """Slices of float16 gradients and their rows (repeated, out of order,
    rows never named) through the raw op, Keras' form of each family (SGD's
    slices times the learning rate, Lion's times 1 - beta_1), weight decay
    as Keras applies it: ``optim_model``'s Keras step on the slices
    densified (first checked against TensorFlow's own conversion of the
    IndexedSlices).  No value is subnormal, so the op's flushing of
    subnormals (TensorFlow's CPU arithmetic) changes nothing."""
    module, _ = _loader.load()
    cfg = CONFIGS[name]
    rng = np.random.default_rng(len(name))
    shapes = [shape for shape, _ in OP_SPARSE_LAYOUT]
    run_cfg, lr, factor = keras_sparse_form(cfg, cfg["lr"])
    values, slot_values = make_state(rng, run_cfg, shapes)
    variables = [tf.Variable(v, name=f"w{i}") for i, v in enumerate(values)]
    slots = [tf.Variable(a) for k in slot_names(run_cfg) for a in slot_values[k]]
    mask = decay_mask(run_cfg, len(shapes))
    for step in (1, 2, 3):
        grads, indices = [], []
        for shape, count in OP_SPARSE_LAYOUT:
            if count is None:
                grads.append(make_grads(rng, [shape], np.dtype(np.float16), 1024.0)[0])
                indices.append(None)
            else:
                indices.append(make_indices(rng, shape[0], count))
                grads.append(make_slices(rng, shape, count, np.dtype(np.float16), 1024.0))
        for shape, g, index in zip(shapes, grads, indices):
            if index is not None:
                u = unscaled(g, 1024.0, "divide")
                dense = tf.convert_to_tensor(tf.IndexedSlices(
                    tf.constant(u), tf.constant(index), tf.constant(shape, tf.int64)))
                assert_same_bits(densify(u, index, shape[0]), dense.numpy(), "densify")
        values, slot_values = sparse_keras_step(run_cfg, values, grads, slot_values,
                                                indices=indices, lr=lr, t=step, scale=1024.0,
                                                slice_factor=factor)
        assert not any(subnormal(a) for a in values + [b for k in slot_values
                                                       for b in slot_values[k]])
        sparse = [i for i, index in enumerate(indices) if index is not None]
        sparse_op_call(module, variables, slots, grads, [indices[i] for i in sparse],
                       family=run_cfg["opt"],
                       hyper=FAMILIES[run_cfg["opt"]]["hyper"](run_cfg, lr, step),
                       sparse=sparse, slice_factor=[1.0 if factor is None else factor],
                       learning_rate=lr, weight_decay=run_cfg.get("weight_decay", 0.0),
                       decay=[1 if m else 0 for m in mask] if mask else None)
        for i, v in enumerate(variables):
            assert_same_bits(v.numpy(), values[i], f"step {step}: variable {i}")
        got_slots = iter(slots)
        for k in slot_names(run_cfg):
            for i in range(len(shapes)):
                assert_same_bits(next(got_slots).numpy(), slot_values[k][i],
                                 f"step {step}: {k}[{i}]")


def sparse_op_setup():
    """Adam over a (6, 4) variable with a sparse gradient (5 slices) and a
    (5,) one with a dense gradient; ``(variables, slots, grads, indices)``."""
    rng = np.random.default_rng(41)
    w0 = tf.Variable(rng.standard_normal((6, 4)).astype(np.float32), name="emb")
    w1 = tf.Variable(rng.standard_normal(5).astype(np.float32), name="bias")
    slots = [tf.Variable(np.full(v.shape, x, np.float32)) for x in (0.1, 0.01)
             for v in (w0, w1)]
    grads = [rng.standard_normal((5, 4)).astype(np.float16),
             rng.standard_normal(5).astype(np.float16)]
    return [w0, w1], slots, grads, [np.array([3, 0, 3, 5, 1], np.int64)]


ADAM_HYPER = [0.1, 0.001, 1e-7, 0.0, 0.001]
CORE_REFUSAL = (r"}} LossScaleApplyOptimizer: (invalid argument \(core status -1\)"
                r"|.*(sparse|slice factor|slice_factor))")

# (id, what to break: f(grads, indices) -> op keyword overrides or None, pattern)
SPARSE_OP_BAD = [
    ("index_is_rows", lambda G, I: I[0].__setitem__(2, 6),
     r"sparse gradient of variable 'emb[^']*' has index 6, outside \[0, 6\)"),
    ("index_negative", lambda G, I: I[0].__setitem__(0, -1),
     r"sparse gradient of variable 'emb[^']*' has index -1, outside \[0, 6\)"),
    ("slices_of_another_row_shape", lambda G, I: G.__setitem__(0, np.ones((5, 3), np.float16)),
     r"sparse gradient of variable 'emb[^']*' has slices of shape \[5,3\] for rows of "
     r"the variable of shape \[6,4\]"),
    ("slices_of_another_rank", lambda G, I: G.__setitem__(0, np.ones(20, np.float16)),
     r"sparse gradient of variable 'emb[^']*' has slices of shape \[20\]"),
    ("fewer_indices_than_slices", lambda G, I: I.__setitem__(0, I[0][:4].copy()),
     r"sparse gradient of variable 'emb[^']*' has 4 indices for 5 slices"),
    ("more_indices_than_slices", lambda G, I: I.__setitem__(0, np.arange(6, dtype=np.int64)),
     r"has 6 indices for 5 slices"),
    ("sparse_not_ascending", lambda G, I: (I.append(np.arange(5, dtype=np.int64)),
                                           {"sparse": [1, 0]})[1],
     r"sparse must name variables in ascending order, each once"),
    ("sparse_twice", lambda G, I: (I.append(I[0].copy()), {"sparse": [0, 0]})[1],
     r"ascending order, each once"),
    ("sparse_past_the_variables", lambda G, I: {"sparse": [2]}, r"ascending order, each once"),
    ("sparse_negative", lambda G, I: {"sparse": [-1]}, r"ascending order, each once"),
    ("sparse_names_fewer_than_indices", lambda G, I: {"sparse": []},
     r"sparse names 0 variables for 1 indices"),
    ("no_slice_factor", lambda G, I: {"slice_factor": []}, r"0 slice factors \(one when any\)"),
    ("two_slice_factors", lambda G, I: {"slice_factor": [1.0, 1.0]},
     r"2 slice factors \(one when any\)"),
    # Refused by the core's own checks (its status; or a message of the op's).
    ("family_takes_no_sparse", lambda G, I: {"family": "nadam",
                                            "hyper": [0.1, 0.001, 1e-7] + [0.5] * 5},
     CORE_REFUSAL),
    ("slice_factor_nan", lambda G, I: {"slice_factor": [float("nan")]}, CORE_REFUSAL),
    ("slice_factor_under_global_clip", lambda G, I: {"slice_factor": [0.5], "clip": "global",
                                                    "clip_scalars": [0.5]},
     CORE_REFUSAL),
]


@pytest.mark.parametrize("case", SPARSE_OP_BAD, ids=[c[0] for c in SPARSE_OP_BAD])
def test_fused_step_sparse_bad_input_raises_and_changes_nothing(case):
    module, _ = _loader.load()
    variables, slots, grads, indices = sparse_op_setup()
    kw = dict(family="adam", hyper=ADAM_HYPER, sparse=[0])
    kw.update(case[1](grads, indices) or {})
    before = [v.numpy().copy() for v in variables + slots]
    with pytest.raises(tf.errors.InvalidArgumentError, match=case[2]):
        sparse_op_call(module, variables, slots, grads, indices, **kw)
    for v, want in zip(variables + slots, before):
        assert_same_bits(v.numpy(), want)
    # The same call unbroken goes through.
    variables, slots, grads, indices = sparse_op_setup()
    sparse_op_call(module, variables, slots, grads, indices, family="adam", hyper=ADAM_HYPER,
                   sparse=[0])
    assert not np.array_equal(variables[0].numpy(), before[0])


# ------------------------------------------------- LossScaleZeroVariables

def test_zero_variables_zeroes_every_buffer_and_spares_held_values():
    """Every element +0 (what Keras' assign(zeros) leaves), in the variables
    whose buffers nothing else holds and in those a read value still holds,
    which keeps its values (TensorFlow's copy-on-write)."""
    library = _loader.load()[0]
    a = tf.Variable(np.array([1.5, -0.0, np.nan, -np.inf], np.float32))
    b = tf.Variable(np.full((300, 7), -2.0, np.float32))
    held = b.read_value()
    library.loss_scale_zero_variables([a.handle, b.handle])
    for v in (a, b):
        assert_same_bits(v.numpy(), np.zeros(v.shape, np.float32), v.name)
    assert_same_bits(held.numpy(), np.full((300, 7), -2.0, np.float32), "the held read")

    @tf.function
    def zero_in_a_graph():
        library.loss_scale_zero_variables([b.handle])

    b.assign(np.ones((300, 7), np.float32))
    zero_in_a_graph()
    assert_same_bits(b.numpy(), np.zeros((300, 7), np.float32))


def test_zero_variables_refuses_a_non_float32_variable_before_writing():
    library = _loader.load()[0]
    a = tf.Variable(np.ones(3, np.float32))
    n = tf.Variable(np.ones(3, np.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="variable 1 is not an initialized"):
        library.loss_scale_zero_variables([a.handle, n.handle])
    assert_same_bits(a.numpy(), np.ones(3, np.float32))


def test_fused_step_global_clip_takes_one_factor_or_one_per_variable():
    """Under 'global' the op takes the step's one factor, or one per
    variable (Lamb's move, ``ratio * lr`` each): each gradient times its
    factor, then SGD's w - g * lr, in numpy's float32 operations; any other
    count is an error before anything moves."""
    module, _ = _loader.load()
    rng = np.random.default_rng(5)
    shapes = [(3, 7), (40,), (2, 2, 5)]
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    factors = np.float32([0.37, 1.0e-3 * 3.0, 7.5])
    lr = np.float32(0.3)

    def call(variables, clip_scalars):
        module.loss_scale_apply_optimizer(
            tf.constant(True), [v.handle for v in variables], [],
            [tf.constant(g) for g in grads], tf.constant(1.0), tf.constant(lr),
            tf.constant(0.0), [], [tf.constant(c) for c in clip_scalars], [], [], [], [], [],
            [], family="sgd", hyper=[0.0, 0.0], decay=[0] * len(variables), unscale="none",
            clip="global")

    for scalars in (factors, factors[:1]):
        variables = [tf.Variable(x) for x in start]
        call(variables, scalars)
        each = scalars if len(scalars) > 1 else [scalars[0]] * len(shapes)
        for v, w, g, c in zip(variables, start, grads, each):
            assert_same_bits(v.numpy(), w - (g * c) * lr)
    variables = [tf.Variable(x) for x in start]
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes 1 clip scalars, got 2"):
        call(variables, factors[:2])
    for v, w in zip(variables, start):
        assert_same_bits(v.numpy(), w)
