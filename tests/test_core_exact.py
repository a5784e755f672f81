"""Bit-exact results of ``lossscale.core`` against independent oracles.

IEEE side (the default): numpy for float16/float32/float64, ml_dtypes for
bfloat16 (widen to float32, multiply, round back).  Every float16 and
bfloat16 bit pattern is swept against every power-of-two inverse scale
from 2^-24 to 2^24 plus two scales that round.  Flushing side
(``flush_denormals=True``): TensorFlow's own CPU ops, which run with
subnormal inputs and results flushed to zero.  Both sides of that line are
exercised on values whose answers differ between them.
"""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from helpers import UINT, assert_same_bits, bit_patterns
from lossscale import core

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

finfo = ml_dtypes.finfo  # numpy's finfo does not know bfloat16

SWEEP_SCALES = [2.0 ** e for e in range(-24, 25)] + [1.0 / 3.0, 1000.0]


def all_patterns(dtype):
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def oracle_half(x, s):
    """numpy float16 / ml_dtypes bfloat16 widen-multiply-round."""
    with np.errstate(all="ignore"):
        if x.dtype == F16:
            return x * np.float16(rational_round(s, F16))
        return (x.astype(np.float32) * np.float32(rational_round(s, BF16))).astype(BF16)


def oracle_ieee(x, s):
    if x.dtype in (F16, BF16):
        return oracle_half(x, s)
    with np.errstate(all="ignore"):
        return x * x.dtype.type(s)


# ------------------------------------------------------------ float16 / bfloat16


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_every_half_pattern_every_scale(dtype):
    x = all_patterns(dtype)
    assert np.isnan(x.astype(np.float32)).sum() > 0
    assert (np.abs(x.astype(np.float32)) < finfo(dtype).smallest_normal).sum() > 2
    for s in SWEEP_SCALES:
        want = oracle_half(x, s)
        got = x.copy()
        finite = core.unscale_(got, s)
        assert_same_bits(got, want, f"{dtype} * {s!r}")
        # every pattern includes inf/NaN, so the whole-array flag is False
        assert finite is False


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_half_finite_flag_per_chunk(dtype):
    """Chunks of consecutive bit patterns cross the overflow edge at large
    scales; each chunk's flag must be np.isfinite(oracle).all()."""
    x = all_patterns(dtype)
    chunk = 64
    for s in SWEEP_SCALES:
        want = oracle_half(x, s)
        want_flags = np.isfinite(want.astype(np.float32)).reshape(-1, chunk).all(axis=1)
        want_in = np.isfinite(x.astype(np.float32)).reshape(-1, chunk).all(axis=1)
        got = x.copy()
        flags = [core.unscale_(got[i:i + chunk], s) for i in range(0, x.size, chunk)]
        assert flags == want_flags.tolist(), f"{dtype} * {s!r}"
        got = x.copy()
        flags_in = [core.unscale_(got[i:i + chunk], s, check_inputs=True)
                    for i in range(0, x.size, chunk)]
        assert flags_in == want_in.tolist(), f"{dtype} * {s!r} check_inputs"
        assert_same_bits(got, want, f"{dtype} * {s!r} check_inputs")
    # both outcomes are exercised
    assert not want_flags.all() and want_flags.any()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_half_all_finite_every_pattern(dtype):
    x = all_patterns(dtype)
    want = np.isfinite(x.astype(np.float32))
    got = [core.all_finite(x[i:i + 1]) for i in range(x.size)]
    assert got == want.tolist()
    x.setflags(write=False)
    assert core.all_finite(x) is False
    assert core.all_finite(x[want]) is True


# ------------------------------------------------------------ float32 / float64


def special_values(dtype):
    fi = finfo(dtype)
    tiny = fi.smallest_subnormal
    vals = [0.0, -0.0, 1.0, -1.0, fi.max, -fi.max, fi.max / 2, fi.tiny, -fi.tiny,
            tiny, -tiny, tiny * 3, fi.tiny - tiny, -(fi.tiny - tiny), fi.tiny * 0.5,
            np.inf, -np.inf, np.nan, -np.nan, fi.eps, 1.0 + fi.eps, 2.0 - fi.eps]
    a = np.array(vals, dtype=dtype)
    # a NaN with a payload and a signalling NaN
    qnan_payload = np.array([0x7FC12345 if dtype == F32 else 0x7FF8000000012345],
                            dtype=UINT[dtype.itemsize]).view(dtype)
    snan = np.array([0x7F800001 if dtype == F32 else 0x7FF0000000000001],
                    dtype=UINT[dtype.itemsize]).view(dtype)
    return np.concatenate([a, qnan_payload, snan])


