"""LossScale / FixedLossScale / DynamicLossScale against TensorFlow's own classes.

The oracle is ``tf.compat.v1.mixed_precision.DynamicLossScale`` (and
``FixedLossScale``, and the Keras ``serialize``/``deserialize``/``get`` of
TensorFlow 2.4, all still shipped): both objects get the same gradients and
must agree, step for step and bit for bit, on the scale, ``good_steps`` and
``should_apply``.  The extensions, which TensorFlow lacks, are checked against
a float32 numpy model of their documented rule.
"""

import contextlib
import math

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.keras.mixed_precision import loss_scale as tf_keras_loss_scale
from tensorflow.python.util import deprecation

import lossscale
from lossscale import loss_scale as ls_module
from lossscale import ops
from helpers import tf_dynamic as reference, tf_fixed as reference_fixed
from rule_model import tf24_step

INF = float("inf")
NAN = float("nan")


def bits(x):
    """float32 bit pattern, so that inf == inf and -0.0 != 0.0 are judged exactly;
    a plain int, so that the states of test_loss_scale_subprocess's children
    travel through JSON."""
    return int(np.asarray(x, dtype=np.float32).view(np.uint32))


def state(obj):
    return bits(obj().numpy()), int(obj._num_good_steps.numpy())


# ------------------------------------------------------------ step sequences

# (name, constructor arguments, overflow rate, steps, bursty)
CASES = [
    ("defaults-0.1%", {}, 0.001, 5000, False),
    ("period1000-0.1%", dict(initial_loss_scale=2.0**15, increment_period=1000), 0.001, 5000, False),
    ("period1-50%", dict(initial_loss_scale=1024.0, increment_period=1, multiplier=2.0), 0.5, 3000, False),
    ("period1-overflows-float32", dict(initial_loss_scale=2.0**100, increment_period=1), 0.01, 3000, False),
    ("period3-mult3-10%", dict(initial_loss_scale=1000.0, increment_period=3, multiplier=3.0), 0.1, 3000, False),
    ("below-one", dict(initial_loss_scale=0.25, increment_period=5, multiplier=2.0), 0.2, 2000, False),
    ("below-one-inexact-mult1.1", dict(initial_loss_scale=0.1, increment_period=2, multiplier=1.1), 0.3, 2000, False),
    ("mult10-1%", dict(initial_loss_scale=7.0, increment_period=10, multiplier=10.0), 0.01, 3000, False),
    ("mult1.5-5%-bursts", dict(initial_loss_scale=2.0**15, increment_period=20, multiplier=1.5), 0.05, 3000, True),
    ("period50-2%-bursts", dict(initial_loss_scale=3.0, increment_period=50, multiplier=2.0), 0.02, 2000, True),
]
CASE_IDS = [c[0] for c in CASES]
EAGER_STEPS = 250


def finite_flags(rate, steps, bursty, seed):
    """True for a finite step.  Bursty: overflows come in runs (mean length 4)."""
    rng = np.random.default_rng(seed)
    if not bursty:
        return rng.random(steps) >= rate
    flags = np.ones(steps, dtype=bool)
    in_burst = False
    for i in range(steps):
        in_burst = rng.random() < (0.75 if in_burst else rate / 4)
        flags[i] = not in_burst
    return flags


def gradient_arrays(flags, seed):
    """Per step: float32 (12 values), float16 (4), float64 (2), non-finite where asked.

    Columns of the float32 row: 0-4 a dense float32 gradient, 5-8 the values
    of an IndexedSlices, 9-11 a bfloat16 gradient.
    """
    rng = np.random.default_rng(seed)
    steps = len(flags)
    m32 = rng.standard_normal((steps, 12)).astype(np.float32)
    m16 = rng.standard_normal((steps, 4)).astype(np.float16)
    m64 = rng.standard_normal((steps, 2))
    for i in np.flatnonzero(~flags):
        for _ in range(rng.integers(1, 3)):
            bad = rng.choice([INF, -INF, NAN])
            where = rng.integers(0, 18)
            if where < 12:
                m32[i, where] = bad
            elif where < 16:
                m16[i, where - 12] = bad
            else:
                m64[i, where - 16] = bad
    return m32, m16, m64


def gradient_list(m32, m16, m64):
    """One step's gradient list from its rows (works on numpy rows and tensors)."""
    m32 = tf.convert_to_tensor(m32)
    return [
        m32[0:5],
        tf.reshape(tf.convert_to_tensor(m16), [2, 2]),
        None,
        tf.IndexedSlices(tf.reshape(m32[5:9], [2, 2]), tf.constant([0, 3]), tf.constant([5, 2])),
        tf.cast(m32[9:12], tf.bfloat16),
        tf.convert_to_tensor(m64),
    ]


