"""The core's fused optimizer steps (``core.sgd_step_`` / ``core.adam_step_``).

Oracle: ``optim_model``, a numpy float32 op-by-op model of Keras 3's SGD,
Adam and AdamW written from Keras' source.  Every configuration, gradient
dtype and unscale mode is run for several steps carrying its slots over
variables whose lengths cover every vector tail, and compared bit for bit.
A non-finite gradient anywhere must leave every array as it was.  Each SIMD
level this CPU runs is forced in its own subprocess (``LOSSSCALE_SIMD``) and
must give the scalar level's bits, subnormals and huge values included, with
and without flushing.  Bad input raises a clear error and writes nothing.
"""

import os
import textwrap
import zlib

import numpy as np
import pytest

from lossscale import core
from optim_model import (BF16, CONFIGS, F32, FAMILIES, GRAD_DTYPES, TERM_CONFIGS, core_step,
                         decay_mask, flat_bits, slot_names,
                         keras_step, make_grads, make_terms, make_state, simd_runs)
from test_core_simd import built_levels, levels_here
from test_core_simd import run_worker as run_level_child

# Lengths 1, 7, 15, 17, 33, 1000 and 100003: below, at and past each vector
# width, and a tail after many full vectors.
SHAPES = [(1,), (7,), (3, 5), (17,), (33,), (10, 100), (100003,)]

# (scale, mode): no unscale; powers of two and scales whose reciprocal is
# inexact, divided (Keras 3) and multiplied (TensorFlow 2.4).
UNSCALES = [(None, "divide"), (2.0**15, "divide"), (1000.0, "divide"), (3.0, "divide"),
            (2.0**-3, "divide"), (2.0**15, "multiply"), (1000.0, "multiply"),
            (3.0, "multiply"), (2.0**-3, "multiply")]

STEPS = 3


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def first_difference(got, want):
    g, w = bits(got).reshape(-1), bits(want).reshape(-1)
    i = int(np.flatnonzero(g != w)[0])
    return (f"element {i}: got {got.reshape(-1)[i]!r} ({g[i]:#010x}), "
            f"want {want.reshape(-1)[i]!r} ({w[i]:#010x})")


def assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if not np.array_equal(bits(got), bits(want)):
        raise AssertionError(f"{what}: {first_difference(got, want)}")


def snapshot(*groups):
    """A copy of the bytes of every array in the nested lists/dicts given."""
    out = []
    for group in groups:
        items = group.values() if isinstance(group, dict) else [group]
        for arrays in items:
            out.extend(np.array(a, copy=True) for a in arrays)
    return out


def assert_unchanged(before, *groups):
    after = snapshot(*groups)
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert a.tobytes() == b.tobytes(), f"array {i} was written"


def lr_at(cfg, step):
    """A decaying learning rate, as a schedule gives one per step."""
    return F32(cfg["lr"]) * F32(0.9) ** F32(step)


# ------------------------------------------------------------ exactness


