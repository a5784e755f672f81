"""The core's fused optimizer steps (``core.sgd_step_`` / ``core.adam_step_``).

Oracle: ``optim_model``, a numpy float32 op-by-op model of Keras 3's SGD,
Adam and AdamW written from Keras' source.  Every configuration, gradient
dtype and unscale mode is run for several steps carrying its slots over
variables whose lengths cover every vector tail, and compared bit for bit.
A non-finite gradient anywhere must leave every array as it was.  Each SIMD
level this CPU runs is forced in its own subprocess (``LOSSSCALE_SIMD``) and
must give the scalar level's bits, subnormals and huge values included, with
and without flushing.  Bad input raises a clear error and writes nothing.
Sparse gradients (``indices``: an IndexedSlices' slices and rows) against
the same model on the slices densified as TensorFlow densifies them, the
densifying itself checked against TensorFlow.  The update step of a
gradient accumulation (``accumulators``) against the model's own
restatement of Keras' average, ``(g + acc) / steps`` divided or times the
reciprocal, every accumulator +0 after it.
"""

import os
import textwrap
import zlib

import numpy as np
import pytest

from lossscale import core
from optim_model import (ACCUMULATE_AVERAGES, ACCUMULATE_CONFIGS, BF16, CONFIGS, F32,
                         FAMILIES, GRAD_DTYPES, SPARSE_CLIP_CONFIGS, SPARSE_CONFIGS,
                         TERM_CONFIGS, accumulated, core_step, decay_mask, densify, flat_bits,
                         slot_names, keras_sparse_form, keras_step, make_accumulators,
                         make_grads, make_indices, make_slices, make_terms, make_state,
                         simd_runs, sparse_forms, sparse_keras_step, sparse_simd_runs, SPARSE_ROW_CONFIGS,
                         rows_step, SPARSE_LEGACY_CONFIGS, legacy_rows_step,
                         legacy_sparse_hyper, summed, SPARSE_ACCUMULATE_CONFIGS)
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
    assert_level_matches_scalar(level_results, level)


def assert_level_matches_scalar(results, level):
    """Every run of ``level`` in ``results`` gives the scalar level's bits."""
    if level not in results:
        pytest.skip(f"this CPU does not run {level} (best: {core.simd_best()})")
    got, ref = results[level], results["scalar"]
    assert str(got["level"]) == level and str(ref["level"]) == "scalar"
    assert set(got) == set(ref) and len(ref) > 1
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


# --------------------------------------------------- gradient accumulation
# ``accumulators``: the update step of Keras' gradient_accumulation_steps,
# each gradient unscaled, plus its accumulator, averaged, then clipped and
# applied; the accumulator zeroed.  Oracle: ``optim_model.accumulated``
# (numpy, op by op) feeding the Keras model.

# (scale, mode) of the unscale before the average: none, an exact and an
# inexact reciprocal divided (Keras 3), an inexact one multiplied
# (TensorFlow 2.4, rounded to a float16 or bfloat16 gradient's dtype).
ACCUMULATE_UNSCALES = [(None, "divide"), (2.0**15, "divide"), (3.0, "divide"),
                       (1000.0, "multiply")]


def assert_zero(accumulators, what):
    for i, a in enumerate(accumulators):
        assert not np.any(bits(a)), f"{what}: accumulator {i} is not +0"


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ACCUMULATE_CONFIGS)
def test_accumulated_update_matches_keras_bit_for_bit(name, dtype):
    """Every average (divided, times the reciprocal; over 1 to 5 steps)
    under every unscale, one update step each carrying the state over:
    the model's variables and slots, and every accumulator +0."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"accumulate/{name}/{dtype}".encode()))
    variables, slots = make_state(rng, cfg, SHAPES)
    want_vars, want_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    averages = ACCUMULATE_AVERAGES + [(1, "divide"), (2, "multiply"), (8, "divide")]
    t = 0
    for steps, average in averages:
        for scale, mode in ACCUMULATE_UNSCALES:
            t += 1
            grads = make_grads(rng, SHAPES, GRAD_DTYPES[dtype], scale)
            accumulators = make_accumulators(rng, SHAPES)
            kw = dict(accumulation_steps=steps, accumulation=average, scale=scale, mode=mode)
            lr = lr_at(cfg, t)
            want_vars, want_slots = keras_step(cfg, want_vars, grads, want_slots, lr=lr, t=t,
                                               accumulators=accumulators, **kw)
            assert core_step(core, cfg, variables, grads, slots, lr=lr, t=t,
                             accumulators=accumulators, **kw) is True
            what = f"{steps} {average}, {scale} {mode}"
            assert_zero(accumulators, what)
            for i in range(len(SHAPES)):
                assert_same_bits(variables[i], want_vars[i], f"{what}: variable {i}")
                for k in slots:
                    assert_same_bits(slots[k][i], want_slots[k][i], f"{what}: {k}[{i}]")


def test_accumulated_averages_differ_where_stock_differs():
    """The two averages the model restates are two numbers where the steps'
    reciprocal is inexact, one where it is exact: the tests above tell
    them apart."""
    rng = np.random.default_rng(8)
    grads = make_grads(rng, [(4096,)], F32, 2.0**10)
    acc = make_accumulators(rng, [(4096,)])[0]
    for steps, differ in [(3, True), (5, True), (7, True), (2, False), (4, False), (8, False)]:
        a = accumulated(grads[0], acc, 2.0**10, "divide", steps, "divide")
        b = accumulated(grads[0], acc, 2.0**10, "divide", steps, "multiply")
        assert (not np.array_equal(bits(a), bits(b))) == differ, steps


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw", "rmsprop_momentum", "lion"])
def test_accumulated_subnormal_and_huge_values_match_keras(name, dtype):
    """Accumulators and gradients of subnormal and huge magnitudes (sums that
    overflow): the IEEE model."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"accumulate-special/{name}/{dtype}".encode()))
    shapes = SHAPES[:6]
    variables, slots = make_state(rng, cfg, shapes, special=True)
    for steps, average in [(3, "divide"), (3, "multiply"), (4, "divide")]:
        grads = make_grads(rng, shapes, GRAD_DTYPES[dtype], 3.0, special=True)
        accumulators = make_accumulators(rng, shapes, special=True)
        kw = dict(accumulation_steps=steps, accumulation=average, scale=3.0)
        want_vars, want_slots = keras_step(cfg, variables, grads, slots, lr=cfg["lr"], t=2,
                                           accumulators=accumulators, **kw)
        assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=2,
                         accumulators=accumulators, **kw) is True
        assert_zero(accumulators, f"{steps} {average}")
        for i in range(len(shapes)):
            assert_same_bits(variables[i], want_vars[i], f"{steps} {average}: variable {i}")
            for k in slots:
                assert_same_bits(slots[k][i], want_slots[k][i], f"{steps} {average}: {k}[{i}]")