@contextlib.contextmanager
def reference_graphs_divide_exactly(multiplier):
    """Makes TensorFlow's class compute ``scale / multiplier`` in a tf.function as it does eagerly.

    Grappler's constant folding rewrites ``x / c`` into ``x * (1 / c)`` in a
    graph, so in a tf.function TensorFlow's own DynamicLossScale backs off by
    the rounded reciprocal: one ulp away from its eager result whenever the
    multiplier is not a power of two.  The documented rule (and ours, in every
    mode) is the division, so for such multipliers the oracle runs with
    constant folding off.  Powers of two keep the default optimizer.
    """
    mantissa = math.frexp(float(multiplier))[0]
    if mantissa == 0.5:
        yield
        return
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {"constant_folding": saved.get("constant_folding", True)})


def test_gradient_fixture_is_what_it_claims():
    flags = finite_flags(0.3, 400, False, 0)
    m32, m16, m64 = gradient_arrays(flags, 1)
    row_finite = (np.isfinite(m32).all(1) & np.isfinite(m16).all(1) & np.isfinite(m64).all(1))
    np.testing.assert_array_equal(row_finite, flags)
    assert 0.2 < 1 - flags.mean() < 0.4
    bursty = finite_flags(0.05, 4000, True, 0)
    runs = np.diff(np.flatnonzero(np.diff(np.r_[True, bursty, True].astype(int))))[::2]
    assert runs.max() >= 3  # real bursts of consecutive overflows


# ------------------------------------------------------ exact trajectories


@pytest.mark.parametrize("name,kwargs,rate,steps,bursty", CASES, ids=CASE_IDS)
def test_trajectory_eager(name, kwargs, rate, steps, bursty):
    steps = min(steps, EAGER_STEPS)
    # Raise the overflow rate of the rare cases so that the eager slice sees some.
    flags = finite_flags(max(rate, 0.02), steps, bursty, seed=sum(map(ord, name)))
    m32, m16, m64 = gradient_arrays(flags, seed=7)
    ours, ref = lossscale.DynamicLossScale(**kwargs), reference(**kwargs)
    assert state(ours) == state(ref)
    for i in range(steps):
        grads = gradient_list(m32[i], m16[i], m64[i])
        op_ours, apply_ours = ours.update(grads)
        _, apply_ref = ref.update(grads)
        assert op_ours is None
        assert bool(apply_ours) == bool(apply_ref) == bool(flags[i]), i
        assert state(ours) == state(ref), (i, ours, ref)


def loop_trajectories(objects, m32, m16, m64):
    """Every step for every object inside one tf.function (a tf.while_loop).

    Returns, per object, ``(scale bits, good_steps, should_apply)`` arrays.
    """

    @tf.function
    def run(m32, m16, m64):
        n = tf.shape(m32)[0]
        arrays = [(tf.TensorArray(tf.float32, size=n), tf.TensorArray(tf.int64, size=n),
                   tf.TensorArray(tf.bool, size=n)) for _ in objects]
        for i in tf.range(n):
            grads = gradient_list(m32[i], m16[i], m64[i])
            results = [obj.update(grads) for obj in objects]
            update_ops = [op for op, _ in results if op is not None]
            new_arrays = []
            for obj, (_, apply), (s, g, a) in zip(objects, results, arrays):
                with tf.control_dependencies(update_ops):
                    new_arrays.append((s.write(i, obj()),
                                       g.write(i, obj._num_good_steps.read_value()),
                                       a.write(i, apply)))
            arrays = new_arrays
        return [(s.stack(), g.stack(), a.stack()) for s, g, a in arrays]

    return [(s.numpy().view(np.uint32), g.numpy(), a.numpy()) for s, g, a in run(m32, m16, m64)]


def case_data(name, rate, steps, bursty):
    flags = finite_flags(rate, steps, bursty, seed=sum(map(ord, name)))
    return (flags,) + gradient_arrays(flags, seed=11)