@pytest.mark.parametrize("scale,mode", UNSCALES,
                         ids=[f"{m}-{s}" if s else "none" for s, m in UNSCALES])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_match_keras_bit_for_bit(name, dtype, scale, mode):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{dtype}/{scale}/{mode}".encode()))
    variables, slots = make_state(rng, cfg, SHAPES)
    ref_vars, ref_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step in range(STEPS):
        grads = make_grads(rng, SHAPES, GRAD_DTYPES[dtype], scale)
        lr, t = lr_at(cfg, step), step + 1
        ref_vars, ref_slots = keras_step(cfg, ref_vars, grads, ref_slots, lr=lr, t=t,
                                         scale=scale, mode=mode)
        assert core_step(core, cfg, variables, grads, slots, lr=lr, t=t, scale=scale,
                         mode=mode) is True
        for i in range(len(SHAPES)):
            assert_same_bits(variables[i], ref_vars[i], f"step {step}, variable {i}")
            for k in slots:
                assert_same_bits(slots[k][i], ref_slots[k][i], f"step {step}, {k}[{i}]")


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ["sgd", "sgd_nesterov", "adamw", "adam_amsgrad"])
def test_subnormal_and_huge_values_match_keras(name, dtype):
    """IEEE mode keeps subnormals and lets huge values overflow as numpy does."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(7)
    variables, slots = make_state(rng, cfg, SHAPES[:6], special=True)
    for scale, mode in [(None, "divide"), (3.0, "divide"), (2.0**-3, "multiply")]:
        grads = make_grads(rng, SHAPES[:6], GRAD_DTYPES[dtype], scale, special=True)
        ref_vars, ref_slots = keras_step(cfg, variables, grads, slots, lr=cfg["lr"], t=5,
                                         scale=scale, mode=mode)
        assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=5, scale=scale,
                         mode=mode) is True
        for i in range(len(variables)):
            assert_same_bits(variables[i], ref_vars[i], f"{scale} {mode}: variable {i}")
            for k in slots:
                assert_same_bits(slots[k][i], ref_slots[k][i], f"{scale} {mode}: {k}[{i}]")


@pytest.mark.parametrize("name", TERM_CONFIGS)
def test_terms_match_keras_bit_for_bit(name):
    """A sparse gradient's term, summed per row, given in place of the
    function of g its family names (the gradient already unscaled): Keras'
    model on the same numbers."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    variables, slots = make_state(rng, cfg, SHAPES)
    want_vars, want_slots = [v.copy() for v in variables], {k: [a.copy() for a in v]
                                                            for k, v in slots.items()}
    for step in range(1, STEPS + 1):
        grads = make_grads(rng, SHAPES, F32, None)
        terms = make_terms(rng, cfg, SHAPES)
        want_vars, want_slots = keras_step(cfg, want_vars, grads, want_slots, lr=cfg["lr"],
                                           t=step, terms=terms)
        assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=step,
                         terms=terms) is True
        for i, (got, want) in enumerate(zip(variables, want_vars)):
            assert_same_bits(got, want, f"{name} step {step} variable {i}")
        for k in want_slots:
            for i, (got, want) in enumerate(zip(slots[k], want_slots[k])):
                assert_same_bits(got, want, f"{name} step {step} {k}[{i}]")


def test_terms_refused_where_they_do_not_apply():
    """A term for a family that takes none, with an unscale (they are of
    unscaled gradients), of another shape or dtype, or sharing a slot's
    memory: a clear error, nothing written."""
    rng = np.random.default_rng(5)
    cfg = CONFIGS["adam"]
    variables, slots = make_state(rng, cfg, [(8,)])
    grads = make_grads(rng, [(8,)], F32, None)
    terms = [np.ones(8, F32)]
    before = snapshot(variables, grads, slots, terms)
    sgd = CONFIGS["sgd_momentum"]
    sgd_vars, sgd_slots = make_state(rng, sgd, [(8,)])
    with pytest.raises(ValueError, match="sgd takes no gradient term"):
        core_step(core, sgd, sgd_vars, grads, sgd_slots, lr=0.1, t=1, terms=terms)
    with pytest.raises(ValueError, match="scale must be None"):
        core_step(core, cfg, variables, grads, slots, lr=0.1, t=1, scale=2.0,
                  terms=terms)
    with pytest.raises(ValueError, match=r"terms\[0\] has shape \(7,\)"):
        core_step(core, cfg, variables, grads, slots, lr=0.1, t=1,
                  terms=[np.ones(7, F32)])
    with pytest.raises(TypeError, match=r"terms\[0\] must be float32"):
        core_step(core, cfg, variables, grads, slots, lr=0.1, t=1,
                  terms=[np.ones(8, np.float64)])
    with pytest.raises(ValueError, match="share memory"):
        core_step(core, cfg, variables, grads, slots, lr=0.1, t=1, terms=[slots["v"][0]])
    assert_unchanged(before, variables, grads, slots, terms)


def test_zero_learning_rate_and_empty_list():
    cfg = CONFIGS["sgd_momentum"]
    rng = np.random.default_rng(3)
    variables, slots = make_state(rng, cfg, SHAPES[:3])
    grads = make_grads(rng, SHAPES[:3], np.dtype(np.float32), None)
    ref_vars, ref_slots = keras_step(cfg, variables, grads, slots, lr=0.0, t=1)
    assert core_step(core, cfg, variables, grads, slots, lr=0.0, t=1) is True
    for i in range(3):
        assert_same_bits(variables[i], ref_vars[i], f"variable {i}")
        assert_same_bits(slots["momentum"][i], ref_slots["momentum"][i], f"momentum {i}")
    assert core.sgd_step_([], [], learning_rate=0.1) is True
    assert core.adam_step_([], [], [], [], learning_rate=0.1, alpha=0.1) is True