def test_accumulators_unchanged_by_a_skipped_step():
    """A non-finite gradient (the step's check reads the gradients alone):
    nothing written, the accumulators included."""
    cfg = CONFIGS["adamw"]
    rng = np.random.default_rng(9)
    variables, slots = make_state(rng, cfg, SHAPES)
    accumulators = make_accumulators(rng, SHAPES)
    grads = make_grads(rng, SHAPES, GRAD_DTYPES["float16"], 2.0**10)
    grads[-1].reshape(-1)[-1] = np.inf
    before = snapshot(variables, slots, accumulators)
    assert core_step(core, cfg, variables, grads, slots, lr=cfg["lr"], t=1, scale=2.0**10,
                     accumulators=accumulators, accumulation_steps=4) is False
    assert_unchanged(before, variables, slots, accumulators)


def _accumulation_setup():
    rng = np.random.default_rng(10)
    cfg = CONFIGS["adam_amsgrad"]
    shapes = [(5,), (2, 3)]
    variables, slots = make_state(rng, cfg, shapes)
    grads = make_grads(rng, shapes, np.dtype(np.float16), 1000.0)
    return cfg, variables, grads, slots, make_accumulators(rng, shapes)


def _overlap_accumulators(accumulators):
    """The two accumulators become views of one buffer sharing one element."""
    base = np.zeros(10, F32)
    accumulators[0] = base[:5]
    accumulators[1] = base[4:].reshape(2, 3)


# (id, what to break: f(variables, grads, slots, accumulators) -> keyword
#  overrides or None, exception, pattern the message must match)
ACCUMULATE_BAD = [
    ("shape", lambda V, G, S, A: A.__setitem__(1, np.zeros(6, F32)),
     ValueError, r"accumulators\[1\] has shape \(6,\), its variable has shape \(2, 3\)"),
    ("float64", lambda V, G, S, A: A.__setitem__(0, A[0].astype(np.float64)),
     TypeError, r"accumulators\[0\] must be float32"),
    ("float16", lambda V, G, S, A: A.__setitem__(1, A[1].astype(np.float16)),
     TypeError, r"accumulators\[1\] must be float32"),
    ("read_only", lambda V, G, S, A: A.__setitem__(1, read_only(A[1])),
     ValueError, r"accumulators\[1\] is read-only"),
    ("strided", lambda V, G, S, A: A.__setitem__(0, strided(A[0])),
     ValueError, r"accumulators\[0\] is not C-contiguous"),
    ("too_few", lambda V, G, S, A: A.__delitem__(1),
     ValueError, r"1 accumulators for 2 variables"),
    ("too_many", lambda V, G, S, A: A.append(A[0].copy()),
     ValueError, r"3 accumulators for 2 variables"),
    ("not_a_list", lambda V, G, S, A: {"accumulators": A[0]},
     TypeError, r"accumulators must be a list"),
    ("not_an_array", lambda V, G, S, A: A.__setitem__(0, [0.0] * 5),
     TypeError, r"accumulators\[0\] is list"),
    ("the_variable", lambda V, G, S, A: A.__setitem__(1, V[1]), ValueError, r"share memory"),
    ("a_slot", lambda V, G, S, A: A.__setitem__(0, S["v"][0]), ValueError, r"share memory"),
    ("overlap_by_one", lambda V, G, S, A: _overlap_accumulators(A), ValueError,
     r"share memory"),
    ("no_steps", lambda V, G, S, A: {"accumulation_steps": None},
     ValueError, r"accumulators and accumulation_steps go together"),
    ("steps_alone", lambda V, G, S, A: {"accumulators": None},
     ValueError, r"accumulators and accumulation_steps go together"),
    ("steps_zero", lambda V, G, S, A: {"accumulation_steps": 0},
     ValueError, r"accumulation_steps must be an integer >= 1, got 0"),
    ("steps_negative", lambda V, G, S, A: {"accumulation_steps": -4},
     ValueError, r"accumulation_steps must be an integer >= 1"),
    ("steps_float", lambda V, G, S, A: {"accumulation_steps": 2.5},
     ValueError, r"accumulation_steps must be an integer >= 1, got 2.5"),
    ("steps_bool", lambda V, G, S, A: {"accumulation_steps": True},
     ValueError, r"accumulation_steps must be an integer"),
    ("steps_huge", lambda V, G, S, A: {"accumulation_steps": 2**31},
     ValueError, r"accumulation_steps must be an integer"),
    ("average_typo", lambda V, G, S, A: {"accumulation": "mean"},
     ValueError, r"accumulation must be one of \['divide', 'multiply'\], got 'mean'"),
    ("with_indices", lambda V, G, S, A: {"indices": [None, None]},
     ValueError, r"accumulators take dense gradients"),
]


@pytest.mark.parametrize("case", ACCUMULATE_BAD, ids=[c[0] for c in ACCUMULATE_BAD])
def test_accumulation_bad_input_raises_and_writes_nothing(case):
    cfg, variables, grads, slots, accumulators = _accumulation_setup()
    overrides = case[1](variables, grads, slots, accumulators) or {}
    kw = dict(accumulators=accumulators, accumulation_steps=4)
    kw.update(overrides)
    before = snapshot(variables, slots, accumulators)
    with pytest.raises(case[2], match=case[3]):
        core.optimizer_step_("adam", variables, grads, [slots[k] for k in slot_names(cfg)],
                             hyper=FAMILIES["adam"]["hyper"](cfg, cfg["lr"], 1),
                             learning_rate=cfg["lr"], scale=1000.0, **kw)
    assert_unchanged(before, variables, slots, accumulators)


def test_accumulation_with_terms_refused():
    """A gradient term stands for a function of the gradient the average
    would change: refused, nothing written."""
    cfg, variables, _, slots, accumulators = _accumulation_setup()
    grads = [np.ones(v.shape, F32) for v in variables]
    terms = [np.ones(v.shape, F32) for v in variables]
    before = snapshot(variables, slots, accumulators)
    with pytest.raises(ValueError, match="accumulators take dense gradients"):
        core.optimizer_step_("adam", variables, grads, [slots[k] for k in slot_names(cfg)],
                             hyper=FAMILIES["adam"]["hyper"](cfg, cfg["lr"], 1),
                             learning_rate=cfg["lr"], terms=terms, accumulators=accumulators,
                             accumulation_steps=2)
    assert_unchanged(before, variables, slots, accumulators)