def mixed_values(dtype, n=200_003, seed=0):
    rng = np.random.default_rng(seed)
    fi = finfo(dtype)
    parts = [
        rng.standard_normal(n // 4).astype(dtype),
        # log-uniform magnitudes over the whole exponent range, both signs
        (np.exp2(rng.uniform(np.log2(float(fi.smallest_subnormal)), np.log2(float(fi.max)),
                             n // 4)) * rng.choice([-1.0, 1.0], n // 4)).astype(dtype),
        # raw random bit patterns (include NaNs, infs, subnormals)
        rng.integers(0, np.iinfo(UINT[dtype.itemsize]).max, n // 4, dtype=UINT[dtype.itemsize],
                     endpoint=True).view(dtype),
        special_values(dtype),
    ]
    a = np.concatenate(parts)
    rng.shuffle(a)
    return a


WIDE_SCALES = {
    F32: [1.0, 0.5, 1.0 / 3.0, 1000.0, 2.0 ** -24, 2.0 ** 24, 1e-30, 3e38, 1.7e38,
          1e-40, 1.5e-45, 2.0 ** 100, 0.1],
    F64: [1.0, 0.5, 1.0 / 3.0, 1000.0, 2.0 ** -24, 2.0 ** 24, 1e-300, 1e300, 1e-310,
          5e-324, 2.0 ** 1000, 0.1, 1e-30, 3e38],
}


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_wide_against_numpy(dtype):
    x = mixed_values(dtype)
    for s in WIDE_SCALES[dtype]:
        want = oracle_ieee(x, s)
        got = x.copy()
        finite = core.unscale_(got, s)
        assert_same_bits(got, want, f"{dtype} * {s!r}")
        assert finite is False  # the raw bit patterns include NaN/inf


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_wide_finite_flag(dtype):
    fi = finfo(dtype)
    rng = np.random.default_rng(1)
    base = rng.standard_normal(1000).astype(dtype)
    cases = [
        (base, 0.5),
        (base, 3.0),
        (np.append(base, fi.max), 2.0),           # the product overflows
        (np.append(base, fi.max), 1.0),           # stays finite
        (np.append(base, fi.max), 1.0 + 1e-3),    # overflows by a little
        (np.append(base, dtype.type(np.inf)), 0.5),
        (np.append(base, dtype.type(np.nan)), 0.5),
        (np.append(base, fi.smallest_subnormal), 1e-10),  # underflow is finite
    ]
    for x, s in cases:
        want = oracle_ieee(x, s)
        got = x.copy()
        assert core.unscale_(got, s) is bool(np.isfinite(want).all()), (x[-1], s)
        assert_same_bits(got, want, f"{x[-1]!r} * {s!r}")
        got = x.copy()
        assert core.unscale_(got, s, check_inputs=True) is bool(np.isfinite(x).all())
        assert_same_bits(got, want, f"{x[-1]!r} * {s!r} check_inputs")
        assert core.all_finite(x) is bool(np.isfinite(x).all())


def test_check_inputs_semantics():
    """check_inputs reports on the inputs: an overflowing product of finite
    inputs is finite for it, a non-finite input is not even when the result
    could not show it (a NaN stays NaN; an inf times a finite is inf)."""
    for dtype in (F16, BF16, F32, F64):
        big = np.array([finfo(dtype).max, 1.0], dtype=dtype)
        a = big.copy()
        assert core.unscale_(a, 4.0, check_inputs=True) is True
        assert np.isinf(a[0].astype(np.float32))
        a = big.copy()
        assert core.unscale_(a, 4.0) is False
        for bad in (np.inf, -np.inf, np.nan):
            a = np.array([1.0, bad], dtype=dtype)
            assert core.unscale_(a, 0.5, check_inputs=True) is False
            a = np.array([1.0, bad], dtype=dtype)
            assert core.unscale_(a, 0.5) is False


def test_list_of_mixed_dtypes_one_flag():
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(n).astype(d) for n, d in
              [(3, F16), (1000, BF16), (70_000, F32), (5, F64), (300_001, F16)]]
    for s in (0.25, 1.0 / 3.0):
        want = [oracle_ieee(a, s) for a in arrays]
        got = [a.copy() for a in arrays]
        assert core.unscale_(got, s) is True
        for g, w in zip(got, want):
            assert_same_bits(g, w, f"{g.dtype} list * {s!r}")
    # an overflow in one array of the list clears the one flag
    arrays[2][12345] = finfo(F32).max
    got = [a.copy() for a in arrays]
    assert core.unscale_(got, 4.0) is False
    for g, a in zip(got, arrays):
        assert_same_bits(g, oracle_ieee(a, 4.0), f"{g.dtype} list * 4")
    assert core.all_finite(arrays) is True
    arrays[4][-1] = np.nan
    assert core.all_finite(arrays) is False
    assert core.all_finite(tuple(arrays[:4])) is True


def test_shapes_and_zero_dim():
    x = np.arange(24, dtype=F32).reshape(2, 3, 4) - 7.5
    got = x.copy()
    assert core.unscale_(got, 1.0 / 3.0) is True
    assert_same_bits(got, oracle_ieee(x, 1.0 / 3.0), "3-d")
    z = np.array(3.0, dtype=F64)
    assert core.unscale_(z, 0.1) is True
    assert bit_patterns(z.reshape(1))[0] == bit_patterns(np.array([3.0 * 0.1]))[0]


# --------------------------------------------------------- round_to_dtype


def rounding_probes():
    rng = np.random.default_rng(3)
    vals = [1.0 / 3.0, 1000.0, 0.1, 65504.0, 65519.99, 65520.0, 70000.0, 1e-8, 2.0 ** -25,
            2.0 ** -24, 3 * 2.0 ** -26, 2.0 ** -14, 1e-40, 1e-45, 3.4e38, 3.5e38, 1e300,
            5e-324, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8,
            1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -24, 1.0 + 2.0 ** -24 + 2.0 ** -40,
            # just above a half/bfloat16 tie: one rounding and two differ
            1.0 + 2.0 ** -11 + 2.0 ** -40, 1.0 + 2.0 ** -8 + 2.0 ** -40,
            -(1.0 + 2.0 ** -8 + 2.0 ** -40), 1000.0 * (1.0 + 2.0 ** -11 + 2.0 ** -45)]
    vals += list(np.exp2(rng.uniform(-160, 140, 20000)))
    vals += list(rng.uniform(0.5, 2.0, 20000))
    return vals


# (significand bits with the implicit one, smallest normal exponent, largest finite)
BINARY_FORMATS = {F16: (11, -14, 65504.0), BF16: (8, -126, float.fromhex("0x1.fep127"))}


def rational_round(v, dtype):
    """v rounded to nearest-even in a 16-bit format by exact rational
    arithmetic: the oracle of one correct rounding, whatever any library's
    version does (ml_dtypes before 0.7 rounded a double to bfloat16 through
    float32, 0.7 directly)."""
    if math.isnan(v) or math.isinf(v) or v == 0.0:
        return v
    digits, emin, top = BINARY_FORMATS[dtype]
    a = Fraction(abs(v))
    e = max(math.frexp(v)[1] - 1, emin)  # v's binade (exact), the subnormal one below emin
    quantum = Fraction(2) ** (e - digits + 1)
    n, rest = divmod(a, quantum)
    if rest * 2 > quantum or (rest * 2 == quantum and n % 2 == 1):
        n += 1
    r = n * quantum
    if r > Fraction(top):
        return math.copysign(math.inf, v)
    return math.copysign(float(r), v)


def round_oracle(v, dtype):
    if dtype in BINARY_FORMATS:
        return rational_round(v, dtype)
    with np.errstate(all="ignore"):
        return float(dtype.type(v))


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64],
                         ids=["float16", "bfloat16", "float32", "float64"])
def test_round_to_dtype(dtype):
    for v in rounding_probes():
        got = core.round_to_dtype(v, dtype)
        want = round_oracle(v, dtype)
        assert got == want or (math.isnan(got) and math.isnan(want)), (v, got, want)


def halfway_probes(dtype):
    """Every tie between two neighbouring finite values of dtype (subnormals,
    zero and the overflow threshold included), and the doubles just either
    side of each, both signs."""
    finite = np.sort(np.unique(np.abs(all_patterns(dtype).astype(np.float64))))
    finite = finite[np.isfinite(finite)]
    digits, _, top = BINARY_FORMATS[dtype]
    beyond = top + 2.0 ** (math.frexp(top)[1] - digits)  # where the next value would be
    ties = (np.append(finite, beyond)[1:] + np.append(finite, beyond)[:-1]) / 2
    probes = np.concatenate([ties, np.nextafter(ties, 0.0), np.nextafter(ties, np.inf)])
    return np.concatenate([probes, -probes])


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_round_to_dtype_every_tie_against_rational_oracle(dtype):
    """One correct rounding of a double to a 16-bit type: at every halfway
    point ties go to even, and a double one ulp either side goes to its own
    side, which a rounding through float32 gets wrong for bfloat16 (the
    float32 of a double just above a tie is the tie itself)."""
    probes = halfway_probes(dtype)
    finite_magnitudes = {F16: 0x7c00, BF16: 0x7f80}[dtype]  # 0 up to the largest
    assert len(probes) == 6 * finite_magnitudes
    got = np.array([core.round_to_dtype(float(v), dtype) for v in probes])
    want = np.array([rational_round(float(v), dtype) for v in probes])
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(probes[i]), got[i], want[i]) for i in bad[:5]]