def test_read_only_gradients_are_accepted():
    cfg = CONFIGS["adam"]
    rng = np.random.default_rng(4)
    variables, slots = make_state(rng, cfg, SHAPES[:3])
    grads = make_grads(rng, SHAPES[:3], BF16, 1000.0)
    for g in grads:
        g.flags.writeable = False
    ref_vars, _ = keras_step(cfg, variables, grads, slots, lr=0.001, t=1, scale=1000.0)
    assert core_step(core, cfg, variables, grads, slots, lr=0.001, t=1, scale=1000.0)
    for i in range(3):
        assert_same_bits(variables[i], ref_vars[i], f"variable {i}")


# ------------------------------------------------------- non-finite gradients

# (tensor index, element index): first and last tensor, the first element, a
# vector body and the tail of the long one.
BAD_POSITIONS = [(0, 0), (3, 16), (5, 999), (6, 0), (6, 65536), (6, 100002)]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ["sgd", "sgd_momentum_decay", "adam_amsgrad", "adamw"])
def test_non_finite_gradient_writes_nothing(name, dtype, bad):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(11)
    variables, slots = make_state(rng, cfg, SHAPES)
    for scale, mode in [(None, "divide"), (2.0**15, "divide"), (1000.0, "multiply")]:
        grads = make_grads(rng, SHAPES, GRAD_DTYPES[dtype], scale)
        for tensor, element in BAD_POSITIONS:
            g = grads[tensor].reshape(-1)
            keep = g[element].copy()
            g[element] = bad
            before = snapshot(variables, grads, slots)
            assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=2,
                             scale=scale, mode=mode) is False, (tensor, element)
            assert_unchanged(before, variables, grads, slots)
            g[element] = keep
        # Several at once, in different tensors.
        grads[1].reshape(-1)[3] = bad
        grads[6].reshape(-1)[-1] = -bad
        before = snapshot(variables, grads, slots)
        assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=2,
                         scale=scale, mode=mode) is False
        assert_unchanged(before, variables, grads, slots)


# ----------------------------------------------------------- SIMD levels

WORKER = textwrap.dedent(r'''
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from lossscale import core
    from optim_model import (CONFIGS, GRAD_DTYPES, core_step, flat_bits, make_grads,
                             make_state, simd_runs)

    res = {"level": np.array(core.simd_level())}
    for key, cfg, flush, variables, slots, steps in simd_runs():
        for t, grads, kwargs in steps:
            assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=t,
                             flush_denormals=flush, **kwargs) is True, key
        res[key] = flat_bits(variables, slots)
    for name, cfg in CONFIGS.items():
        # A long list, spread over the library's threads.
        shapes = [(300007,), (5,)]
        rng = np.random.default_rng(len(name))
        variables, slots = make_state(rng, cfg, shapes, special=True)
        grads = make_grads(rng, shapes, GRAD_DTYPES["float16"], 1000.0, special=True)
        core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=1, scale=1000.0)
        res[f"{name}/long"] = flat_bits(variables, slots)
    np.savez(sys.argv[1], **res)
''')


