"""The fuzz target's inputs replayed through the numpy bindings.

Every file in ``fuzz/regressions/core/`` (inputs that once exposed a bug)
and in ``fuzz/corpus/core/`` is decoded as ``fuzz/fuzz_core.c`` decodes it
and run through ``lossscale.core``, so ``make test`` covers them without
clang.
What the bindings cannot express is left out: they work in place only (an
out-of-place buffer runs in place, with the same arithmetic), reject empty
arrays (dropped), and have no faults other than a bad scale; the C replay
in ``make sanitize`` and ``make fuzz`` covers the rest.  Oracles: numpy /
ml_dtypes for IEEE results (a NaN only has to meet a NaN), and for every
input, flushing included, the scalar kernel set run in a child process,
bit for bit.
"""

import glob
import math
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from lossscale import core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUTS = sorted(glob.glob(os.path.join(ROOT, "fuzz", "regressions", "core", "*")) +
                glob.glob(os.path.join(ROOT, "fuzz", "corpus", "core", "*")))

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
FLUSH, CHECK_INPUTS, BIG = 1, 2, 8
MAX_BUFS, MAX_CUTS, MAX_LENGTH, BIG_UNIT = 4, 7, 4095, 65536
FAULT_NAN_SCALE, FAULT_INF_SCALE = 5, 6


def decode(data):
    """The case an input describes (see the layout in fuzz/fuzz_core.c)."""
    pos = 0

    def byte():
        nonlocal pos
        b = data[pos] if pos < len(data) else 0
        pos += 1
        return b

    mode = byte()
    (scale,) = struct.unpack("<d", bytes(byte() for _ in range(8)))
    count = 1 + byte() % MAX_BUFS
    ncuts = byte() % (MAX_CUTS + 1)
    fault = byte() % 16
    buffers = []
    for i in range(count):
        b0 = byte()
        soff, _doff = byte() % 64, byte() % 64
        lo, hi = byte(), byte()
        length = (lo | hi << 8) % (MAX_LENGTH + 1)
        if mode & BIG and i == 0:
            length = BIG_UNIT * (1 + length % 4) + length // 4
        buffers.append((b0 & 3, soff, length))
    for _ in range(ncuts):
        byte()
    content = data[pos:] if pos < len(data) else b""
    if fault == FAULT_NAN_SCALE:
        scale = math.nan
    elif fault == FAULT_INF_SCALE:
        scale = -math.inf if scale < 0 else math.inf
    return dict(flags=mode & 3, threads=mode >> 4, scale=scale, buffers=buffers,
                content=content)


def arrays_of(case):
    """The case's non-empty buffers as numpy arrays starting `offset` bytes
    past a 64-byte boundary, filled from the content as the C target fills
    them (each buffer where the previous ended, the content repeated)."""
    out, start = [], 0
    content = case["content"]
    for dtype_code, offset, length in case["buffers"]:
        dtype = DTYPES[dtype_code]
        nbytes = length * dtype.itemsize
        if content:
            reps = (start % len(content) + nbytes) // len(content) + 1
            raw = (content * reps)[start % len(content):start % len(content) + nbytes]
        else:
            raw = bytes(nbytes)
        start += nbytes
        if length == 0:
            continue
        block = np.empty(nbytes + 128, dtype=np.uint8)
        at = (offset - block.ctypes.data) % 64
        view = block[at:at + nbytes]
        view[...] = np.frombuffer(raw, dtype=np.uint8)
        out.append(view.view(dtype))
    return out


def run(case):
    """What lossscale.core answers: (unscale flag or "error", results, check flag)."""
    arrays = arrays_of(case)
    if not arrays:
        return None
    before = [a.copy() for a in arrays]
    kwargs = dict(check_inputs=bool(case["flags"] & CHECK_INPUTS),
                  flush_denormals=bool(case["flags"] & FLUSH))
    checked = core.all_finite(arrays, flush_denormals=kwargs["flush_denormals"])
    core.set_num_threads(case["threads"])
    try:
        flag = core.unscale_(arrays, case["scale"], **kwargs)
    except ValueError:
        for a, b in zip(arrays, before):  # refused: nothing written
            assert a.view(UINT[a.itemsize]).tobytes() == b.view(UINT[b.itemsize]).tobytes()
        flag = "error"
    finally:
        core.set_num_threads(0)
    return flag, [a.view(UINT[a.itemsize]).copy() for a in arrays], checked


def numpy_oracle(case):
    """IEEE results from numpy / ml_dtypes: (flag, results, inputs finite)."""
    arrays = arrays_of(case)
    s = case["scale"]
    results, finite_out, finite_in = [], True, True
    with np.errstate(all="ignore"):
        for x in arrays:
            if x.dtype == np.float16:
                y = x * np.float16(s)
            elif x.dtype == BF16:
                y = (x.astype(np.float32) * np.float32(ml_dtypes.bfloat16(s))).astype(BF16)
            elif x.dtype == np.float32:
                y = x * np.float32(s)
            else:
                y = x * np.float64(s)
            results.append(y)
            finite_in &= bool(np.isfinite(x.astype(np.float64)).all())
            finite_out &= bool(np.isfinite(y.astype(np.float64)).all())
    flag = finite_in if case["flags"] & CHECK_INPUTS else finite_out
    return flag, results, finite_in