def test_rational_oracle_knows_its_ties():
    """The oracle itself on the ties the issue names."""
    assert rational_round(1.0 + 2.0 ** -9, BF16) == 1.0  # tie: even
    assert rational_round(1.0039062500009095, BF16) == 1.0078125  # above the tie
    assert rational_round(65520.0, F16) == math.inf  # tie at the top: even is 2^16
    assert rational_round(np.nextafter(65520.0, 0.0), F16) == 65504.0
    assert rational_round(2.0 ** -25, F16) == 0.0  # tie with the smallest subnormal
    assert rational_round(np.nextafter(2.0 ** -25, 1.0), F16) == 2.0 ** -24


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bfloat16", "float32"])
def test_round_to_dtype_as_tf_cast(dtype):
    """A float32 inv_scale (what the TensorFlow layer feeds: 1 / a float32
    scale) is rounded as tf.cast does.  TensorFlow flushes a subnormal result
    of the cast, so those are left out.  A double that is not a float32 is
    left out too: tf.cast(float64 -> 16-bit) rounds twice, through float32,
    where round_to_dtype rounds once."""
    tf = pytest.importorskip("tensorflow")
    probes = [v for v in rounding_probes() if abs(v) >= float(finfo(dtype).tiny)
              and (dtype == F32 or float(np.float32(v)) == v or abs(v) > 3.5e38)]
    assert len(probes) > 100
    want = tf.cast(tf.constant(probes, dtype=tf.float64), tf.as_dtype(dtype)).numpy()
    got = np.array([core.round_to_dtype(v, dtype) for v in probes])
    assert np.array_equal(got, want.astype(np.float64), equal_nan=True)