@pytest.mark.parametrize("name,kwargs,rate,steps,bursty", CASES, ids=CASE_IDS)
def test_trajectory_in_tf_function_loop(name, kwargs, rate, steps, bursty):
    """Thousands of steps inside one tf.function."""
    flags, m32, m16, m64 = case_data(name, rate, steps, bursty)
    ours, ref = lossscale.DynamicLossScale(**kwargs), reference(**kwargs)
    with reference_graphs_divide_exactly(kwargs.get("multiplier", 2.0)):
        (s_ours, g_ours, a_ours), (s_ref, g_ref, a_ref) = loop_trajectories(
            [ours, ref], m32, m16, m64)
    np.testing.assert_array_equal(a_ref, flags)  # the oracle saw what we meant
    np.testing.assert_array_equal(a_ours, a_ref)
    np.testing.assert_array_equal(g_ours, g_ref)
    np.testing.assert_array_equal(s_ours, s_ref)
    assert state(ours) == state(ref)
    assert len(np.unique(s_ref)) > 1  # the sequence did exercise the rule


def test_trajectories_cover_the_hard_cases():
    """The cases above reach inf-growth, the floor of 1, and repeated growth."""
    flags = finite_flags(0.01, 3000, False, seed=5)
    ref = reference(initial_loss_scale=2.0**100, increment_period=1)
    scales = []
    for f in flags[:200]:
        ref.update([tf.constant(1.0 if f else INF)])
        scales.append(ref().numpy())
    assert max(scales) == np.float32(2.0**127)  # 2**128 is inf in float32: growth stopped
    ref = reference(initial_loss_scale=0.25, increment_period=5)
    ref.update([tf.constant(NAN)])
    assert ref().numpy() == 1.0  # max(0.125, 1): a back-off lifts a scale below one


@pytest.mark.parametrize("multiplier", [3.0, 1.1, 10.0])
def test_back_off_divides_in_every_mode(multiplier):
    """``scale / multiplier`` rounded once, eagerly and in a tf.function, default optimizer.

    TensorFlow's class agrees eagerly; in a tf.function it multiplies by the
    reciprocal instead (see reference_graphs_divide_exactly).
    """
    start = 3.0**30
    expected = [np.float32(start)]
    for _ in range(12):
        expected.append(max(np.float32(expected[-1] / np.float32(multiplier)), np.float32(1)))
    ref = reference(start, 5, multiplier)
    eager = lossscale.DynamicLossScale(start, 5, multiplier)
    in_graph = lossscale.DynamicLossScale(start, 5, multiplier)
    step = tf.function(lambda x: in_graph.update([x])[1])
    for value in expected[1:]:
        ref.update([tf.constant(NAN)])
        eager.update([tf.constant(NAN)])
        step(tf.constant(NAN))
        assert bits(ref().numpy()) == bits(eager().numpy()) == bits(in_graph().numpy()) == \
            bits(value)


@pytest.mark.parametrize("name,kwargs,rate,steps,bursty",
                         [CASES[2], CASES[3], CASES[6]], ids=[CASES[2][0], CASES[3][0], CASES[6][0]])
def test_trajectory_one_tf_function_call_per_step(name, kwargs, rate, steps, bursty):
    steps = min(steps, 150)
    flags = finite_flags(rate, steps, bursty, seed=3)
    m32, m16, m64 = gradient_arrays(flags, seed=5)
    ours, ref = lossscale.DynamicLossScale(**kwargs), reference(**kwargs)

    @tf.function
    def step_ours(m32, m16, m64):
        return ours.update(gradient_list(m32, m16, m64))[1]

    @tf.function
    def step_ref(m32, m16, m64):
        return ref.update(gradient_list(m32, m16, m64))[1]

    with reference_graphs_divide_exactly(kwargs.get("multiplier", 2.0)):
        for i in range(steps):
            a = step_ours(m32[i], m16[i], m64[i])
            b = step_ref(m32[i], m16[i], m64[i])
            assert bool(a) == bool(b) == bool(flags[i])
            assert state(ours) == state(ref), i
    assert step_ours.experimental_get_tracing_count() == 1


def test_trajectory_in_a_v1_graph_session():
    """In a graph, update() returns what updates the scale when run."""
    flags = finite_flags(0.3, 60, False, seed=9)
    m32, m16, m64 = gradient_arrays(flags, seed=10)
    graph = tf.Graph()
    with graph.as_default():
        ours, ref = lossscale.DynamicLossScale(8.0, 2, 3.0), reference(8.0, 2, 3.0)
        p32 = tf.compat.v1.placeholder(tf.float32, [12])
        p16 = tf.compat.v1.placeholder(tf.float16, [4])
        p64 = tf.compat.v1.placeholder(tf.float64, [2])
        grads = gradient_list(p32, p16, p64)
        op_ours, apply_ours = ours.update(grads)
        op_ref, apply_ref = ref.update(grads)
        # TensorFlow's is a bool tensor, not an Operation.
        assert isinstance(op_ref, tf.Tensor) and isinstance(op_ours, tf.Tensor)
        assert op_ours.dtype == op_ref.dtype == tf.bool and op_ours.shape == op_ref.shape
        fetch = [ours(), ref(), ours._num_good_steps, ref._num_good_steps]
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        s0 = sess.run(fetch)
        assert bits(s0[0]) == bits(s0[1])
        for i in range(len(flags)):
            feed = {p32: m32[i], p16: m16[i], p64: m64[i]}
            a, b = sess.run([apply_ours, apply_ref], feed)
            sess.run([op_ours, op_ref], feed)  # an update runs only when its op runs
            assert a == b == flags[i]
            s_ours, s_ref, g_ours, g_ref = sess.run(fetch)
            assert (bits(s_ours), g_ours) == (bits(s_ref), g_ref), i