def scalar_results():
    """Every input run under LOSSSCALE_SIMD=scalar in a child process."""
    import lossscale

    env = dict(os.environ, LOSSSCALE_SIMD="scalar")
    here = os.path.dirname(os.path.dirname(os.path.abspath(lossscale.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    code = ("import pickle, sys; sys.path.insert(0, sys.argv[1]); "
            "import test_fuzz_regressions as t; "
            "from lossscale import core; assert core.simd_level() == 'scalar'; "
            "sys.stdout.buffer.write(pickle.dumps("
            "[t.run(t.decode(open(p, 'rb').read())) for p in t.INPUTS]))")
    # run from the tests directory: the source tree must not shadow the
    # lossscale this process imported
    here_tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code, here_tests], env=env, cwd=here_tests,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    import pickle

    return dict(zip(INPUTS, pickle.loads(proc.stdout)))


@pytest.fixture(scope="module")
def scalar():
    return scalar_results()


def test_there_are_inputs():
    assert any(os.sep + "regressions" + os.sep in p for p in INPUTS)
    assert len(INPUTS) > 50


@pytest.mark.parametrize("path", INPUTS, ids=[os.path.relpath(p, ROOT) for p in INPUTS])
def test_input(path, scalar):
    case = decode(open(path, "rb").read())
    got = run(case)
    assert _same_bits(got, scalar[path]), "differs from the scalar set"
    if got is None:
        return
    flag, results, checked = got
    want_flag, want, inputs_finite = numpy_oracle(case)
    assert checked == inputs_finite
    scale_ok = math.isfinite(case["scale"]) and case["scale"] > 0
    if not scale_ok:
        assert flag == "error"
        return
    if case["flags"] & FLUSH:
        return  # numpy has no flushing mode: the scalar set is the oracle
    assert flag == want_flag
    for r, w in zip(results, want):
        w_bits = w.view(r.dtype)
        nan = np.isnan(w.astype(np.float64))
        got_nan = np.isnan(r.view(w.dtype).astype(np.float64))
        assert ((r == w_bits) | (nan & got_nan)).all(), "differs from numpy"


def _same_bits(a, b):
    if a is None or b is None:
        return a is b
    return (a[0] == b[0] and a[2] == b[2] and len(a[1]) == len(b[1]) and
            all(np.array_equal(x, y) for x, y in zip(a[1], b[1])))


# ------------------------------------------------------------ scale rule

from lossscale import _native  # noqa: E402
from rule_model import keras3_step, tf24_step  # noqa: E402

RULE_INPUTS = sorted(glob.glob(os.path.join(ROOT, "fuzz", "regressions", "scale_rule", "*")) +
                     glob.glob(os.path.join(ROOT, "fuzz", "corpus", "scale_rule", "*")))
INT64_MAX = 2 ** 63 - 1
TINY = float(np.finfo(np.float32).tiny)


def decode_rule(data):
    """Configuration, state and steps (see the layout in fuzz/fuzz_scale_rule.c)."""
    head = (bytes(data) + bytes(61))[:61]
    rule, period, mult, backoff, lo, hi, hyst = struct.unpack("<Bqffffq", head[:33])
    state = struct.unpack("<fqqq", head[33:61])
    config = dict(rule=rule % 3, increment_period=period, multiplier=mult,
                  backoff_factor=None if backoff == 0 else backoff, min_loss_scale=lo,
                  max_loss_scale=None if hi == math.inf else hi, hysteresis=hyst)
    return config, state, [b & 1 for b in data[61:]]


def ordinary(config, state):
    """Whether the float32 model can be the oracle: it keeps subnormal
    configuration values and replaces a NaN scale by the floor, where the
    core (like TensorFlow) flushes and propagates."""
    values = [config["multiplier"], config["min_loss_scale"], state[0]]
    values += [v for v in (config["backoff_factor"], config["max_loss_scale"]) if v is not None]
    return all(math.isfinite(v) and (v == 0 or abs(v) >= TINY) for v in values)


def model_step(config, state, finite):
    with np.errstate(all="ignore"):
        if config["rule"] == 1:
            new = keras3_step(state, finite, period=config["increment_period"],
                              multiplier=config["multiplier"])
        else:
            new = tf24_step(state, finite, period=config["increment_period"],
                            multiplier=config["multiplier"],
                            backoff_factor=config["backoff_factor"],
                            min_loss_scale=config["min_loss_scale"],
                            max_loss_scale=config["max_loss_scale"],
                            hysteresis=config["hysteresis"])
    # the core's counters stop at INT64_MAX
    return (new[0],) + tuple(min(int(v), INT64_MAX) for v in new[1:])


def test_there_are_rule_inputs():
    assert any(os.sep + "regressions" + os.sep in p for p in RULE_INPUTS)


@pytest.mark.parametrize("path", RULE_INPUTS, ids=[os.path.relpath(p, ROOT) for p in RULE_INPUTS])
def test_rule_input(path):
    config, state, steps = decode_rule(open(path, "rb").read())
    state = (float(state[0]),) + tuple(state[1:])
    for finite in steps:
        try:
            new, apply = _native.scale_update(state, bool(finite), **config)
        except ValueError:
            assert config["rule"] == 2 or steps  # refused: a bad configuration
            return
        assert apply is bool(finite)
        want_skipped = state[3] if finite else min(state[3] + 1, INT64_MAX)
        assert new[3] == want_skipped
        if ordinary(config, state) and not math.isnan(new[0]):
            want = model_step(config, state, bool(finite))
            assert (np.float32(new[0]) == np.float32(want[0]) and
                    tuple(new[1:]) == tuple(want[1:])), (state, finite, new, want)
        state = new