# ----------------------------------------------------------- sparse gradients
# ``indices``: a variable's gradient as an IndexedSlices' slices and rows.
# Oracle: ``optim_model.sparse_keras_step``, the slices unscaled and
# clipped in numpy, densified in float32 in slice order as TensorFlow's
# conversion densifies them (checked against TensorFlow itself below), the
# family's term summed alike, then the dense Keras model.

# (shape, slices; None: a dense gradient): a variable of several of the
# core's 4096-element blocks with rows straddling their edges (37 floats a
# row), long enough for the library's threads to split it; one of a single
# row, rows of one element and of a 3 x 4 block, one with no slice at all;
# dense gradients among them.
SPARSE_LAYOUT = [((4001, 37), 5000), ((300, 37), 400), ((7,), 12), ((5, 3, 4), 9),
                 ((1, 37), 3), ((6, 5), 0), ((33,), None), ((10, 3), None)]
SPARSE_UNSCALES = [(None, "divide"), (2.0**10, "divide"), (3.0, "divide"), (1000.0, "multiply")]


@pytest.fixture
def split_threads():
    """Four threads at most: the long variable is cut between two (the
    planner's 2**16 elements a thread), mid-row."""
    assert sum(int(np.prod(s)) for s, _ in SPARSE_LAYOUT) >= 2 * 2**16
    core.set_num_threads(4)
    yield
    core.set_num_threads(0)


def sparse_grads(rng, layout, dtype, scale, *, special=False):
    """``(grads, indices)`` for ``layout``: slices and their rows where it
    names a count, else a dense gradient and None."""
    grads, indices = [], []
    for shape, count in layout:
        if count is None:
            grads.append(make_grads(rng, [shape], dtype, scale, special=special)[0])
            indices.append(None)
        else:
            indices.append(make_indices(rng, shape[0], count))
            grads.append(make_slices(rng, shape, count, dtype, scale, special=special))
    return grads, indices


def assert_sparse_cases_cover(indices, layout):
    """The cases the sparse tests rely on: repeated rows, rows no slice
    names, indices out of order."""
    repeats = gaps = disorder = False
    for index, (shape, count) in zip(indices, layout):
        if index is None or count == 0:
            continue
        named = np.unique(index)
        repeats |= named.size < index.size
        gaps |= named.size < shape[0]
        disorder |= bool(np.any(np.diff(index) < 0))
    assert repeats and gaps and disorder


def assert_states_equal(variables, slots, want_vars, want_slots, what):
    for i, (got, want) in enumerate(zip(variables, want_vars)):
        assert_same_bits(got, want, f"{what}: variable {i}")
    for k in want_slots:
        for i, (got, want) in enumerate(zip(slots[k], want_slots[k])):
            assert_same_bits(got, want, f"{what}: {k}[{i}]")


def run_sparse_steps(cfg, layout, dtype, scale, mode, *, form, seed, special=False,
                     steps=STEPS):
    """``steps`` steps through the core and the model, each compared."""
    rng = np.random.default_rng(seed)
    run_cfg, lr, factor = sparse_forms(cfg, cfg["lr"])[form]
    variables, slots = make_state(rng, run_cfg, [s for s, _ in layout], special=special)
    want_vars, want_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step in range(1, steps + 1):
        grads, indices = sparse_grads(rng, layout, dtype, scale, special=special)
        assert_sparse_cases_cover(indices, layout)
        kwargs = dict(lr=lr, t=step, scale=scale, mode=mode, indices=indices,
                      slice_factor=factor)
        want_vars, want_slots = sparse_keras_step(run_cfg, want_vars, grads, want_slots,
                                                  **kwargs)
        assert core_step(core, run_cfg, variables, grads, slots, **kwargs) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")


@pytest.mark.parametrize("scale,mode", SPARSE_UNSCALES,
                         ids=[f"{m}-{s}" if s else "none" for s, m in SPARSE_UNSCALES])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(SPARSE_CONFIGS))
def test_sparse_steps_match_keras_bit_for_bit(split_threads, name, dtype, scale, mode):
    """Keras' form of each family (SGD's slices times the learning rate,
    Lion's times 1 - beta_1), weight decay on, dense gradients alongside."""
    run_sparse_steps(SPARSE_CONFIGS[name], SPARSE_LAYOUT, GRAD_DTYPES[dtype], scale, mode,
                     form="keras", seed=zlib.crc32(f"sparse/{name}/{dtype}/{scale}".encode()))


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(SPARSE_CONFIGS))
def test_sparse_slice_factor_matches_keras(split_threads, name, dtype):
    """A slice factor other than 1 (and other than Keras' own) with the
    family's usual numbers."""
    run_sparse_steps(SPARSE_CONFIGS[name], SPARSE_LAYOUT, GRAD_DTYPES[dtype], 2.0**10,
                     "divide", form="odd",
                     seed=zlib.crc32(f"sparse-factor/{name}/{dtype}".encode()))


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(SPARSE_CLIP_CONFIGS))
def test_sparse_clips_match_keras(split_threads, name, dtype):
    """clipvalue and clipnorm clip each slice value (TensorFlow's clips keep
    a gradient sparse); the global clip multiplies the row sums, and a term
    family squares (or takes the magnitude of) the clipped sums."""
    cfg = SPARSE_CLIP_CONFIGS[name]
    form = "global" if cfg["clip"][0] == "global" else "keras"
    run_sparse_steps(cfg, SPARSE_LAYOUT, GRAD_DTYPES[dtype], 2.0**10, "divide", form=form,
                     seed=zlib.crc32(f"sparse-clip/{name}/{dtype}".encode()))