def test_round_to_dtype_is_the_multiplier():
    """unscale_ multiplies by round_to_dtype(inv): 1 * inv gives it back."""
    for dtype in (F16, BF16, F32, F64):
        for v in (1.0 / 3.0, 0.1, 1000.0, 1e-7, 2.0 ** -24):
            a = np.ones(3, dtype=dtype)
            core.unscale_(a, v)
            assert float(a[0]) == core.round_to_dtype(v, dtype)


# ------------------------------------------------- flush_denormals vs TensorFlow


@pytest.fixture(scope="module")
def tf():
    tf = pytest.importorskip("tensorflow")
    return tf


def tf_product(tf, x, s):
    """TensorFlow's own CPU answer: tf.constant(x) * tf.cast(inv, dtype)."""
    dtype = tf.as_dtype(x.dtype)
    with tf.device("/CPU:0"):
        inv = tf.cast(tf.constant(s, dtype=tf.float64), dtype)
        return (tf.constant(x) * inv).numpy()


TF_SCALES = [1.0, 0.5, 2.0 ** -24, 2.0 ** -10, 2.0 ** 10, 1.0 / 3.0, 1000.0, 1e-3]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_flush_half_every_pattern_against_tensorflow(tf, dtype):
    x = all_patterns(dtype)
    differs = 0
    for s in TF_SCALES:
        want_tf = tf_product(tf, x, s)
        got = x.copy()
        finite = core.unscale_(got, s, flush_denormals=True)
        assert_same_bits(got, want_tf, f"flush {dtype} * {s!r}")
        assert finite is False
        ieee = x.copy()
        core.unscale_(ieee, s)
        assert_same_bits(ieee, oracle_half(x, s), f"ieee {dtype} * {s!r}")
        differs += int((bit_patterns(ieee) != bit_patterns(want_tf)).sum())
    if dtype == BF16:
        # bfloat16 subnormals are float32 subnormals: flushed by TensorFlow
        assert differs > 0
    else:
        # float16 arithmetic never meets a float32 subnormal: nothing flushes
        assert differs == 0