def run_worker(level, out_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return run_level_child(level, out_path, ("-c", WORKER), (tests_dir,))


@pytest.fixture(scope="module")
def level_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("optim_simd")
    return {level: run_worker(level, d / f"{level}.npz") for level in levels_here()}


def optimizer_sets():
    """The vector sets with optimizer kernels of their own (kernel_sets.def's
    optim column; a set that borrows another's, as avx512bf16 does, runs the
    same code)."""
    return [e["name"] for e in built_levels()[1].read_list()
            if e["optim"] == e["name"] and e["name"] != "scalar"]


@pytest.mark.parametrize("level", optimizer_sets())
def test_level_matches_scalar(level_results, level):
    if level not in level_results:
        pytest.skip(f"this CPU does not run {level} (best: {core.simd_best()})")
    got, ref = level_results[level], level_results["scalar"]
    assert str(got["level"]) == level and str(ref["level"]) == "scalar"
    assert set(got) == set(ref)
    bad = []
    for key in sorted(ref):
        if key != "level" and not np.array_equal(got[key], ref[key]):
            i = int(np.flatnonzero(got[key] != ref[key])[0])
            bad.append(f"{key} at {i}: {got[key][i]:#010x} vs scalar {ref[key][i]:#010x}")
    assert not bad, f"{level} differs from scalar in {len(bad)} cases: {bad[:8]}"


def test_scalar_level_matches_keras_model(level_results):
    """The scalar run's IEEE results, recomputed here with the numpy model."""
    ref = level_results["scalar"]

    def same_as_model(key, variables, slots):
        want = flat_bits(variables, slots)
        if not np.array_equal(ref[key], want):
            i = int(np.flatnonzero(ref[key] != want)[0])
            raise AssertionError(f"{key} at {i}: scalar {ref[key][i]:#010x}, "
                                 f"Keras model {want[i]:#010x}")

    checked = 0
    for key, cfg, flush, variables, slots, steps in simd_runs():
        if flush:
            continue
        for t, grads, kwargs in steps:
            variables, slots = keras_step(cfg, variables, grads, slots, lr=cfg["lr"], t=t,
                                          **kwargs)
        same_as_model(key, variables, slots)
        checked += 1
    assert checked > 0


# ------------------------------------------------------------- bad input


def adam_setup():
    """Two variables of Adam (amsgrad) state and float16 gradients."""
    rng = np.random.default_rng(21)
    shapes = [(5,), (2, 3)]
    variables, slots = make_state(rng, CONFIGS["adam_amsgrad"], shapes)
    grads = make_grads(rng, shapes, np.dtype(np.float16), 1000.0)
    return variables, grads, slots


def call_adam(variables, grads, slots, **overrides):
    kw = dict(learning_rate=0.001, alpha=0.001, scale=1000.0)
    kw.update(overrides)
    return core.adam_step_(variables, grads, slots["m"], slots["v"], slots["v_hat"], **kw)


def call_sgd(variables, grads, slots, **overrides):
    kw = dict(learning_rate=0.01, momentum=0.9, scale=1000.0)
    kw.update(overrides)
    return core.sgd_step_(variables, grads, slots["m"], **kw)


def read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def overlapping(first, second):
    """``first[0]`` and ``second[0]`` become views that share one element."""
    base = np.zeros(first[0].size + second[0].size - 1, np.float32)
    first[0] = base[:first[0].size]
    second[0] = base[first[0].size - 1:]


def strided(a):
    """The same values, every other element of a twice-as-long buffer."""
    b = np.empty((a.size * 2,), a.dtype)
    b[::2] = a.reshape(-1)
    return b[::2].reshape(a.shape)


# (id, what to break: f(variables, grads, slots) -> keyword overrides or None,
#  exception, pattern the message must match)
BAD_CASES = [
    ("grad_shape", lambda V, G, S: G.__setitem__(1, np.zeros((3, 2), np.float16)),
     ValueError, r"grads\[1\].*shape"),
    ("grad_dtype_float64", lambda V, G, S: G.__setitem__(1, G[1].astype(np.float64)),
     TypeError, r"grads\[1\].*float64"),
    ("grad_dtype_int", lambda V, G, S: G.__setitem__(0, np.zeros(5, np.int32)),
     TypeError, r"grads\[0\].*int32"),
    ("grad_not_array", lambda V, G, S: G.__setitem__(0, [0.0] * 5),
     TypeError, r"grads\[0\]"),
    ("grad_byteswapped", lambda V, G, S: G.__setitem__(1, G[1].astype(">f2")),
     TypeError, r"grads\[1\].*byte order"),
    ("grad_strided", lambda V, G, S: G.__setitem__(1, strided(G[1])),
     ValueError, r"grads\[1\].*contiguous"),
    ("var_dtype", lambda V, G, S: V.__setitem__(1, V[1].astype(np.float64)),
     TypeError, r"variables\[1\].*float32"),
    ("var_float16", lambda V, G, S: V.__setitem__(1, V[1].astype(np.float16)),
     TypeError, r"variables\[1\].*float32"),
    ("var_read_only", lambda V, G, S: V.__setitem__(1, read_only(V[1])),
     ValueError, r"variables\[1\].*read-only"),
    ("var_strided", lambda V, G, S: V.__setitem__(1, strided(V[1])),
     ValueError, r"variables\[1\].*contiguous"),
    ("var_fortran", lambda V, G, S: V.__setitem__(1, np.asfortranarray(V[1])),
     ValueError, r"variables\[1\].*contiguous"),
    ("slot_shape", lambda V, G, S: S["v"].__setitem__(1, np.zeros((6,), np.float32)),
     ValueError, r"v\[1\].*shape"),
    ("slot_dtype", lambda V, G, S: S["m"].__setitem__(1, S["m"][1].astype(np.float16)),
     TypeError, r"m\[1\].*float32"),
    ("slot_read_only", lambda V, G, S: S["v_hat"].__setitem__(1, read_only(S["v_hat"][1])),
     ValueError, r"v_hat\[1\].*read-only"),
    ("slot_strided", lambda V, G, S: S["m"].__setitem__(1, strided(S["m"][1])),
     ValueError, r"m\[1\].*contiguous"),
    ("too_few_grads", lambda V, G, S: G.__delitem__(1),
     ValueError, r"1 grads for 2 variables"),
    ("too_many_grads", lambda V, G, S: G.append(G[0].copy()),
     ValueError, r"3 grads for 2 variables"),
    ("too_few_slots", lambda V, G, S: S["v"].__delitem__(1),
     ValueError, r"1 v for 2 variables"),
    ("grads_not_list", lambda V, G, S: {"grads_array": True},
     TypeError, r"grads must be a list"),
    ("same_slot_twice", lambda V, G, S: S.__setitem__("v_hat", S["v"]),
     ValueError, r"share memory"),
    ("slot_is_variable", lambda V, G, S: S["m"].__setitem__(0, V[0]),
     ValueError, r"share memory"),
    ("grad_is_variable", lambda V, G, S: G.__setitem__(1, V[1]),
     ValueError, r"share memory"),
    ("slot_views_variable", lambda V, G, S: S["m"].__setitem__(0, V[1].reshape(-1)[:5]),
     ValueError, r"share memory"),
    ("slots_overlap_by_one", lambda V, G, S: overlapping(S["m"], S["v"]),
     ValueError, r"share memory"),
    ("lr_nan", lambda V, G, S: {"learning_rate": float("nan")},
     ValueError, r"learning_rate.*finite"),
    ("lr_inf", lambda V, G, S: {"learning_rate": float("inf")},
     ValueError, r"learning_rate.*finite"),
    ("lr_negative", lambda V, G, S: {"learning_rate": -1.0},
     ValueError, r"learning_rate.*>= 0"),
    ("lr_overflows_float32", lambda V, G, S: {"learning_rate": 1e39},
     ValueError, r"learning_rate"),
    ("lr_string", lambda V, G, S: {"learning_rate": "0.1"},
     TypeError, r"learning_rate"),
    ("scale_nan", lambda V, G, S: {"scale": float("nan")},
     ValueError, r"scale.*finite"),
    ("scale_inf", lambda V, G, S: {"scale": float("inf")},
     ValueError, r"scale.*finite"),
    ("scale_zero", lambda V, G, S: {"scale": 0.0},
     ValueError, r"scale.*positive"),
    ("scale_negative", lambda V, G, S: {"scale": -2.0},
     ValueError, r"scale.*positive"),
    ("unscale_typo", lambda V, G, S: {"unscale": "divde"},
     ValueError, r"unscale.*divde"),
    ("weight_decay_nan", lambda V, G, S: {"weight_decay": float("nan")},
     ValueError, r"weight_decay"),
    ("decay_mask_length", lambda V, G, S: {"weight_decay": 0.01, "decay": [True]},
     ValueError, r"decay"),
    ("clip_typo", lambda V, G, S: {"clip": "nrom"}, ValueError, r"clip.*nrom"),
    ("clip_value_missing", lambda V, G, S: {"clip": "value"}, ValueError, r"clip_value"),
    ("clip_value_negative", lambda V, G, S: {"clip": "value", "clip_value": -1.0},
     ValueError, r"clip_value.*positive"),
    ("clip_value_zero", lambda V, G, S: {"clip": "norm", "clip_value": 0.0,
                                         "clip_scalars": [1.0, 1.0]},
     ValueError, r"clip_value.*positive"),
    ("clip_value_nan", lambda V, G, S: {"clip": "value", "clip_value": float("nan")},
     ValueError, r"clip_value.*finite"),
    ("clip_value_inf", lambda V, G, S: {"clip": "norm", "clip_value": float("inf"),
                                        "clip_scalars": [1.0, 1.0]},
     ValueError, r"clip_value.*finite"),
    ("clip_value_overflows_float32", lambda V, G, S: {"clip": "value", "clip_value": 1e39},
     ValueError, r"clip_value"),
    ("clip_norm_scalars_missing", lambda V, G, S: {"clip": "norm", "clip_value": 1.0},
     ValueError, r"clip_scalars"),
    ("clip_norm_scalars_length", lambda V, G, S: {"clip": "norm", "clip_value": 1.0,
                                                  "clip_scalars": [1.0]},
     ValueError, r"clip_scalars"),
    ("clip_global_scalar_string", lambda V, G, S: {"clip": "global", "clip_scalars": "0.5"},
     TypeError, r"clip_scalars"),
    ("clip_scalars_without_clip", lambda V, G, S: {"clip_scalars": [1.0, 1.0]},
     ValueError, r"clip_scalars"),
]


def _break(case):
    variables, grads, slots = adam_setup()
    overrides = case[1](variables, grads, slots) or {}
    if overrides.pop("grads_array", False):
        grads = np.stack([np.zeros(5, np.float16)] * 2)
    return variables, grads, slots, overrides


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_adam_bad_input_raises_and_writes_nothing(case):
    variables, grads, slots, overrides = _break(case)
    before = snapshot(variables, slots)
    with pytest.raises(case[2], match=case[3]):
        call_adam(variables, grads, slots, **overrides)
    assert_unchanged(before, variables, slots)


# SGD keeps one slot (``m`` here is its momentums); cases about v, v_hat are Adam's.
SGD_BAD = [c for c in BAD_CASES if c[0] not in ("slot_shape", "too_few_slots",
                                                 "same_slot_twice", "slot_read_only",
                                                 "slots_overlap_by_one")]


@pytest.mark.parametrize("case", SGD_BAD, ids=[c[0] for c in SGD_BAD])
def test_sgd_bad_input_raises_and_writes_nothing(case):
    variables, grads, slots, overrides = _break(case)
    before = snapshot(variables, slots)
    with pytest.raises(case[2], match=case[3].replace(r"m\[", r"momentums\[")):
        call_sgd(variables, grads, slots, **overrides)
    assert_unchanged(before, variables, slots)


def test_sgd_momentum_slots_must_match_momentum():
    variables, grads, slots = adam_setup()
    before = snapshot(variables, slots)
    with pytest.raises(ValueError, match="momentums"):
        core.sgd_step_(variables, grads, learning_rate=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        core.sgd_step_(variables, grads, slots["m"], learning_rate=0.1)
    with pytest.raises(TypeError, match="momentums"):
        core.sgd_step_(variables, grads, slots["m"][0], learning_rate=0.1, momentum=0.9)
    assert_unchanged(before, variables, slots)


def test_bad_input_with_a_non_finite_gradient_still_raises():
    """Validation comes before the finite check: a bad call never returns False."""
    variables, grads, slots = adam_setup()
    grads[0][0] = np.inf
    before = snapshot(variables, slots)
    with pytest.raises(ValueError, match="learning_rate"):
        call_adam(variables, grads, slots, learning_rate=float("nan"))
    assert_unchanged(before, variables, slots)


# ------------------------------------------------------------------ EMA

EMA_FAMILIES = ["sgd_nesterov", "adamw", "rmsprop_momentum", "adagrad", "adamax", "nadam",
                "lion", "legacy_adam"]
# Long enough to span several of the op's EMA blocks and the library's threads.
EMA_SHAPES = SHAPES + [(300007,)]


def ema_step(cfg, variables, grads, slots, averages, momentum, *, lr, t, scale):
    """``core.optimizer_step_`` with ``averages`` moved by ``momentum``."""
    return core.optimizer_step_(cfg["opt"], variables, grads,
                                [slots[k] for k in slot_names(cfg)],
                                hyper=FAMILIES[cfg["opt"]]["hyper"](cfg, lr, t),
                                learning_rate=float(F32(lr)),
                                weight_decay=cfg.get("weight_decay"),
                                decay=decay_mask(cfg, len(variables)), scale=scale,
                                averages=averages, ema_momentum=momentum)


@pytest.mark.parametrize("name", EMA_FAMILIES)
def test_averages_move_after_the_update_as_keras_moves_them(name):
    """Keras' use_ema after its update: ``m * average + (1 - m) * var`` in
    float32, ``1 - m`` a float32 difference; the first step's momentum 0.
    Oracle: the same step without averages (the variables and slots must
    come out the same), then numpy's float32 products and sum."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"ema/{name}".encode()))
    variables, slots = make_state(rng, cfg, EMA_SHAPES)
    averages = [rng.standard_normal(v.shape).astype(F32) for v in variables]
    twin_vars, twin_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step, momentum in enumerate([0.0, 0.999, 0.9, 0.5]):
        grads = make_grads(rng, EMA_SHAPES, GRAD_DTYPES["float16"], 2.0**10)
        m = F32(momentum)
        want = [m * a + (F32(1) - m) * v for a, v in
                zip(averages, _stepped(cfg, twin_vars, grads, twin_slots, step))]
        assert ema_step(cfg, variables, grads, slots, averages, momentum, lr=cfg["lr"],
                        t=step + 1, scale=2.0**10) is True
        for i in range(len(variables)):
            assert_same_bits(variables[i], twin_vars[i], f"step {step}, variable {i}")
            assert_same_bits(averages[i], want[i], f"step {step}, average {i}")
            for k in slots:
                assert_same_bits(slots[k][i], twin_slots[k][i], f"step {step}, {k}[{i}]")


def _stepped(cfg, variables, grads, slots, step):
    """The step without averages, in place; returns the new variables."""
    assert ema_step(cfg, variables, grads, slots, None, None, lr=cfg["lr"], t=step + 1,
                    scale=2.0**10) is True
    return variables


def test_averages_unchanged_by_a_skipped_step():
    cfg = CONFIGS["adamw"]
    rng = np.random.default_rng(5)
    variables, slots = make_state(rng, cfg, EMA_SHAPES)
    averages = [rng.standard_normal(v.shape).astype(F32) for v in variables]
    grads = make_grads(rng, EMA_SHAPES, GRAD_DTYPES["float16"], 2.0**10)
    grads[-1].reshape(-1)[-1] = np.inf
    before = snapshot(variables, averages, slots)
    assert ema_step(cfg, variables, grads, slots, averages, 0.9, lr=cfg["lr"], t=1,
                    scale=2.0**10) is False
    assert_unchanged(before, variables, averages, slots)


@pytest.mark.parametrize("case", ["the variable itself", "a slot", "wrong shape", "float64",
                                  "no momentum", "momentum without averages",
                                  "non-finite momentum", "too few"])
def test_bad_averages_raise_and_write_nothing(case):
    cfg = CONFIGS["adam"]
    rng = np.random.default_rng(6)
    variables, slots = make_state(rng, cfg, SHAPES)
    averages = [rng.standard_normal(v.shape).astype(F32) for v in variables]
    grads = make_grads(rng, SHAPES, F32, None)
    momentum = 0.9
    if case == "the variable itself":
        averages[2] = variables[2]
    elif case == "a slot":
        averages[1] = slots["m"][1]
    elif case == "wrong shape":
        averages[3] = averages[3].reshape(-1)[:-1].copy()
    elif case == "float64":
        averages[0] = averages[0].astype(np.float64)
    elif case == "no momentum":
        momentum = None
    elif case == "momentum without averages":
        averages = None
    elif case == "non-finite momentum":
        momentum = float("nan")
    elif case == "too few":
        averages = averages[:-1]
    before = snapshot(variables, slots, averages or [])
    with pytest.raises((ValueError, TypeError), match="optimizer_step_"):
        ema_step(cfg, variables, grads, slots, averages, momentum, lr=cfg["lr"], t=1,
                 scale=None)
    assert_unchanged(before, variables, slots, averages or [])