@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ["sgd_nesterov", "adam_amsgrad", "adamax", "lion"])
def test_sparse_subnormal_and_huge_values_match_keras(name, dtype):
    """Slices of subnormal and huge values (rows whose sums overflow among
    them: the slices are what is checked, not their sums), IEEE mode."""
    run_sparse_steps(SPARSE_CONFIGS[name], SPARSE_LAYOUT[1:], GRAD_DTYPES[dtype], 3.0,
                     "divide", form="keras", special=True, steps=2,
                     seed=zlib.crc32(f"sparse-special/{name}/{dtype}".encode()))


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamax_decay_odd", "lion"])
def test_dense_and_sparse_gradients_of_every_dtype_in_one_call(name):
    """Each variable's gradient of its own dtype, dense or sparse."""
    cfg = SPARSE_CONFIGS[name]
    layout = [((40, 9), 50), ((40, 9), None), ((30,), 31), ((30,), None), ((8, 2, 3), 11),
              ((8, 2, 3), None)]
    dtypes = [F32, np.dtype(np.float16), BF16, F32, np.dtype(np.float16), BF16]
    rng = np.random.default_rng(zlib.crc32(f"sparse-mixed/{name}".encode()))
    run_cfg, lr, factor = sparse_forms(cfg, cfg["lr"])["keras"]
    variables, slots = make_state(rng, run_cfg, [s for s, _ in layout])
    for step in (1, 2):
        grads, indices = [], []
        for (shape, count), dtype in zip(layout, dtypes):
            g, index = sparse_grads(rng, [(shape, count)], dtype, 2.0**12)
            grads += g
            indices += index
        kwargs = dict(lr=lr, t=step, scale=2.0**12, mode="divide", indices=indices,
                      slice_factor=factor)
        want_vars, want_slots = sparse_keras_step(run_cfg, variables, grads, slots, **kwargs)
        assert core_step(core, run_cfg, variables, grads, slots, **kwargs) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")


def test_densify_is_tensorflows_indexed_slices_conversion():
    """The model's densify against TensorFlow's own conversion of an
    IndexedSlices (UnsortedSegmentSum), bit for bit: repeated rows in slice
    order, -0 slices (0 + -0 is +0), rows no slice names, sums that
    overflow; normal values (TensorFlow's CPU flushes subnormals)."""
    import tensorflow as tf

    rng = np.random.default_rng(17)
    for shape, count in [((300, 37), 900), ((7,), 40), ((5, 3, 4), 20), ((4, 6), 0)]:
        index = make_indices(rng, shape[0], count)
        values = (rng.standard_normal((count,) + shape[1:]) * 10.0**rng.integers(
            -3, 4, (count,) + shape[1:])).astype(F32)
        flat = values.reshape(-1)
        if flat.size:
            flat[rng.integers(0, flat.size, flat.size // 10)] = -0.0
            flat[rng.integers(0, flat.size, flat.size // 50)] = np.float32(3e38)
        want = tf.convert_to_tensor(tf.IndexedSlices(
            tf.constant(values), tf.constant(index), tf.constant(shape, tf.int64))).numpy()
        assert_same_bits(densify(values, index, shape[0]), want, f"{shape}")


def test_negative_zero_slices_sum_to_positive_zero():
    """A row whose slices are all -0 gets +0 (0 + -0), as TensorFlow's sum
    makes it: seen on variables of -0, where w - (+0 * lr) keeps -0 and
    w - (-0 * lr) would make +0.  Rows with no slice keep -0 too."""
    import tensorflow as tf

    cfg = CONFIGS["sgd"]
    variables = [np.full((6, 3), -0.0, F32)]
    index = np.array([4, 1, 4, 2], np.int64)
    slices = np.full((4, 3), -0.0, F32)
    dense = tf.convert_to_tensor(tf.IndexedSlices(tf.constant(slices), tf.constant(index),
                                                  tf.constant([6, 3], tf.int64))).numpy()
    assert_same_bits(dense, np.zeros((6, 3), F32), "TensorFlow's sum")
    want_vars, _ = sparse_keras_step(cfg, variables, [slices], {}, indices=[index], lr=0.5, t=1)
    assert_same_bits(want_vars[0], variables[0], "model")
    assert core_step(core, cfg, variables, [slices], {}, lr=0.5, t=1, indices=[index]) is True
    assert_same_bits(variables[0], want_vars[0], "core")


@pytest.mark.parametrize("name", ["sgd_nesterov", "adam_amsgrad", "adamax", "lion_decay_odd"])
def test_sparse_averages_move_after_the_update(split_threads, name):
    """``averages`` on variables with sparse gradients (the long one over
    many blocks, each block's sums gathered then its average moved): the
    update the model makes, then ``m * average + (1 - m) * var``."""
    cfg = SPARSE_CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"sparse-ema/{name}".encode()))
    run_cfg, lr, factor = sparse_forms(cfg, cfg["lr"])["keras"]
    variables, slots = make_state(rng, run_cfg, [s for s, _ in SPARSE_LAYOUT])
    averages = [rng.standard_normal(v.shape).astype(F32) for v in variables]
    for step, momentum in enumerate([0.0, 0.999, 0.9], start=1):
        grads, indices = sparse_grads(rng, SPARSE_LAYOUT, GRAD_DTYPES["bfloat16"], 2.0**10)
        want_vars, want_slots = sparse_keras_step(run_cfg, variables, grads, slots, lr=lr,
                                                  t=step, scale=2.0**10, indices=indices,
                                                  slice_factor=factor)
        m = F32(momentum)
        want_avg = [m * a + (F32(1) - m) * v for a, v in zip(averages, want_vars)]
        assert core.optimizer_step_(
            run_cfg["opt"], variables, grads, [slots[k] for k in slot_names(run_cfg)],
            hyper=FAMILIES[run_cfg["opt"]]["hyper"](run_cfg, lr, step),
            learning_rate=float(lr), weight_decay=run_cfg.get("weight_decay"),
            decay=decay_mask(run_cfg, len(variables)), scale=2.0**10, indices=indices,
            slice_factor=factor, averages=averages, ema_momentum=momentum) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")
        for i, (got, want) in enumerate(zip(averages, want_avg)):
            assert_same_bits(got, want, f"step {step}: average {i}")


# (variable, slice, element of the slice): the first slice, one of the row
# every eighth slice names, the last element of the last slice, the long
# variable's middle.
SPARSE_BAD_POSITIONS = [(1, 0, 0), (1, "repeated", 5), (1, -1, -1), (0, 2500, 20)]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", ["sgd_momentum", "adam_amsgrad", "adamax", "lion"])
def test_non_finite_slice_writes_nothing(split_threads, name, dtype, bad):
    cfg = SPARSE_CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"sparse-bad/{name}/{dtype}".encode()))
    run_cfg, lr, factor = sparse_forms(cfg, cfg["lr"])["keras"]
    variables, slots = make_state(rng, run_cfg, [s for s, _ in SPARSE_LAYOUT])
    grads, indices = sparse_grads(rng, SPARSE_LAYOUT, GRAD_DTYPES[dtype], 2.0**10)
    kwargs = dict(lr=lr, t=3, scale=2.0**10, indices=indices, slice_factor=factor)
    for tensor, k, element in SPARSE_BAD_POSITIONS:
        if k == "repeated":  # a slice of the row named most, its last one
            rows, counts = np.unique(indices[tensor], return_counts=True)
            k = int(np.flatnonzero(indices[tensor] == rows[np.argmax(counts)])[-1])
        g = grads[tensor][k].reshape(-1)
        keep = g[element].copy()
        g[element] = bad
        before = snapshot(variables, grads, slots, given(indices))
        assert core_step(core, run_cfg, variables, grads, slots, **kwargs) is False, (tensor, k)
        assert_unchanged(before, variables, grads, slots, given(indices))
        g[element] = keep
    # One in a sparse gradient, one in a dense one.
    grads[3].reshape(-1)[-1] = bad
    grads[6].reshape(-1)[0] = -bad
    before = snapshot(variables, grads, slots, given(indices))
    assert core_step(core, run_cfg, variables, grads, slots, **kwargs) is False
    assert_unchanged(before, variables, grads, slots, given(indices))