def test_none_and_empty_gradients():
    ours, ref = lossscale.DynamicLossScale(4.0, 2), reference(4.0, 2)
    for grads in ([], [None], [None, None], {"a": [None], "b": ()}):
        _, a = ours.update(grads)
        _, b = ref.update(grads)
        assert bool(a) and bool(b)
        assert state(ours) == state(ref)
    # None next to a non-finite gradient is still skipped.
    _, a = ours.update([None, tf.constant([1.0, NAN])])
    _, b = ref.update([None, tf.constant([1.0, NAN])])
    assert not bool(a) and not bool(b)
    assert state(ours) == state(ref)


def test_nested_structures_are_flattened():
    ours, ref = lossscale.DynamicLossScale(), reference()
    grads = {"dense": [tf.constant([1.0])], "emb": (tf.constant([[INF]], tf.float16), None)}
    assert bool(ours.update(grads)[1]) == bool(ref.update(grads)[1]) is False
    assert state(ours) == state(ref)


# -------------------------------------------------------------- FixedLossScale


@pytest.mark.parametrize("value", [1, 8, 128.0, 1000.5, 2**20, True])
def test_fixed_loss_scale_matches_reference(value):
    ours, ref = lossscale.FixedLossScale(value), reference_fixed(value)
    assert ours().dtype == ref().dtype == tf.float32
    assert ours().shape == ()
    assert bits(ours().numpy()) == bits(ref().numpy())
    assert ours.get_config() == ref.get_config()
    assert repr(ours) == repr(ref)
    for grads in ([tf.constant([INF])], [tf.constant([1.0])], []):
        op, apply = ours.update(grads)
        _, apply_ref = ref.update(grads)
        assert apply is True and apply_ref is True
    assert bits(ours().numpy()) == bits(ref().numpy())


@pytest.mark.parametrize("grad", [1.0, INF, NAN])
def test_graph_update_value_is_what_tensorflows_is(grad):
    """``tf.identity(update_op)`` and ``Session.run(update_op)`` work as on
    TensorFlow's ``DynamicLossScale``, with the same value and effect."""
    graph = tf.Graph()
    with graph.as_default():
        ours, ref = lossscale.DynamicLossScale(8.0, 1), reference(8.0, 1)
        grads = [tf.constant([grad])]
        (op_ours, _), (op_ref, _) = ours.update(grads), ref.update(grads)
        identities = [tf.identity(op_ours), tf.identity(op_ref)]
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        got, want = sess.run(identities)
        assert got == want
        assert bits(sess.run(ours())) == bits(sess.run(ref()))
        assert sess.run(op_ours) == sess.run(op_ref)
        assert bits(sess.run(ours())) == bits(sess.run(ref()))


def test_fixed_loss_scale_update_in_graph_is_a_no_op():
    with tf.Graph().as_default():
        op, apply = lossscale.FixedLossScale(4).update([tf.constant([NAN])])
        assert isinstance(op, tf.Operation) and op.type == "NoOp"
        assert apply is True


def test_fixed_loss_scale_accepts_numpy_scalars():
    assert lossscale.FixedLossScale(np.float32(64.0))().numpy() == 64.0
    assert lossscale.get(np.int64(16))().numpy() == 16.0


# ----------------------------------------------------- bad configuration


def _raises_like_reference(ours_call, ref_call):
    with pytest.raises(Exception) as ref_info:
        ref_call()
    with pytest.raises(Exception) as ours_info:
        ours_call()
    assert isinstance(ours_info.value, type(ref_info.value)), (ours_info.value, ref_info.value)
    return ours_info.value


@pytest.mark.parametrize("value", [0.5, 0, -3, "8", None, [8], tf.constant(8.0)],
                         ids=["0.5", "0", "-3", "str", "None", "list", "tensor"])
