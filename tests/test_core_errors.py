"""Bad input to ``lossscale.core``: a TypeError/ValueError that names the
problem, and not one byte of any array changed.

Each rejected call is made with good arrays in the same list, before and
after the bad one, and every array is compared bit for bit with a copy
taken before the call.
"""

import fractions

import ml_dtypes
import numpy as np
import pytest

from lossscale import core

BF16 = np.dtype(ml_dtypes.bfloat16)


def goods():
    """Fresh good arrays of every supported dtype."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal(n).astype(d) for n, d in
            [(5, np.float16), (100_000, BF16), (300_000, np.float32), (17, np.float64)]]


def snapshot(arrays):
    return [a.tobytes() for a in arrays if isinstance(a, np.ndarray)]


def expect_rejected(call, arrays, exc, *words):
    """call() raises exc with every word in its message; arrays unchanged."""
    before = snapshot(arrays)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    assert snapshot(arrays) == before, "a rejected call modified an array"
    return msg


# ------------------------------------------------------------ dtypes


def unsupported_arrays():
    out = [
        ("int32", np.arange(4, dtype=np.int32)),
        ("uint16", np.arange(4, dtype=np.uint16)),   # float16's size, not float16
        ("int64", np.arange(4, dtype=np.int64)),
        ("bool", np.ones(4, dtype=bool)),
        ("complex64", np.ones(4, dtype=np.complex64)),
        ("complex128", np.ones(4, dtype=np.complex128)),
        ("object", np.array([1.0, None, 2.0], dtype=object)),
        ("<U", np.array(["1.0", "2.0"])),
        ("datetime64", np.array(["2020-01-01"], dtype="datetime64[D]")),
        ("float8_e4m3fn", np.ones(4, dtype=ml_dtypes.float8_e4m3fn)),
        ("float8_e5m2", np.ones(4, dtype=ml_dtypes.float8_e5m2)),
        ("('x', '<f4')", np.zeros(3, dtype=[("x", "<f4")])),
    ]
    if np.dtype(np.longdouble).itemsize > 8:
        out.append((str(np.dtype(np.longdouble)), np.ones(4, dtype=np.longdouble)))
    return out


@pytest.mark.parametrize("name,bad", unsupported_arrays(),
                         ids=[n for n, _ in unsupported_arrays()])
def test_unsupported_dtype(name, bad):
    arrays = goods()
    mixed = arrays[:2] + [bad] + arrays[2:]
    msg = expect_rejected(lambda: core.unscale_(mixed, 0.5), mixed, TypeError,
                          "unsupported dtype", "item 2", "float16")
    assert name.split("[")[0] in msg or str(bad.dtype) in msg
    expect_rejected(lambda: core.unscale_(bad, 0.5), [bad], TypeError, "unsupported dtype")
    expect_rejected(lambda: core.all_finite(mixed), mixed, TypeError, "unsupported dtype")


@pytest.mark.parametrize("code", [">f2", ">f4", ">f8"])
def test_byte_swapped_array(code):
    """Non-native byte order would be read as garbage: refused, not misread."""
    bad = np.array([1.0, np.inf, 2.0], dtype=code)
    arrays = goods() + [bad]
    expect_rejected(lambda: core.unscale_(arrays, 0.5), arrays, TypeError, "byte order")
    expect_rejected(lambda: core.all_finite(bad), [bad], TypeError, "byte order")
    # native order spelled explicitly is fine
    ok = np.array([1.0, 2.0], dtype="=" + code[1:])
    assert core.unscale_(ok, 0.5) is True and ok.tolist() == [0.5, 1.0]


def test_round_to_dtype_unsupported():
    with pytest.raises(TypeError, match="int32"):
        core.round_to_dtype(0.5, np.int32)


# ------------------------------------------------------- layout and flags


def noncontiguous_arrays():
    base = np.arange(40, dtype=np.float32).reshape(8, 5)
    return [
        ("strided", np.arange(20, dtype=np.float32)[::2]),
        ("reversed", np.arange(20, dtype=np.float64)[::-1]),
        ("fortran", np.asfortranarray(base)),
        ("column-slice", base[:, 1:3]),
        ("transposed-f16", np.ones((4, 6), dtype=np.float16).T),
        ("broadcast", np.broadcast_to(np.ones(1, dtype=np.float32), (10,))),
    ]


@pytest.mark.parametrize("name,bad", noncontiguous_arrays(),
                         ids=[n for n, _ in noncontiguous_arrays()])
def test_non_contiguous(name, bad):
    arrays = goods()
    mixed = [arrays[0], bad] + arrays[1:]
    before_bad = bad.copy()
    expect_rejected(lambda: core.unscale_(mixed, 0.5), mixed, ValueError,
                    "contiguous", "item 1")
    assert np.array_equal(bad, before_bad)
    expect_rejected(lambda: core.all_finite([bad]), [bad], ValueError, "contiguous")


def test_read_only():
    arrays = goods()
    ro = np.arange(10, dtype=np.float32)
    ro.setflags(write=False)
    frozen = np.frombuffer(bytes(np.arange(6, dtype=np.float64)), dtype=np.float64)
    for bad in (ro, frozen):
        mixed = arrays + [bad]
        expect_rejected(lambda: core.unscale_(mixed, 0.5), mixed, ValueError,
                        "read-only", f"item {len(arrays)}")
        # reading is fine
        assert core.all_finite(bad) is True
        assert core.all_finite(mixed) is True


# ------------------------------------------------------------ inv_scale


@pytest.mark.parametrize("scale,exc,words", [
    (float("nan"), ValueError, ["finite"]),
    (float("inf"), ValueError, ["finite"]),
    (float("-inf"), ValueError, ["finite"]),
    (np.float32("nan"), ValueError, ["finite"]),
    (np.float16("inf"), ValueError, ["finite"]),
    (10 ** 400, ValueError, ["finite"]),
    (fractions.Fraction(-(10 ** 400), 3), ValueError, ["finite"]),
    (0.0, ValueError, ["positive"]),
    (-0.0, ValueError, ["positive"]),
    (0, ValueError, ["positive"]),
    (-0.5, ValueError, ["positive"]),
    (np.float64(-2.0), ValueError, ["positive"]),
    ("0.5", TypeError, ["real number", "str"]),
    (None, TypeError, ["real number", "NoneType"]),
    (True, TypeError, ["real number", "bool"]),
    (np.bool_(True), TypeError, ["real number"]),
    (1 + 0j, TypeError, ["real number", "complex"]),
    ([0.5], TypeError, ["real number", "list"]),
], ids=lambda v: repr(v)[:20] if not isinstance(v, (type, list)) else None)
def test_bad_inv_scale(scale, exc, words):
    arrays = goods()
    expect_rejected(lambda: core.unscale_(arrays, scale), arrays, exc, "inv_scale", *words)


def test_numeric_inv_scale_types_accepted():
    """Any real number works: int, numpy scalars, Fraction."""
    for s in (2, np.float32(0.5), np.float16(0.25), np.int64(4), fractions.Fraction(1, 8)):
        a = np.array([1.0, 3.0], dtype=np.float32)
        assert core.unscale_(a, s) is True
        assert a.tolist() == [float(s), 3.0 * float(s)]


# ------------------------------------------------- containers and sizes


def test_empty_list_and_tuple_are_finite():
    # numpy's all() of nothing, and TensorFlow's reduce_all of nothing, are True.
    import tensorflow as tf

    oracle = bool(np.all([])) and bool(tf.reduce_all(tf.zeros([0], tf.bool)).numpy())
    for empty in ([], ()):
        assert core.unscale_(empty, 0.5) is oracle
        assert core.all_finite(empty) is oracle
    # The scale is still checked when there is nothing to scale.
    expect_rejected(lambda: core.unscale_([], float("nan")), [], ValueError, "finite")


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_zero_length_array_is_finite_and_skipped(dtype):
    for empty in (np.zeros(0, dtype=dtype), np.zeros((3, 0), dtype=dtype)):
        assert core.all_finite(empty) is bool(np.all(np.isfinite(empty)))
        assert core.unscale_(empty, 0.5) is True
        arrays = goods()
        arrays[2][7] = np.inf
        mixed = arrays[:1] + [empty] + arrays[1:]
        expected = [(a.astype(np.float32) * np.float32(0.5)).astype(a.dtype)
                    if a.dtype != np.float64 else a * 0.5 for a in mixed]
        assert core.all_finite(mixed) is bool(all(np.all(np.isfinite(a)) for a in mixed))
        assert core.unscale_(mixed, 0.5) is bool(all(np.all(np.isfinite(a)) for a in expected))
        for got, want in zip(mixed, expected):
            assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_zero_length_array_of_a_bad_kind_is_still_rejected():
    bad_dtype = np.zeros(0, dtype=np.int32)
    expect_rejected(lambda: core.all_finite([bad_dtype]), [], TypeError, "item 0",
                    "unsupported dtype")
    read_only = np.zeros(0, dtype=np.float32)
    read_only.flags.writeable = False
    expect_rejected(lambda: core.unscale_([read_only], 0.5), [], ValueError, "read-only")
    assert core.all_finite([read_only]) is True


@pytest.mark.parametrize("thing", [
    1.5, None, "abc", b"\x00\x00\x80\x3f", {"a": np.ones(2)}, memoryview(bytearray(8)),
    (x for x in [np.ones(2, np.float32)]), {np.float32(1)}, range(3)],
    ids=["float", "None", "str", "bytes", "dict", "memoryview", "generator", "set", "range"])
def test_not_an_array(thing):
    for call in (lambda: core.unscale_(thing, 0.5), lambda: core.all_finite(thing)):
        with pytest.raises(TypeError, match="numpy array"):
            call()


@pytest.mark.parametrize("item", [[1.0, 2.0], 1.0, None, "x", memoryview(bytearray(8))],
                         ids=["list", "float", "None", "str", "memoryview"])
def test_list_with_a_non_array_item(item):
    arrays = goods()
    mixed = arrays[:3] + [item] + arrays[3:]
    expect_rejected(lambda: core.unscale_(mixed, 0.5), mixed, TypeError,
                    "item 3", "numpy array", type(item).__name__)
    expect_rejected(lambda: core.all_finite(mixed), mixed, TypeError, "item 3")


# --------------------------------------------------------- shared memory


def test_two_views_of_the_same_memory():
    arrays = goods()
    base = np.arange(100, dtype=np.float32)
    cases = [
        [base, base],                               # the same array twice
        [base, base[:]],                            # a full view
        [base[10:60], base[50:90]],                 # overlapping slices
        [base[:50], base[49:]],                     # one element in common
        [base, base.view(np.float16)],              # reinterpreted bytes
        [base.reshape(10, 10), base[95:]],
    ]
    for pair in cases:
        mixed = [arrays[0]] + pair[:1] + arrays[1:3] + pair[1:] + arrays[3:]
        expect_rejected(lambda: core.unscale_(mixed, 0.5), mixed + [base], ValueError,
                        "share memory")
        # reading the same memory twice is harmless
        assert core.all_finite(mixed) is True


def test_adjacent_views_are_not_shared():
    base = np.arange(100, dtype=np.float64)
    want = base * 0.25
    assert core.unscale_([base[:50], base[50:]], 0.25) is True
    assert np.array_equal(base, want)


# ----------------------------------------------------- nothing half-written


def test_failure_after_good_items_writes_nothing():
    """The bad item is last, after large good ones: validation happens
    before any kernel runs."""
    arrays = goods() + [np.arange(3, dtype=np.int32)]
    expect_rejected(lambda: core.unscale_(arrays, 0.5), arrays, TypeError, "item 4")
    arrays = goods()
    arrays[-1].setflags(write=False)
    expect_rejected(lambda: core.unscale_(arrays, 0.5), arrays, ValueError, "read-only")


def test_bad_keyword_arguments():
    a = np.ones(3, dtype=np.float32)
    with pytest.raises(TypeError):
        core.unscale_(a, 0.5, inplace=False)
    with pytest.raises(TypeError):
        core.unscale_(a, 0.5, True)  # the flags are keyword-only
    with pytest.raises(TypeError):
        core.unscale_(a)
    assert (a == 1).all()