def given(arrays):
    """The entries of a list that are not None."""
    return [a for a in arrays if a is not None]


# ------------------------------------------------- sparse: every SIMD level

SPARSE_WORKER = textwrap.dedent(r'''
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from lossscale import core
    from optim_model import core_step, flat_bits, sparse_simd_runs

    res = {"level": np.array(core.simd_level())}
    for key, cfg, flush, variables, slots, steps in sparse_simd_runs():
        for t, grads, kwargs in steps:
            assert core_step(core, cfg, variables, grads, slots, t=t,
                             flush_denormals=flush, **kwargs) is True, key
        res[key] = flat_bits(variables, slots)
    np.savez(sys.argv[1], **res)
''')


@pytest.fixture(scope="module")
def sparse_level_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("optim_sparse_simd")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return {level: run_level_child(level, d / f"{level}.npz", ("-c", SPARSE_WORKER),
                                   (tests_dir,))
            for level in levels_here()}


@pytest.mark.parametrize("level", optimizer_sets())
def test_sparse_level_matches_scalar(sparse_level_results, level):
    """The row sums (each level's slice_add) and the kernel each level runs
    on them give the scalar level's bits, flushing or not."""
    assert_level_matches_scalar(sparse_level_results, level)


def test_sparse_scalar_level_matches_keras_model(sparse_level_results):
    """The scalar run's IEEE results, recomputed here with the numpy model."""
    ref = sparse_level_results["scalar"]
    checked = 0
    for key, cfg, flush, variables, slots, steps in sparse_simd_runs():
        if flush:
            continue
        for t, grads, kwargs in steps:
            if key.split("/")[0] in SPARSE_ROW_CONFIGS:
                assert kwargs.pop("slice_factor") is None
                variables, slots = rows_step(cfg, variables, grads, slots, t=t, **kwargs)
            elif summed(cfg):
                variables, slots = legacy_rows_step(cfg, variables, grads, slots, t=t,
                                                    **kwargs)
            else:
                variables, slots = sparse_keras_step(cfg, variables, grads, slots, t=t,
                                                     **kwargs)
        want = flat_bits(variables, slots)
        if not np.array_equal(ref[key], want):
            i = int(np.flatnonzero(ref[key] != want)[0])
            raise AssertionError(f"{key} at {i}: scalar {ref[key][i]:#010x}, "
                                 f"Keras model {want[i]:#010x}")
        checked += 1
    assert checked == (len(ref) - 1) // 2


# ------------------------------------------------------ sparse: bad input