def test_fixed_loss_scale_rejects_like_reference(value):
    error = _raises_like_reference(lambda: lossscale.FixedLossScale(value),
                                   lambda: reference_fixed(value))
    assert isinstance(error, ValueError)
    assert "loss_scale_value" in str(error)


@pytest.mark.parametrize("value", [NAN, INF])
def test_fixed_loss_scale_rejects_non_finite(value):
    # TensorFlow accepts these and then scales every loss to inf or NaN.
    with pytest.raises(ValueError, match="finite"):
        lossscale.FixedLossScale(value)


@pytest.mark.parametrize("identifier", ["Dynamic", "unknown", "8", [8], object()],
                         ids=["Dynamic", "unknown", "str-number", "list", "object"])
def test_get_rejects_like_reference(identifier):
    error = _raises_like_reference(lambda: lossscale.get(identifier),
                                   lambda: tf_keras_loss_scale.get(identifier))
    assert isinstance(error, ValueError)
    assert "Could not interpret loss scale identifier" in str(error)


def test_get_rejects_a_tensor():
    # TensorFlow's get() fails here with a TypeError from comparing the tensor
    # with "dynamic"; this is the error it means to raise.
    with pytest.raises(ValueError, match="Could not interpret loss scale identifier"):
        lossscale.get(tf.constant(8.0))


@pytest.mark.parametrize("identifier", [0.5, -1])
def test_get_number_below_one_rejects_like_reference(identifier):
    _raises_like_reference(lambda: lossscale.get(identifier),
                           lambda: tf_keras_loss_scale.get(identifier))


@pytest.mark.parametrize("config", [
    {"class_name": "Foo", "config": {}},
    {"config": {}},
    {"class_name": "DynamicLossScale"},
    "Foo",
], ids=["unknown-class", "no-class", "no-config", "unknown-name"])
def test_deserialize_rejects_like_reference(config):
    error = _raises_like_reference(lambda: lossscale.deserialize(config),
                                   lambda: tf_keras_loss_scale.deserialize(config))
    assert isinstance(error, ValueError)


@pytest.mark.parametrize("kwargs,match", [
    (dict(increment_period=0), "increment_period"),
    (dict(increment_period=2.5), "increment_period"),
    (dict(multiplier=0.0), "multiplier"),
    (dict(multiplier=INF), "multiplier"),
    (dict(initial_loss_scale=0.0), "initial_loss_scale"),
    (dict(initial_loss_scale=NAN), "initial_loss_scale"),
    (dict(initial_loss_scale=1e39), "float32"),
    (dict(initial_loss_scale="big"), "initial_loss_scale"),
    (dict(min_loss_scale=-1.0), "min_loss_scale"),
    (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(min_loss_scale=4.0, max_loss_scale=2.0), "max_loss_scale"),
    (dict(initial_loss_scale=2.0**15, max_loss_scale=2.0**14), "max_loss_scale"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(hysteresis=1.5), "hysteresis"),
])
def test_dynamic_loss_scale_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lossscale.DynamicLossScale(**kwargs)


def test_extensions_are_keyword_only():
    with pytest.raises(TypeError):
        lossscale.DynamicLossScale(2.0, 10, 2.0, 1.0)


def test_abstract_base_cannot_be_instantiated():
    with pytest.raises(TypeError):
        lossscale.LossScale()


# ------------------------------------------------ get / configs / serialize

CONFIG_CASES = [{}, dict(initial_loss_scale=1.0, increment_period=1, multiplier=4.0),
                dict(initial_loss_scale=0.1, increment_period=7, multiplier=1.1),
                dict(initial_loss_scale=2**15, increment_period=2000, multiplier=2)]


@pytest.mark.parametrize("kwargs", CONFIG_CASES)
def test_config_equals_reference_and_loads_into_either(kwargs):
    ours, ref = lossscale.DynamicLossScale(**kwargs), reference(**kwargs)
    assert ours.get_config() == ref.get_config()
    assert {k: type(v) for k, v in ours.get_config().items()} == \
        {k: type(v) for k, v in ref.get_config().items()}
    assert repr(ours) == repr(ref)
    with deprecation.silence():
        from_ours = type(ref).from_config(ours.get_config())
    from_ref = lossscale.DynamicLossScale.from_config(ref.get_config())
    assert from_ours.get_config() == from_ref.get_config() == ref.get_config()
    assert state(from_ours) == state(from_ref) == state(ref)
    assert (ours.initial_loss_scale, ours.increment_period, ours.multiplier) == \
        (ref.initial_loss_scale, ref.increment_period, ref.multiplier)