def crossing_values(dtype, s):
    """Inputs whose products land on both sides of the subnormal line."""
    fi = finfo(dtype)
    rng = np.random.default_rng(4)
    tiny = float(fi.tiny)
    mags = np.concatenate([
        rng.uniform(0.01, 1.0, 500) * tiny,                # subnormal inputs
        rng.uniform(1.0, 2.0, 500) * tiny / s,             # normal products
        rng.uniform(0.001, 1.0, 500) * tiny / s,           # products below tiny
        rng.uniform(1.0, 4.0, 500) * tiny,                 # normal inputs
        rng.standard_normal(500),
        [tiny / s, np.nextafter(tiny, 0) / s, float(fi.smallest_subnormal)],
    ])
    signs = rng.choice([-1.0, 1.0], mags.size)
    a = (mags * signs).astype(dtype)
    return np.concatenate([a, np.array([0.0, -0.0, np.inf, np.nan], dtype=dtype)])


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_flush_wide_against_tensorflow(tf, dtype):
    scales = [0.5, 2.0 ** -20, 1.0 / 3.0, 1e-3, 1.0, 2.0]
    for s in scales:
        x = crossing_values(dtype, s)
        want_tf = tf_product(tf, x, s)
        got = x.copy()
        finite = core.unscale_(got, s, flush_denormals=True)
        assert_same_bits(got, want_tf, f"flush {dtype} * {s!r}")
        assert finite is False  # the NaN/inf tail
        ieee = x.copy()
        core.unscale_(ieee, s)
        want_np = oracle_ieee(x, s)
        assert_same_bits(ieee, want_np, f"ieee {dtype} * {s!r}")
        # the two sides really differ here, and only where numpy has a subnormal
        # (input or result)
        diff = bit_patterns(want_np) != bit_patterns(want_tf)
        diff &= ~np.isnan(want_np)
        assert diff.any(), s
        sub = (np.abs(x) < finfo(dtype).tiny) | (np.abs(want_np) < finfo(dtype).tiny)
        assert not (diff & ~sub).any()
        # random normal values agree on both sides
        y = np.random.default_rng(5).standard_normal(10_000).astype(dtype)
        got = y.copy()
        core.unscale_(got, s, flush_denormals=True)
        assert_same_bits(got, tf_product(tf, y, s), f"flush normal {dtype} * {s!r}")


def test_flush_all_finite_and_state_restored(tf):
    """flush_denormals leaves the caller's floating-point state as it was:
    a following IEEE call (and numpy) still sees subnormals."""
    x = np.array([1e-40, 1.0], dtype=F32)
    a = x.copy()
    core.unscale_(a, 1.0, flush_denormals=True)
    assert a[0] == 0.0
    assert core.all_finite(x, flush_denormals=True) is True
    b = x.copy()
    core.unscale_(b, 1.0)
    assert b[0] == x[0]
    assert np.float32(1e-40) * np.float32(1.0) != 0.0
    # after TensorFlow ran on this thread, the IEEE path is still IEEE
    tf_product(tf, x, 1.0)
    c = x.copy()
    core.unscale_(c, 1.0)
    assert_same_bits(c, oracle_ieee(x, 1.0), "after tf")
