"""The C loss-scale state machine (``lossscale._native.scale_update``)
against independent references, step by step, bit for bit:

* the TensorFlow 2.4 rule against ``tf.compat.v1.mixed_precision.DynamicLossScale``
  driven with finite / non-finite gradients;
* the Keras 3 rule against the stock ``keras.optimizers.LossScaleOptimizer``
  (its ``dynamic_scale`` and ``step_counter`` variables) and against a
  numpy model of its documented rule;
* the extensions (hysteresis, min/max_loss_scale, backoff_factor, the
  skipped-step counter) against a small Python model written from the
  semantics documented in ``_core/include/lossscale.h``.

TensorFlow's CPU kernels flush subnormals, so the float32 models below
flush too (it only matters once a scale without a floor falls under 2^-126).
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from lossscale import _native  # noqa: E402
from rule_model import F32, ftz, keras3_step, tf24_step  # noqa: E402


def random_flags(n, p_finite, seed, bursts=False):
    rng = np.random.default_rng(seed)
    flags = rng.random(n) < p_finite
    if bursts:  # runs of consecutive overflows, of random length
        for start in rng.integers(0, n, n // 50):
            flags[start:start + int(rng.integers(1, 7))] = False
    return flags


def run_core(flags, initial, **config):
    """Drive the C rule; returns scale, counter, overflow_run, skipped, apply per step."""
    state = (float(F32(initial)), 0, 0, 0)
    out = []
    for f in flags:
        state, apply = _native.scale_update(state, bool(f), **config)
        out.append((state[0], state[1], state[2], state[3], apply))
    s, g, o, k, a = zip(*out)
    return (np.array(s, dtype=np.float32), np.array(g, dtype=np.int64), np.array(o),
            np.array(k), np.array(a))


def assert_scales_equal(got, want, what):
    bad = np.flatnonzero(got.view(np.uint32) != want.astype(np.float32).view(np.uint32))
    if bad.size:
        i = bad[0]
        pytest.fail(f"{what}: first difference at step {i}: got {got[max(0, i - 3):i + 2]} "
                    f"want {want[max(0, i - 3):i + 2]}")


# --------------------------------------------- TF 2.4 rule vs tf.compat.v1


def tf_reference(flags, initial, period, multiplier):
    """tf.compat.v1 DynamicLossScale updated with one gradient per step.

    Run as one tf.function for speed, with Grappler's constant folding off:
    it would rewrite ``scale / multiplier`` into ``scale * (1 / multiplier)``,
    which differs from TensorFlow's eager (true) division when the
    multiplier is not a power of two.  ``test_tf24_rule_matches_eager`` shows
    this reference equals eager TensorFlow."""
    saved = tf.config.optimizer.get_experimental_options().get("constant_folding", True)
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    try:
        return _tf_reference(flags, initial, period, multiplier)
    finally:
        tf.config.optimizer.set_experimental_options({"constant_folding": saved})


def tf_reference_eager(flags, initial, period, multiplier):
    ls = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=initial, increment_period=period, multiplier=multiplier)
    scales, goods = [], []
    for f in flags:
        ls.update([tf.constant([1.0, 2.0 if f else np.inf])])
        scales.append(ls().numpy())
        goods.append(ls._num_good_steps.numpy())
    return np.array(scales, dtype=np.float32), np.array(goods)


def _tf_reference(flags, initial, period, multiplier):
    ls = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=initial, increment_period=period, multiplier=multiplier)

    @tf.function
    def run(flags):
        n = tf.shape(flags)[0]
        scales = tf.TensorArray(tf.float32, size=n)
        goods = tf.TensorArray(tf.int64, size=n)
        applies = tf.TensorArray(tf.bool, size=n)
        for i in tf.range(n):
            bad = tf.where(i % 2 == 0, tf.constant([1.0, np.nan]), tf.constant([1.0, np.inf]))
            grad = tf.where(flags[i], tf.constant([1.0, -2.0]), bad)
            _, should_apply = ls.update([grad, None])
            scales = scales.write(i, ls())
            goods = goods.write(i, ls._num_good_steps.read_value())
            applies = applies.write(i, should_apply)
        return scales.stack(), goods.stack(), applies.stack()

    s, g, a = run(tf.constant(flags))
    return s.numpy(), g.numpy(), a.numpy()


TF24_CASES = [
    # initial, increment_period, multiplier, p_finite
    (2.0 ** 15, 2000, 2.0, 0.999),
    (2.0 ** 15, 5, 2.0, 0.9),
    (2.0 ** 15, 1, 2.0, 0.6),
    (0.25, 3, 2.0, 0.8),          # below 1: a back-off lifts it to the floor of 1
    (1e-3, 1, 3.0, 0.9),
    (1.0, 2, 3.0, 0.5),
    (100.0, 4, 2.5, 0.85),
    (7.0, 1, 1.1, 0.9),           # a multiplier that is not exact in float32
    (2.0 ** 120, 1, 2.0, 0.97),   # growth overflows float32: the scale is kept
    (1e38, 2, 3.0, 0.95),
    (3.0, 1, 2.5, 0.99),          # grows until float32 overflows, then holds
]


@pytest.mark.parametrize("initial,period,multiplier,p_finite", TF24_CASES)
def test_tf24_rule_matches_tf_compat_v1(initial, period, multiplier, p_finite):
    flags = random_flags(3000, p_finite, seed=int(period * 1000 + p_finite * 100))
    want_s, want_g, want_a = tf_reference(flags, initial, period, multiplier)
    got_s, got_g, got_o, got_k, got_a = run_core(
        flags, initial, rule=_native.RULE_TF24, increment_period=period,
        multiplier=multiplier)
    assert_scales_equal(got_s, want_s, f"scale ({initial}, {period}, {multiplier})")
    assert np.array_equal(got_g, want_g)
    assert np.array_equal(got_a, want_a)
    assert np.array_equal(got_a, flags)
    assert np.array_equal(got_k, np.cumsum(~flags))
    assert not got_o.any()  # hysteresis 1: no overflow is ever pending
    # the trajectory really moved both ways
    assert len(set(want_s.tolist())) > 1 or period == 2000


@pytest.mark.parametrize("initial,period,multiplier", [(7.0, 1, 1.1), (1e-3, 1, 3.0),
                                                       (100.0, 2, 2.5)])
def test_tf24_rule_matches_eager(initial, period, multiplier):
    flags = random_flags(250, 0.6, seed=3)
    want_s, want_g = tf_reference_eager(flags, initial, period, multiplier)
    fn_s, fn_g, _ = tf_reference(flags, initial, period, multiplier)
    got_s, got_g = run_core(flags, initial, rule=_native.RULE_TF24, increment_period=period,
                            multiplier=multiplier)[:2]
    assert_scales_equal(fn_s, want_s, "tf.function reference vs eager")
    assert_scales_equal(got_s, want_s, "core vs eager")
    assert np.array_equal(got_g, want_g) and np.array_equal(fn_g, want_g)


def test_tf24_growth_overflow_holds_at_largest_finite():
    flags = np.ones(300, dtype=bool)
    want_s, _, _ = tf_reference(flags, 3.0, 1, 2.5)
    got_s = run_core(flags, 3.0, rule=_native.RULE_TF24, increment_period=1,
                     multiplier=2.5)[0]
    assert_scales_equal(got_s, want_s, "overflow")
    assert np.isfinite(want_s).all() and want_s[-1] > 1e38


# ------------------------------------------------ Keras 3 rule vs stock Keras


def keras_reference(flags, initial, growth_steps):
    """Stock keras.optimizers.LossScaleOptimizer fed finite / non-finite
    gradients; its dynamic_scale and step_counter after each step."""
    var = keras.Variable(np.zeros(3, dtype=np.float32))
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1), initial_scale=initial,
        dynamic_growth_steps=growth_steps)
    opt.build([var])

    @tf.function
    def run(flags):
        n = tf.shape(flags)[0]
        scales = tf.TensorArray(tf.float32, size=n)
        counts = tf.TensorArray(opt.step_counter.dtype, size=n)
        for i in tf.range(n):
            grad = tf.where(flags[i], tf.ones(3), tf.constant([1.0, np.inf, 1.0]))
            opt.apply([grad], [var])
            scales = scales.write(i, opt.dynamic_scale.value)
            counts = counts.write(i, opt.step_counter.value)
        return scales.stack(), counts.stack()

    s, c = run(tf.constant(flags))
    return s.numpy(), c.numpy().astype(np.int64)


def keras_model(flags, initial, growth_steps):
    """Keras 3's rule of ``rule_model`` (grow x2 when counter == growth_steps
    - 1, halve on overflow, no floor, no cap), step by step: scale and
    counter after every step."""
    state = (ftz(initial), 0, 0, 0)
    scales, counters = [], []
    for f in flags:
        state = keras3_step(state, f, period=growth_steps)
        scales.append(state[0])
        counters.append(state[1])
    return np.array(scales, dtype=np.float32), np.array(counters, dtype=np.int64)


KERAS_CASES = [
    # initial, growth_steps, p_finite, steps
    (2.0 ** 15, 2000, 0.999, 2500),
    (2.0 ** 15, 3, 0.8, 1500),
    (2.0 ** 15, 1, 0.6, 1500),
    (0.5, 2, 0.7, 1000),
    (2.0 ** 125, 1, 0.9, 300),     # grows to inf and stays there
    (2.0 ** -120, 4, 0.2, 300),    # falls under 2^-126: TensorFlow flushes to 0
    (1e-40, 1, 0.9, 50),           # starts subnormal
]


@pytest.mark.parametrize("initial,growth,p_finite,steps", KERAS_CASES)
def test_keras3_rule_matches_stock_keras(initial, growth, p_finite, steps):
    flags = random_flags(steps, p_finite, seed=growth + steps)
    want_s, want_c = keras_reference(flags, initial, growth)
    got_s, got_c, _, got_k, got_a = run_core(
        flags, initial, rule=_native.RULE_KERAS3, increment_period=growth)
    assert_scales_equal(got_s, want_s, f"keras scale ({initial}, {growth})")
    assert np.array_equal(got_c, want_c)
    assert np.array_equal(got_a, flags)
    assert np.array_equal(got_k, np.cumsum(~flags))
    # and the numpy model of the documented rule agrees with both
    model_s, model_c = keras_model(flags, initial, growth)
    assert_scales_equal(model_s, want_s, "numpy model vs stock keras")
    assert np.array_equal(model_c, want_c)


@pytest.mark.parametrize("growth", [1, 2, 7, 50])
def test_keras3_rule_matches_numpy_model_long(growth):
    for seed, p in enumerate((0.5, 0.9, 0.99)):
        flags = random_flags(20_000, p, seed=seed)
        want_s, want_c = keras_model(flags, 2.0 ** 15, growth)
        got_s, got_c = run_core(flags, 2.0 ** 15, rule=_native.RULE_KERAS3,
                                increment_period=growth)[:2]
        assert_scales_equal(got_s, want_s, f"keras model growth={growth} p={p}")
        assert np.array_equal(got_c, want_c)


# --------------------------------------------------- extensions vs a model


def extended_model(flags, initial, period=2000, multiplier=2.0, backoff_factor=None,
                   min_loss_scale=1.0, max_loss_scale=None, hysteresis=1):
    """The extended TF 2.4 rule of ``rule_model``, step by step: arrays of
    scale, good steps, overflow run and skipped count after every step."""
    state = (ftz(initial), 0, 0, 0)
    rows = []
    for f in flags:
        state = tf24_step(state, f, period=period, multiplier=multiplier,
                          backoff_factor=backoff_factor, min_loss_scale=min_loss_scale,
                          max_loss_scale=max_loss_scale, hysteresis=hysteresis)
        rows.append(state)
    s, g, r, k = zip(*rows)
    return np.array(s, dtype=np.float32), np.array(g), np.array(r), np.array(k)


EXT_CASES = [
    dict(hysteresis=2),
    dict(hysteresis=3, period=4),
    dict(hysteresis=5, period=1, multiplier=3.0),
    dict(min_loss_scale=16.0, period=3),
    dict(min_loss_scale=0.5, period=2, initial=0.75),
    dict(min_loss_scale=0.0, period=50, initial=2.0 ** -100),   # can reach 0
    dict(max_loss_scale=2.0 ** 16, period=1),
    dict(max_loss_scale=3.0e5, period=2, multiplier=3.0),         # cap not a power
    dict(backoff_factor=0.5, period=3),
    dict(backoff_factor=0.25, period=2, multiplier=4.0),
    dict(backoff_factor=0.75, period=1, min_loss_scale=2.0),
    dict(hysteresis=2, backoff_factor=0.5, min_loss_scale=4.0, max_loss_scale=2.0 ** 20,
         period=2),
    dict(hysteresis=4, multiplier=2.5, min_loss_scale=0.0, max_loss_scale=1e6, period=1),
]


@pytest.mark.parametrize("case", EXT_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_extensions_match_model(case):
    case = dict(case)
    initial = case.pop("initial", 2.0 ** 15)
    period = case.pop("period", 2000)
    for seed, p in enumerate((0.5, 0.8, 0.97)):
        flags = random_flags(4000, p, seed=seed, bursts=True)
        want = extended_model(flags, initial, period=period, **case)
        got = run_core(flags, initial, rule=_native.RULE_TF24, increment_period=period,
                       **case)
        assert_scales_equal(got[0], want[0], f"{case} p={p}")
        assert np.array_equal(got[1], want[1]), "good_steps"
        assert np.array_equal(got[2], want[2]), "overflow_run"
        assert np.array_equal(got[3], want[3]), "skipped_steps"
        assert np.array_equal(got[4], flags), "apply"
        if "max_loss_scale" in case:
            assert got[0].max() <= F32(case["max_loss_scale"])
        if case.get("min_loss_scale", 1.0) > 0 and initial >= case.get("min_loss_scale", 1.0):
            assert got[0].min() >= F32(case.get("min_loss_scale", 1.0))


def test_defaults_of_the_extensions_are_the_seed_rule():
    flags = random_flags(3000, 0.8, seed=11)
    want_s, want_g, _ = tf_reference(flags, 2.0 ** 15, 3, 2.0)
    got = run_core(flags, 2.0 ** 15, rule=_native.RULE_TF24, increment_period=3,
                   multiplier=2.0, backoff_factor=None, min_loss_scale=1.0,
                   max_loss_scale=None, hysteresis=1)
    assert_scales_equal(got[0], want_s, "defaults")
    assert np.array_equal(got[1], want_g)


def test_hysteresis_counts_consecutive_overflows():
    """Worked by hand: h=3, period 1000, multiplier 2, from 1024."""
    F, T = False, True
    flags = [F, F, T, F, F, F, F, F, F, T, F]
    got = run_core(np.array(flags), 1024.0, rule=_native.RULE_TF24, increment_period=1000,
                   hysteresis=3)
    #            F     F     T     F     F     F(3rd) F     F     F(3rd) T    F
    scale = [1024, 1024, 1024, 1024, 1024, 512, 512, 512, 256, 256, 256]
    run = [1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 1]
    assert got[0].tolist() == scale
    assert got[2].tolist() == run
    assert got[3].tolist() == [1, 2, 2, 3, 4, 5, 6, 7, 8, 8, 9]
    assert got[4].tolist() == flags  # a tolerated overflow is still skipped


def test_backoff_factor_and_floor_by_hand():
    got = run_core(np.zeros(5, dtype=bool), 10.0, rule=_native.RULE_TF24,
                   backoff_factor=0.25, min_loss_scale=0.5)
    assert got[0].tolist() == [2.5, 0.625, 0.5, 0.5, 0.5]
    got = run_core(np.ones(4, dtype=bool), 3.0, rule=_native.RULE_TF24, increment_period=1,
                   multiplier=3.0, max_loss_scale=50.0)
    assert got[0].tolist() == [9.0, 27.0, 50.0, 50.0]


@pytest.mark.parametrize("bad,word", [
    (dict(increment_period=0), "increment_period"),
    (dict(multiplier=0.0), "multiplier"),
    (dict(multiplier=-2.0), "multiplier"),
    (dict(multiplier=float("nan")), "multiplier"),
    (dict(multiplier=float("inf")), "multiplier"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(backoff_factor=-0.5), "backoff_factor"),
    (dict(min_loss_scale=-1.0), "min_loss_scale"),
    (dict(min_loss_scale=float("nan")), "min_loss_scale"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "max_loss_scale"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(rule=7), "rule"),
])
def test_bad_config_is_rejected(bad, word):
    with pytest.raises(ValueError, match=word):
        _native.scale_update((1024.0, 0, 0, 0), True, **bad)