@pytest.mark.parametrize("make_ours,make_ref", [
    (lambda: lossscale.DynamicLossScale(), reference),
    (lambda: lossscale.DynamicLossScale(5.0, 3, 1.5), lambda: reference(5.0, 3, 1.5)),
    (lambda: lossscale.FixedLossScale(12), lambda: reference_fixed(12)),
], ids=["dynamic-default", "dynamic", "fixed"])
def test_serialize_matches_reference_both_ways(make_ours, make_ref):
    ours, ref = make_ours(), make_ref()
    serialized = tf_keras_loss_scale.serialize(ref)
    assert lossscale.serialize(ours) == serialized
    back = lossscale.deserialize(serialized)
    assert type(back) is type(ours) and back.get_config() == ref.get_config()
    assert lossscale.get(serialized).get_config() == ref.get_config()
    with deprecation.silence():
        into_ref = tf_keras_loss_scale.deserialize(lossscale.serialize(ours))
    assert type(into_ref) is type(ref) and into_ref.get_config() == ours.get_config()


def test_deserialize_by_name_and_keras3_keys():
    assert lossscale.deserialize(None) is None
    by_name = lossscale.deserialize("DynamicLossScale")
    assert by_name.get_config() == reference().get_config()
    keras3 = {"module": "lossscale", "class_name": "FixedLossScale",
              "config": {"loss_scale_value": 3.0}, "registered_name": None}
    assert lossscale.deserialize(keras3).get_config() == {"loss_scale_value": 3.0}


def test_deserialize_custom_objects():
    class MyScale(lossscale.FixedLossScale):
        pass

    obj = lossscale.deserialize({"class_name": "MyScale", "config": {"loss_scale_value": 2.0}},
                                custom_objects={"MyScale": MyScale})
    assert type(obj) is MyScale
    assert lossscale.serialize(obj) == {"class_name": "MyScale",
                                        "config": {"loss_scale_value": 2.0}}


@pytest.mark.parametrize("identifier", [8, 8.5, 1, "dynamic", None,
                                        {"class_name": "FixedLossScale",
                                         "config": {"loss_scale_value": 4.0}}])
def test_get_matches_reference(identifier):
    ours = lossscale.get(identifier)
    with deprecation.silence():
        ref = tf_keras_loss_scale.get(identifier)
    if ref is None:
        assert ours is None
        return
    assert type(ours).__name__ == type(ref).__name__
    assert ours.get_config() == ref.get_config()
    assert bits(ours().numpy()) == bits(ref().numpy())


def test_get_returns_loss_scale_objects_unchanged():
    for obj in (lossscale.DynamicLossScale(), lossscale.FixedLossScale(2)):
        assert lossscale.get(obj) is obj


def test_get_wraps_tensorflow_objects_sharing_state():
    ref = reference(16.0, 2)
    ref.update([tf.constant(1.0)])
    ours = lossscale.get(ref)
    assert isinstance(ours, lossscale.DynamicLossScale)
    assert ours.get_config() == ref.get_config()
    assert state(ours) == state(ref) == (bits(16.0), 1)
    ours.update([tf.constant(1.0)])  # grows: period 2
    assert state(ref) == (bits(32.0), 0)
    ref.update([tf.constant(NAN)])
    assert state(ours) == (bits(16.0), 0)
    fixed = lossscale.get(reference_fixed(6))
    assert isinstance(fixed, lossscale.FixedLossScale) and fixed().numpy() == 6.0


def test_public_names_are_exported():
    for name in ("LossScale", "FixedLossScale", "DynamicLossScale", "get", "serialize",
                 "deserialize"):
        assert getattr(lossscale, name) is getattr(ls_module, name)
        assert name in dir(lossscale)


# -------------------------------------------------------------- extensions

EXTENSION_CASES = [
    dict(hysteresis=3),
    dict(hysteresis=2, backoff_factor=0.25),
    dict(min_loss_scale=64.0, max_loss_scale=2.0**20),
    dict(min_loss_scale=2.0**-5, backoff_factor=0.3, multiplier=3.0),
    dict(max_loss_scale=3000.0, multiplier=3.0, hysteresis=4, count_skipped_steps=True),
    dict(count_skipped_steps=True),
]


def extension_model(kwargs, flags):
    """The documented rule (``rule_model``): (scale, good, run, skipped, apply) per step."""
    state = (np.float32(kwargs.get("initial_loss_scale", 2.0**15)), 0, 0, 0)
    for finite in flags:
        state = tf24_step(state, finite, period=kwargs.get("increment_period", 2000),
                          multiplier=kwargs.get("multiplier", 2.0),
                          backoff_factor=kwargs.get("backoff_factor"),
                          min_loss_scale=kwargs.get("min_loss_scale", 1.0),
                          max_loss_scale=kwargs.get("max_loss_scale"),
                          hysteresis=kwargs.get("hysteresis", 1))
        scale, good, run, skipped = state
        yield bits(scale), good, run, skipped, bool(finite)