def sparse_setup(name="adam_amsgrad"):
    """A sparse gradient of a (6, 4) variable (5 slices, float16) and a dense
    one of a (5,) variable, with the family's state."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(31)
    variables, slots = make_state(rng, cfg, [(6, 4), (5,)])
    grads = [make_slices(rng, (6, 4), 5, np.dtype(np.float16), 1000.0),
             make_grads(rng, [(5,)], np.dtype(np.float16), 1000.0)[0]]
    indices = [np.array([3, 0, 3, 5, 1], np.int64), None]
    return cfg, variables, grads, slots, indices


def call_sparse(cfg, variables, grads, slots, index_list, **overrides):
    kw = dict(hyper=FAMILIES[cfg["opt"]]["hyper"](cfg, cfg["lr"], 1),
              learning_rate=cfg["lr"], scale=1000.0, indices=index_list)
    kw.update(overrides)
    return core.optimizer_step_(cfg["opt"], variables, grads,
                                [slots[k] for k in slot_names(cfg)], **kw)


def _set(lst, i, value):
    lst[i] = value


# (id, what to break: f(grads, indices) -> keyword overrides or None,
#  exception, pattern the message must match)
SPARSE_BAD_CASES = [
    ("index_is_rows", lambda G, I: _set(I[0], 3, 6), ValueError,
     r"indices\[0\] has an index outside \[0, 6\)"),
    ("index_negative", lambda G, I: _set(I[0], 0, -1), ValueError,
     r"indices\[0\] has an index outside \[0, 6\)"),
    ("index_huge", lambda G, I: _set(I[0], 4, 2**62), ValueError, r"indices\[0\].*outside"),
    ("indices_int32", lambda G, I: _set(I, 0, I[0].astype(np.int32)), TypeError,
     r"indices\[0\] must be a 1-D C-contiguous int64 array"),
    ("indices_uint64", lambda G, I: _set(I, 0, I[0].astype(np.uint64)), TypeError,
     r"indices\[0\].*int64"),
    ("indices_2d", lambda G, I: _set(I, 0, I[0].reshape(5, 1)), TypeError,
     r"indices\[0\].*1-D"),
    ("indices_strided", lambda G, I: _set(I, 0, np.repeat(I[0], 2)[::2]), TypeError,
     r"indices\[0\].*C-contiguous"),
    ("indices_byteswapped", lambda G, I: _set(I, 0, I[0].astype(">i8")), TypeError,
     r"indices\[0\].*int64"),
    ("indices_entry_a_list", lambda G, I: _set(I, 0, [3, 0, 3, 5, 1]), TypeError,
     r"indices\[0\] is list"),
    ("slices_row_shape", lambda G, I: _set(G, 0, np.zeros((5, 3), np.float16)), ValueError,
     r"grads\[0\] has shape \(5, 3\).*\(5, 4\)"),
    ("more_slices_than_indices", lambda G, I: _set(G, 0, np.zeros((6, 4), np.float16)),
     ValueError, r"grads\[0\] has shape \(6, 4\).*5 indices"),
    ("fewer_slices_than_indices", lambda G, I: _set(G, 0, G[0][:4].copy()), ValueError,
     r"grads\[0\] has shape \(4, 4\).*5 indices"),
    ("slices_flattened", lambda G, I: _set(G, 0, G[0].reshape(-1).copy()), ValueError,
     r"grads\[0\] has shape \(20,\)"),
    ("dense_gradient_given_indices", lambda G, I: _set(I, 1, np.arange(4, dtype=np.int64)),
     ValueError, r"grads\[1\] has shape \(5,\).*4 indices.*have shape \(4,\)"),
    ("too_few_indices", lambda G, I: I.pop(), ValueError, r"got 1 indices for 2 variables"),
    ("too_many_indices", lambda G, I: I.append(None), ValueError,
     r"got 3 indices for 2 variables"),
    ("indices_an_array", lambda G, I: {"indices": np.zeros((2, 5), np.int64)}, TypeError,
     r"indices must be a list"),
    ("terms_with_indices", lambda G, I: {"scale": None, "terms": [np.ones((6, 4), F32),
                                                                  np.ones(5, F32)]},
     ValueError, r"terms must be None"),
    ("slice_factor_nan", lambda G, I: {"slice_factor": float("nan")}, ValueError,
     r"slice_factor.*finite"),
    ("slice_factor_inf", lambda G, I: {"slice_factor": float("-inf")}, ValueError,
     r"slice_factor.*finite"),
    ("slice_factor_overflows_float32", lambda G, I: {"slice_factor": 1e39}, ValueError,
     r"slice_factor"),
    ("slice_factor_string", lambda G, I: {"slice_factor": "0.5"}, TypeError, r"slice_factor"),
    ("slice_factor_under_global_clip",
     lambda G, I: {"clip": "global", "clip_scalars": 0.5, "slice_factor": 0.5}, ValueError,
     r"global clip.*slice factor must be 1"),
]


@pytest.mark.parametrize("case", SPARSE_BAD_CASES, ids=[c[0] for c in SPARSE_BAD_CASES])
def test_sparse_bad_input_raises_and_writes_nothing(case):
    cfg, variables, grads, slots, indices = sparse_setup()
    overrides = case[1](grads, indices) or {}
    before = snapshot(variables, slots, grads, given(indices))
    with pytest.raises(case[2], match=r"optimizer_step_: .*" + case[3]):
        call_sparse(cfg, variables, grads, slots, indices, **overrides)
    assert_unchanged(before, variables, slots, grads, given(indices))


@pytest.mark.parametrize("name", ["nadam"])
def test_sparse_gradient_refused_by_a_family_that_takes_none(name):
    """Families whose update reads more than its element take no slices;
    even all-dense ``indices``."""
    assert CONFIGS[name]["opt"] not in core.optimizer_families(sparse=True)
    assert set(core.optimizer_families(sparse=True)) == {
        "sgd", "adam", "adamax", "lion", "adagrad", "rmsprop", "accumulate", "legacy_sgd",
        "legacy_adam", "legacy_rmsprop", "legacy_adagrad", "tf_keras_adam", "tf_keras_sgd",
        "tf_keras_rmsprop"}
    cfg, variables, grads, slots, indices = sparse_setup(name)
    before = snapshot(variables, slots, grads, given(indices))
    for given_indices in (indices, [None, None]):
        with pytest.raises(ValueError, match=f"{cfg['opt']} takes no sparse gradient"):
            call_sparse(cfg, variables, grads, slots, given_indices)
    assert_unchanged(before, variables, slots, grads, given(indices))


def test_sparse_bad_input_with_a_non_finite_slice_still_raises():
    """Validation comes before the finite check: a bad call never returns False."""
    cfg, variables, grads, slots, indices = sparse_setup()
    grads[0][2, 1] = np.nan
    indices[0][1] = 6
    before = snapshot(variables, slots, grads, given(indices))
    with pytest.raises(ValueError, match="outside"):
        call_sparse(cfg, variables, grads, slots, indices)
    assert_unchanged(before, variables, slots, grads, given(indices))


def test_sparse_gradient_of_a_scalar_variable_is_refused():
    cfg = CONFIGS["sgd_momentum"]
    variables, slots = [np.ones((), F32)], {"momentum": [np.zeros((), F32)]}
    before = snapshot(variables, slots)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape"):
        call_sparse(cfg, variables, [np.ones((1,), F32)], slots,
                    [np.zeros(1, np.int64)], scale=None)
    assert_unchanged(before, variables, slots)


# ------------------------------------------------- sparse: Adagrad's rows


@pytest.mark.parametrize("scale,mode", SPARSE_UNSCALES,
                         ids=[f"{m}-{s}" if s else "none" for s, m in SPARSE_UNSCALES])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(SPARSE_ROW_CONFIGS))
def test_row_families_scatter_sparse_gradients_as_keras(split_threads, name, dtype, scale,
                                                        mode):
    """Adagrad's slices scattered as Keras scatters them (squares onto the
    accumulator one by one, then each slice's step with the accumulator's
    new rows), RMSprop's as Keras takes them (every velocity decayed, the
    named rows' densified squares added, then each slice's step with the
    velocity's new rows), weight decay on every row, clips per slice, dense
    gradients alongside; several blocks and threads, rows cut between
    them."""
    cfg = SPARSE_ROW_CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"sparse-rows/{name}/{dtype}/{scale}".encode()))
    variables, slots = make_state(rng, cfg, [s for s, _ in SPARSE_LAYOUT])
    want_vars, want_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step in range(1, STEPS + 1):
        grads, indices = sparse_grads(rng, SPARSE_LAYOUT, GRAD_DTYPES[dtype], 2.0**10)
        assert_sparse_cases_cover(indices, SPARSE_LAYOUT)
        lr = lr_at(cfg, step)
        want_vars, want_slots = rows_step(cfg, want_vars, grads, want_slots,
                                          indices=indices, lr=lr, t=step, scale=scale,
                                          mode=mode)
        assert core_step(core, cfg, variables, grads, slots, lr=lr, t=step, scale=scale,
                         mode=mode, indices=indices) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")


# ------------------------------------------ sparse: accumulate's rows
# Keras' accumulating step adds a sparse gradient densified (the slices
# unscaled, a row's added in their order onto 0) to the accumulator; the
# core adds each named row's sum to that row and reads no other.

ACCUMULATE = SPARSE_ACCUMULATE_CONFIGS["accumulate"]


@pytest.mark.parametrize("scale,mode", SPARSE_UNSCALES,
                         ids=[f"{m}-{s}" if s else "none" for s, m in SPARSE_UNSCALES])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_accumulate_adds_sparse_gradients_as_keras(split_threads, dtype, scale, mode):
    """Accumulators holding what Keras' adds make (any finite value but -0)
    take sparse gradients as Keras adds them, densified, over several
    steps, dense gradients alongside; several blocks and threads, rows cut
    between them."""
    rng = np.random.default_rng(zlib.crc32(f"sparse-accumulate/{dtype}/{scale}".encode()))
    accumulators, _ = make_state(rng, ACCUMULATE, [s for s, _ in SPARSE_LAYOUT])
    assert not any(np.signbit(a[a == 0]).any() for a in accumulators)
    want = snapshot(accumulators)
    for step in range(1, STEPS + 1):
        grads, indices = sparse_grads(rng, SPARSE_LAYOUT, GRAD_DTYPES[dtype], scale)
        assert_sparse_cases_cover(indices, SPARSE_LAYOUT)
        want, _ = sparse_keras_step(ACCUMULATE, want, grads, {}, indices=indices, lr=F32(0),
                                    t=step, scale=scale, mode=mode)
        assert core_step(core, ACCUMULATE, accumulators, grads, {}, lr=F32(0), t=step,
                         scale=scale, mode=mode, indices=indices) is True
        assert_states_equal(accumulators, {}, want, {}, f"step {step}")


@pytest.mark.parametrize("flush", [False, True])
def test_accumulate_reads_no_row_a_slice_does_not_name(flush):
    """The rows no slice names keep their bits, even a -0 or (flushing) a
    subnormal, which Keras' add of +0 would make +0 and no accumulator of
    Keras' holds; the named rows are the densified sum added."""
    rng = np.random.default_rng(7)
    acc = rng.standard_normal((6, 5)).astype(F32)
    acc[1] = -0.0
    acc[4] = np.float32(np.finfo(F32).tiny) / 8
    index = np.array([3, 0, 3, 2], np.int64)
    slices = rng.standard_normal((4, 5)).astype(F32)
    want = acc.copy()
    sums = densify(slices, index, 6)
    for row in np.unique(index):
        want[row] = acc[row] + sums[row]
    got = [acc.copy()]
    assert core.optimizer_step_("accumulate", got, [slices], [], hyper=[], learning_rate=0.0,
                                scale=None, indices=[index], flush_denormals=flush) is True
    assert_same_bits(got[0], want, "accumulator")
    assert np.signbit(got[0][1]).all() and (got[0][4] != 0).all()


ACCUMULATE_BAD_CASES = [
    ("clipvalue", dict(clip="value", clip_value=0.5), r"unclipped"),
    ("clipnorm", dict(clip="norm", clip_value=0.5, clip_scalars=[1.0, 1.0]), r"unclipped"),
    ("slice_factor", dict(slice_factor=0.5), r"slice factor of 1"),
    ("weight_decay", dict(weight_decay=0.1, decay=[1, 0]), r"no weight decay"),
    ("average", dict(averages=[np.zeros((6, 4), F32), np.zeros((5,), F32)], ema_momentum=0.9),
     r"no average"),
]


@pytest.mark.parametrize("case", ACCUMULATE_BAD_CASES, ids=[c[0] for c in ACCUMULATE_BAD_CASES])
def test_accumulate_refuses_what_keras_accumulating_step_never_does(case):
    """A clip, a slice factor, weight decay or an average with a sparse
    gradient: Keras' accumulating step sets none of them, and the rows it
    leaves unread would need them; refused, nothing written."""
    _, _, grads, _, indices = sparse_setup()
    accumulators = [np.ones((6, 4), F32), np.ones((5,), F32)]
    before = snapshot(accumulators, grads, given(indices))
    with pytest.raises(ValueError, match=case[2]):
        core.optimizer_step_("accumulate", accumulators, grads, [], hyper=[],
                             learning_rate=0.0, scale=1000.0, indices=indices, **case[1])
    assert_unchanged(before, accumulators, grads, given(indices))


# ------------------------------------------ sparse: the legacy families

# Sparse gradients alone: a legacy sparse gradient's numbers are its own.
LEGACY_SPARSE_LAYOUT = [((4001, 37), 5000), ((300, 37), 400), ((7,), 12), ((5, 3, 4), 9),
                        ((1, 37), 3), ((6, 5), 0), ((40, 16), 30)]


@pytest.mark.parametrize("scale,mode", SPARSE_UNSCALES,
                         ids=[f"{m}-{s}" if s else "none" for s, m in SPARSE_UNSCALES])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("name", list(SPARSE_LEGACY_CONFIGS))
def test_legacy_families_take_sparse_gradients_as_tf_keras(split_threads, name, dtype, scale,
                                                           mode):
    """tf_keras' legacy step of a sparse gradient: a row's slices (each
    unscaled and clipped) summed in their order, then TensorFlow's sparse
    kernel on the rows named or tf_keras' own ops on every row; several
    blocks and threads, rows cut between them."""
    cfg = SPARSE_LEGACY_CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"sparse-legacy/{name}/{dtype}/{scale}".encode()))
    variables, slots = make_state(rng, cfg, [s for s, _ in LEGACY_SPARSE_LAYOUT])
    want_vars, want_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step in range(1, STEPS + 1):
        grads, indices = sparse_grads(rng, LEGACY_SPARSE_LAYOUT, GRAD_DTYPES[dtype], 2.0**10)
        assert_sparse_cases_cover(indices, LEGACY_SPARSE_LAYOUT)
        lr = lr_at(cfg, step)
        hyper = legacy_sparse_hyper(cfg, lr, step)
        want_vars, want_slots = legacy_rows_step(cfg, want_vars, grads, want_slots,
                                                 indices=indices, lr=lr, t=step, hyper=hyper,
                                                 scale=scale, mode=mode)
        assert core_step(core, cfg, variables, grads, slots, lr=lr, t=step, scale=scale,
                         mode=mode, indices=indices, hyper=hyper) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")


def test_adagrad_rows_differ_from_the_densified_update():
    """The oracle tells the two forms apart: a row named twice gets two
    steps (each slice's), not one step of their sum."""
    cfg = SPARSE_ROW_CONFIGS["adagrad"]
    rng = np.random.default_rng(5)
    variables, slots = make_state(rng, cfg, [(4, 3)])
    slices = np.full((2, 3), 0.5, np.float32)
    index = np.array([1, 1], np.int64)
    rows, _ = rows_step(cfg, variables, [slices], slots, indices=[index], lr=0.5, t=1)
    dense, _ = keras_step(cfg, variables, [densify(slices, index, 4)], slots, lr=0.5, t=1)
    assert rows[0][1].tobytes() != dense[0][1].tobytes()
    assert core_step(core, cfg, variables, [slices], slots, lr=0.5, t=1,
                     indices=[index]) is True
    assert variables[0].tobytes() == rows[0].tobytes()