@pytest.mark.parametrize("extensions", EXTENSION_CASES,
                         ids=[",".join(sorted(c)) for c in EXTENSION_CASES])
def test_extensions_follow_their_documented_rule(extensions):
    kwargs = dict(initial_loss_scale=1024.0, increment_period=3, **extensions)
    flags = finite_flags(0.3, 300, True, seed=21)
    ours = lossscale.DynamicLossScale(**kwargs)

    @tf.function
    def step(x):
        return ours.update([x])[1]

    expected = list(extension_model(kwargs, flags))
    for i, finite in enumerate(flags):
        apply = step(tf.constant([1.0, 2.0]) if finite else tf.constant([1.0, INF]))
        run = int(ours._overflow_run.numpy()) if ours._overflow_run is not None else 0
        skipped = int(ours.skipped_steps.numpy()) if ours.skipped_steps is not None else \
            expected[i][3]
        assert state(ours) + (run, skipped, bool(apply)) == expected[i], i
    if "min_loss_scale" in extensions:
        floor = np.float32(extensions["min_loss_scale"])
        assert any(e[0] == bits(floor) for e in expected)  # the floor was reached
    assert (ours._overflow_run is not None) == (kwargs.get("hysteresis", 1) > 1)
    assert (ours.skipped_steps is not None) == kwargs.get("count_skipped_steps", False)


def test_extensions_at_defaults_are_the_seed():
    explicit = lossscale.DynamicLossScale(min_loss_scale=1.0, max_loss_scale=None,
                                          backoff_factor=None, hysteresis=1,
                                          count_skipped_steps=False)
    assert explicit.get_config() == reference().get_config()
    assert sorted(v.name for v in explicit._weights.values()) == \
        sorted(v.name for v in reference()._weights.values())
    assert lossscale.DynamicLossScale(max_loss_scale=INF).get_config() == reference().get_config()


@pytest.mark.parametrize("extensions", EXTENSION_CASES,
                         ids=[",".join(sorted(c)) for c in EXTENSION_CASES])
def test_extension_configs_round_trip(extensions):
    obj = lossscale.DynamicLossScale(**{"initial_loss_scale": 5.0, "increment_period": 4,
                                        **extensions})
    config = obj.get_config()
    for key, value in extensions.items():
        if key != "multiplier":
            assert config[key] == value
    serialized = lossscale.serialize(obj)
    assert serialized["class_name"] == "DynamicLossScale"
    for back in (lossscale.deserialize(serialized), lossscale.get(serialized),
                 lossscale.DynamicLossScale.from_config(config)):
        assert back.get_config() == config
        assert repr(back) == repr(obj)
    # An extension config is not TensorFlow's: its class refuses it loudly.
    with pytest.raises(TypeError):
        with deprecation.silence():
            tf.compat.v1.mixed_precision.DynamicLossScale.from_config(config)


# ------------------------------------------------------------ checkpoints


def _drive(obj, pattern):
    for finite in pattern:
        obj.update([tf.constant([1.0 if finite else NAN])])


def _checkpoint_keys(prefix):
    return sorted((name, tuple(shape)) for name, shape in tf.train.list_variables(prefix)
                  if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH"))


def test_checkpoint_written_by_reference_restores_into_ours(tmp_path):
    ref = reference(2.0**10, 3, 2.0)
    _drive(ref, [1, 1, 1, 0, 1, 1])  # scale 1024, good_steps 2
    assert state(ref) == (bits(1024.0), 2)
    prefix = tf.train.Checkpoint(loss_scale=ref).write(str(tmp_path / "ref"))
    assert _checkpoint_keys(prefix) == [
        ("loss_scale/current_loss_scale/.ATTRIBUTES/VARIABLE_VALUE", ()),
        ("loss_scale/good_steps/.ATTRIBUTES/VARIABLE_VALUE", ())]
    ours = lossscale.DynamicLossScale(2.0**10, 3, 2.0)
    tf.train.Checkpoint(loss_scale=ours).read(prefix).assert_consumed()
    assert state(ours) == state(ref)
    # ... and both continue identically.
    pattern = [1, 1, 0, 0, 1, 1, 1, 1]
    _drive(ours, pattern)
    _drive(ref, pattern)
    assert state(ours) == state(ref)


def test_checkpoint_written_by_ours_restores_into_reference(tmp_path):
    ours = lossscale.DynamicLossScale(100.0, 4, 3.0)
    _drive(ours, [1, 1, 1, 1, 1, 0, 1])  # non-power-of-two scale
    prefix = tf.train.Checkpoint(loss_scale=ours).write(str(tmp_path / "ours"))
    ref = reference(100.0, 4, 3.0)
    tf.train.Checkpoint(loss_scale=ref).read(prefix).assert_consumed()
    assert state(ref) == state(ours) == (bits(np.float32(300.0) / np.float32(3.0)), 1)
    ref_prefix = tf.train.Checkpoint(loss_scale=reference()).write(str(tmp_path / "ref"))
    assert _checkpoint_keys(prefix) == _checkpoint_keys(ref_prefix)


def test_checkpoint_restores_on_creation(tmp_path):
    ref = reference(64.0, 5)
    _drive(ref, [1, 1, 0, 1])
    prefix = tf.train.Checkpoint(model=tf.train.Checkpoint(loss_scale=ref)).write(
        str(tmp_path / "ref"))
    ckpt = tf.train.Checkpoint(model=tf.train.Checkpoint())
    status = ckpt.read(prefix)
    ckpt.model.loss_scale = lossscale.DynamicLossScale(64.0, 5)  # created after read()
    status.assert_consumed()
    assert state(ckpt.model.loss_scale) == state(ref)


def test_checkpoint_keeps_extension_state(tmp_path):
    kwargs = dict(hysteresis=3, count_skipped_steps=True)
    ours = lossscale.DynamicLossScale(256.0, 4, **kwargs)
    _drive(ours, [1, 0, 0, 1, 0, 0])  # two overflows in a row pending, four skipped
    assert int(ours._overflow_run.numpy()) == 2 and int(ours.skipped_steps.numpy()) == 4
    prefix = tf.train.Checkpoint(loss_scale=ours).write(str(tmp_path / "ext"))
    assert {k for k, _ in _checkpoint_keys(prefix)} >= {
        "loss_scale/overflow_run/.ATTRIBUTES/VARIABLE_VALUE",
        "loss_scale/skipped_steps/.ATTRIBUTES/VARIABLE_VALUE"}
    back = lossscale.DynamicLossScale(256.0, 4, **kwargs)
    tf.train.Checkpoint(loss_scale=back).read(prefix).assert_consumed()
    assert int(back._overflow_run.numpy()) == 2 and int(back.skipped_steps.numpy()) == 4
    assert state(back) == state(ours)
    _drive(back, [0])  # the third overflow in a row backs off
    assert back().numpy() == 128.0
    # A reference checkpoint still restores the seed's state into it.
    ref = reference(256.0, 4)
    _drive(ref, [0, 1])
    ref_prefix = tf.train.Checkpoint(loss_scale=ref).write(str(tmp_path / "ref"))
    status = tf.train.Checkpoint(loss_scale=back).read(ref_prefix)
    with pytest.raises(AssertionError):  # it has no overflow_run / skipped_steps
        status.assert_existing_objects_matched()
    assert state(back) == state(ref)


def test_variables_are_non_trainable_and_named():
    ours, ref = lossscale.DynamicLossScale(), reference()
    for a, b in ((ours._current_loss_scale, ref._current_loss_scale),
                 (ours._num_good_steps, ref._num_good_steps)):
        assert not a.trainable and a.dtype == b.dtype
        assert a.name == b.name
        assert a.aggregation == tf.VariableAggregation.NONE
    for obj in (ours, ref):
        module = tf.Module()
        module.ls = obj
        assert len(module.trainable_variables) == 0


# -------------------------------------------------------------- one op, not N


@pytest.mark.parametrize("n", [2, 200])
def test_update_graph_has_constant_native_op_count(n):
    available = ops.native_available()
    if not available:
        pytest.skip(f"native op library not in use: {available.reason}")

    def op_types(count):
        ours = lossscale.DynamicLossScale()

        @tf.function
        def step(grads):
            return ours.update(grads)[1]

        specs = [tf.TensorSpec([3, 2], tf.float32)] * count
        graph = step.get_concrete_function(specs).graph
        return [op.type for op in graph.get_operations()]

    small, big = op_types(1), op_types(n)
    assert sorted(t for t in small if t.startswith("LossScale")) == \
        ["LossScaleAllFinite", "LossScaleUpdate"]  # one check, one update
    # Only the inputs grow with the gradient count: every other op is the same.
    assert big.count("Placeholder") - small.count("Placeholder") == n - 1
    assert sorted(t for t in big if t != "Placeholder") == \
        sorted(t for t in small if t != "Placeholder")