@pytest.mark.parametrize("case", ["rsqrt", "global", "factor"])
def test_adagrad_sparse_forms_it_cannot_take_are_refused(case):
    """Adagrad's slices divide by a true square root, are clipped slice by
    slice and take no factor: TensorFlow's Rsqrt form, the global clip (its
    row sums) and a slice factor are refused, and nothing moves."""
    cfg = CONFIGS["adagrad"]
    rng = np.random.default_rng(9)
    variables, slots = make_state(rng, cfg, [(6, 4)])
    grads = [make_slices(rng, (6, 4), 5, np.dtype(np.float16), 1000.0)]
    index = [np.array([3, 0, 3, 5, 1], np.int64)]
    before = snapshot(variables, slots, grads, index)
    kw = dict(hyper=[cfg["epsilon"], 0.0], learning_rate=cfg["lr"], scale=1000.0,
              indices=index)
    if case == "rsqrt":
        kw["hyper"] = [cfg["epsilon"], 1.0]
    elif case == "global":
        kw.update(clip="global", clip_scalars=0.5)
    else:
        kw["slice_factor"] = 0.5
    with pytest.raises(ValueError):
        core.optimizer_step_("adagrad", variables, grads, [slots["accumulator"]], **kw)
    assert_unchanged(before, variables, slots, grads, index)


@pytest.mark.parametrize("case", ["momentum", "centered", "rsqrt", "global", "factor"])
def test_rmsprop_sparse_forms_it_cannot_take_are_refused(case):
    """RMSprop's slices take Keras' scatter without momentum, not centered,
    divided by a true square root, clipped slice by slice, with no factor:
    every other form is refused, with even all-dense ``indices``, and
    nothing moves."""
    cfg = dict(CONFIGS["rmsprop_momentum" if case == "momentum" else "rmsprop"])
    if case == "centered":
        cfg["centered"] = True
    if case == "rsqrt":
        cfg["graph"] = True
    rng = np.random.default_rng(10)
    variables, slots = make_state(rng, cfg, [(6, 4)])
    grads = [make_slices(rng, (6, 4), 5, np.dtype(np.float16), 1000.0)]
    index = [np.array([3, 0, 3, 5, 1], np.int64)]
    before = snapshot(variables, slots, grads, index)
    kw = dict(hyper=FAMILIES["rmsprop"]["hyper"](cfg, cfg["lr"], 1), learning_rate=cfg["lr"],
              scale=1000.0)
    if case == "global":
        kw.update(clip="global", clip_scalars=0.5)
    elif case == "factor":
        kw["slice_factor"] = 0.5
    for given_indices in (index, [None]):
        with pytest.raises(ValueError, match="rmsprop takes a sparse gradient as Keras "
                                             "scatters it"):
            core.optimizer_step_("rmsprop", variables, grads,
                                 [slots[k] for k in slot_names(cfg)], indices=given_indices,
                                 **kw)
    assert_unchanged(before, variables, slots, grads, index)


# ------------------------------------------- weight decay by a whole factor

# (configuration, sparse): CONFIGS' for dense gradients, SPARSE_CONFIGS' for sparse.
FACTOR_CASES = [(name, False) for name in
                ["adamw", "sgd_momentum_decay", "rmsprop_centered_momentum_decay",
                 "adagrad_decay_odd", "adamax_decay_odd", "nadam_decay_odd", "lion_decay_odd"]]
FACTOR_CASES += [(name, True) for name in
                 ["sgd_momentum", "adam_amsgrad", "adamax_decay_odd", "lion_decay_odd"]]
# The factor a graph makes of a schedule's `var * wd * lr` (an inexact one).
DECAY_FACTOR = F32(0.0137) * F32(0.93)


def decayed_by_factor(variables, mask):
    return [(w - w * DECAY_FACTOR).astype(np.float32) if m else w
            for w, m in zip(variables, mask)]


@pytest.mark.parametrize("name,sparse", FACTOR_CASES,
                         ids=[f"{n}-{'sparse' if s else 'dense'}" for n, s in FACTOR_CASES])
def test_decay_by_a_whole_factor_is_that_decay_then_the_step(split_threads, name, sparse):
    """ls_decay 3 (the one factor the graph optimizer makes of a schedule's
    decay chain, given as the weight decay): the variables decay as numpy's
    float32 `w - w * factor`, every row of a sparse one, then the family
    steps as Keras' model without decay; the masked-out ones do not decay."""
    cfg = (SPARSE_CONFIGS if sparse else CONFIGS)[name]
    plain = {k: v for k, v in cfg.items() if k not in ("weight_decay", "mask")}
    factored = dict(plain, weight_decay=float(DECAY_FACTOR))
    rng = np.random.default_rng(zlib.crc32(f"factor/{name}/{sparse}".encode()))
    if sparse:
        run_cfg, lr, slice_factor = keras_sparse_form(plain, plain["lr"])
        factored = dict(run_cfg, weight_decay=float(DECAY_FACTOR))
        shapes = [s for s, _ in SPARSE_LAYOUT]
    else:
        run_cfg, lr, slice_factor, shapes = plain, plain["lr"], None, SHAPES
    mask = decay_mask(dict(cfg, mask=True), len(shapes))
    variables, slots = make_state(rng, run_cfg, shapes)
    want_vars, want_slots = snapshot(variables), {k: snapshot(v) for k, v in slots.items()}
    for step in range(1, STEPS + 1):
        if sparse:
            grads, indices = sparse_grads(rng, SPARSE_LAYOUT, GRAD_DTYPES["float16"], 1000.0)
            kw = dict(lr=lr, t=step, scale=1000.0, mode="divide", indices=indices,
                      slice_factor=slice_factor)
            want_vars, want_slots = sparse_keras_step(
                run_cfg, decayed_by_factor(want_vars, mask), grads, want_slots, **kw)
        else:
            grads = make_grads(rng, shapes, GRAD_DTYPES["float16"], 1000.0)
            kw = dict(lr=lr_at(plain, step), t=step, scale=1000.0, mode="divide")
            want_vars, want_slots = keras_step(run_cfg, decayed_by_factor(want_vars, mask),
                                               grads, want_slots, **kw)
        assert core_step(core, factored, variables, grads, slots,
                         decay=[3 if m else 0 for m in mask], **kw) is True
        assert_states_equal(variables, slots, want_vars, want_slots, f"step {step}")


def test_decay_forms_past_the_factor_are_refused():
    variables, grads, slots = adam_setup()
    before = snapshot(variables, slots)
    with pytest.raises(ValueError, match=r"decay\[0\]"):
        call_adam(variables, grads, slots, weight_decay=0.01, decay=[4, 0])
    assert_unchanged(before, variables, slots)
