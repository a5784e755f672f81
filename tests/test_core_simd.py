"""Every SIMD kernel set against the scalar reference, bit for bit.

Each level this CPU runs is forced with ``LOSSSCALE_SIMD`` in its own
subprocess (the level is chosen once per process), which computes the same
deterministic cases and saves every result; the scalar run's results are in
turn checked against numpy / ml_dtypes.  Cases: every float16 and bfloat16
bit pattern, every dtype at lengths around each vector width (16, 32 and
64 bytes, and their multiples), 10^7 elements, lists mixing dtypes, buffers
starting one element (and one byte) off their allocation, a single
non-finite value at every interesting position, both flags.
"""

import os
import platform
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from lossscale import core

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16,
          "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}

X86_LEVELS = ["scalar", "avx2", "avx512"]
ARM_LEVELS = ["scalar", "neon"]


def package_root():
    """The folder holding the lossscale this process imported (the source
    tree, or a separate build such as the sanitized one)."""
    import lossscale

    return os.path.dirname(os.path.dirname(os.path.abspath(lossscale.__file__)))


def child_env(**extra):
    """The environment for a child interpreter that imports the same
    lossscale as this process.  Children run with ``cwd=package_root()``:
    ``python -c`` puts its working directory ahead of PYTHONPATH."""
    env = dict(os.environ, **extra)
    here = package_root()
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    return env


def levels_here():
    """Levels this CPU can run, lowest first (from the core's own cpuid probe,
    which is what LOSSSCALE_SIMD is checked against)."""
    best = core.simd_best()
    order = ARM_LEVELS if best == "neon" or platform.machine().lower() in (
        "aarch64", "arm64") else X86_LEVELS
    return order[:order.index(best) + 1]


# The worker: builds every case from fixed seeds, runs it under the forced
# level, saves results (large ones as per-chunk digests) to an .npz.
COMMON = textwrap.dedent(r'''
    import hashlib, sys
    import numpy as np
    import ml_dtypes
    from lossscale import core

    BF16 = np.dtype(ml_dtypes.bfloat16)
    DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16,
              "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
    UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

    def values(dtype, n, seed):
        """Normal values with a sprinkle of subnormal and huge magnitudes."""
        rng = np.random.default_rng(seed)
        a = rng.standard_normal(n)
        k = max(1, n // 8)
        idx = rng.integers(0, n, k)
        fi = ml_dtypes.finfo(dtype)
        a[idx[: k // 2]] *= float(fi.smallest_normal) * 0.3
        a[idx[k // 2:]] = float(fi.max) * rng.uniform(0.1, 1.0, k - k // 2)
        return a.astype(dtype)
''')

WORKER = COMMON + textwrap.dedent(r'''
    out_path = sys.argv[1]
    res = {"level": np.array(core.simd_level())}
    PAT = 0x5A5A5A5A5A5A5A5A

    def run(name, x, s, flags, offset_bytes=0, pad=1):
        """x placed `pad` elements (or offset_bytes) into a larger buffer."""
        n, isz = x.size, x.dtype.itemsize
        if offset_bytes:
            raw = bytearray(n * isz + offset_bytes + 2 * isz)
            buf = np.frombuffer(raw, dtype=np.uint8)
            view = buf[offset_bytes:offset_bytes + n * isz].view(x.dtype)
            view[...] = x
            guard = None
        else:
            big = np.empty(n + 2 * pad, dtype=x.dtype)
            big.view(UINT[isz])[...] = PAT & (2 ** (8 * isz) - 1)
            view = big[pad:pad + n]
            view[...] = x
            guard = big
        if s is None:
            flag = core.all_finite(view, **flags)
            out = None
        else:
            flag = core.unscale_(view, s, **flags)
            out = view.copy()
        if guard is not None:
            g = guard.view(UINT[isz])
            pat = PAT & (2 ** (8 * isz) - 1)
            ok = bool((g[:pad] == pat).all() and (g[-pad:] == pat).all())
            res[name + "/guard"] = np.array(ok)
        res[name + "/flag"] = np.array(flag)
        if out is not None:
            res[name + "/out"] = out.view(UINT[isz])

    FLAGS = {"ieee": {}, "flush": {"flush_denormals": True},
             "inputs": {"check_inputs": True},
             "both": {"flush_denormals": True, "check_inputs": True}}

    # 1. every half pattern, every power-of-two scale and two that round
    scales = [2.0 ** e for e in range(-24, 25)] + [1.0 / 3.0, 1000.0]
    for dn in ("float16", "bfloat16"):
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(DTYPES[dn])
        for si, s in enumerate(scales):
            for fl in (("ieee", "flush") if si % 6 == 0 or si >= 49 else ("ieee",)):
                y = x.copy()
                flag = core.unscale_(y, s, **FLAGS[fl])
                res[f"all/{dn}/{si}/{fl}/out"] = y.view(np.uint16)
                res[f"all/{dn}/{si}/{fl}/flag"] = np.array(flag)
        # the finite-only patterns: the flag must come out True at small scales
        fin = x[np.isfinite(x.astype(np.float32))]
        for si in (0, 10, 24, 40, 48):
            y = fin.copy()
            res[f"allfinite/{dn}/{si}/flag"] = np.array(core.unscale_(y, scales[si]))
            res[f"allfinite/{dn}/{si}/out"] = y.view(np.uint16)
        res[f"allfinite/{dn}/check"] = np.array(core.all_finite(fin))

    # 2. lengths around every vector width, misplaced starts, one bad value
    LENGTHS = sorted({1, 2, 3, 4, 5} | {w * m + d for w in (2, 4, 8, 16, 32, 64)
                                         for m in (1, 2, 4) for d in (-1, 0, 1)} |
                     {255, 256, 257, 1000, 4099})
    for dn, dt in DTYPES.items():
        for n in LENGTHS:
            x = values(dt, n, seed=n)
            key = f"len/{dn}/{n}"
            for fl in FLAGS:
                run(f"{key}/{fl}/s3", x, 1.0 / 3.0, FLAGS[fl])
                run(f"{key}/{fl}/s2", x, 2.0, FLAGS[fl])
                run(f"{key}/{fl}/check", x, None, {k: v for k, v in FLAGS[fl].items()
                                                    if k == "flush_denormals"})
            run(f"{key}/pad3/s3", x, 1.0 / 3.0, {}, pad=3)
            if dt.itemsize > 1:
                run(f"{key}/byte1/s3", x, 1.0 / 3.0, {}, offset_bytes=1)
            # a single non-finite input (or overflow) at several positions
            for pos in sorted({0, n // 2, n - 1, min(n - 1, 7), min(n - 1, 31), n - 2} - {-1}):
                for what, v in (("inf", np.inf), ("nan", np.nan), ("max", None)):
                    y = x.copy()
                    y = (y.astype(np.float64) * 1e-3).astype(dt)
                    y[pos] = float(ml_dtypes.finfo(dt).max) if v is None else v
                    run(f"{key}/one_{what}@{pos}/ieee", y, 4.0, {})
                    run(f"{key}/one_{what}@{pos}/inputs", y, 4.0, {"check_inputs": True})
                    run(f"{key}/one_{what}@{pos}/check", y, None, {})

    # 3. a list mixing dtypes and lengths, one call
    rng = np.random.default_rng(7)
    lst = []
    for i in range(300):
        dn = list(DTYPES)[i % 4]
        lst.append(values(DTYPES[dn], int(rng.integers(1, 300)), seed=1000 + i))
    for fl in ("ieee", "flush"):
        y = [a.copy() for a in lst]
        res[f"list/{fl}/flag"] = np.array(core.unscale_(y, 0.1, **FLAGS[fl]))
        for i, a in enumerate(y):
            res[f"list/{fl}/{i}"] = a.view(UINT[a.dtype.itemsize])
    res["list/check"] = np.array(core.all_finite(lst))

    # 4. 10^7 elements, starting one element in: digests per chunk
    N = 10 ** 7
    for dn, dt in DTYPES.items():
        big = np.empty(N + 1, dtype=dt)
        big[1:] = values(dt, N, seed=99)
        x = big[1:]  # starts one element off the allocation
        for fl in ("ieee", "flush"):
            flag = core.unscale_(x, 1.0 / 3.0, **FLAGS[fl])
            raw = x.view(np.uint8)
            step = len(raw) // 64
            res[f"big/{dn}/{fl}/digest"] = np.array(
                [hashlib.sha256(raw[i:i + step]).hexdigest() for i in range(0, len(raw), step)])
            res[f"big/{dn}/{fl}/flag"] = np.array(flag)
        res[f"big/{dn}/check"] = np.array(core.all_finite(big[1:]))
        big[-1] = np.nan
        res[f"big/{dn}/check_nan"] = np.array(core.all_finite(big[1:]))
        del big, x

    np.savez(out_path, **res)
''')


def run_worker(level, out_path):
    env = child_env(LOSSSCALE_SIMD=level)
    proc = subprocess.run([sys.executable, "-c", WORKER, str(out_path)], env=env,
                          cwd=package_root(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"level {level}: {proc.stderr[-3000:]}"
    with np.load(out_path) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("simd")
    return {level: run_worker(level, d / f"{level}.npz") for level in levels_here()}


def test_scalar_is_available_everywhere():
    assert "scalar" in levels_here()


@pytest.mark.parametrize("level", [lv for lv in X86_LEVELS + ARM_LEVELS[1:]
                                   if lv != "scalar"])
def test_level_matches_scalar(results, level):
    if level not in results:
        pytest.skip(f"this CPU does not run {level} (best: {core.simd_best()})")
    got, ref = results[level], results["scalar"]
    assert str(got["level"]) == level
    assert set(got) == set(ref)
    bad = [k for k in ref if k != "level" and not np.array_equal(got[k], ref[k])]
    assert not bad, f"{level} differs from scalar in {len(bad)} results, e.g. {bad[:10]}"


def test_guards_untouched(results):
    for level, res in results.items():
        bad = [k for k in res if k.endswith("/guard") and not bool(res[k])]
        assert not bad, (level, bad[:10])


# -------- the scalar run itself, against numpy / ml_dtypes (independent oracle)


def _oracle(x, s):
    with np.errstate(all="ignore"):
        if x.dtype == BF16:
            return (x.astype(np.float32) * np.float32(ml_dtypes.bfloat16(s))).astype(BF16)
        return x * x.dtype.type(s)


def _same(got_bits, want):
    want_bits = want.view(got_bits.dtype)
    nan = np.isnan(want.astype(np.float64))
    got = got_bits.view(want.dtype).astype(np.float64)
    return bool(((got_bits == want_bits) | (nan & np.isnan(got))).all())


def test_scalar_lengths_against_numpy(results):
    """Re-derive the worker's inputs here and check the scalar level's
    IEEE results and flags with numpy."""
    ref = results["scalar"]
    ns = {}
    exec(compile(COMMON, "common", "exec"), ns)
    values = ns["values"]
    checked = 0
    for key in ref:
        parts = key.split("/")
        if parts[0] != "len" or parts[3] not in ("ieee", "pad3", "byte1") or parts[-1] != "out":
            continue
        dn, n, s = parts[1], int(parts[2]), {"s3": 1.0 / 3.0, "s2": 2.0}[parts[4]]
        x = values(DTYPES[dn], n, seed=n)
        want = _oracle(x, s)
        assert _same(ref[key], want), key
        flag = bool(ref[key[:-3] + "flag"])
        assert flag == bool(np.isfinite(want.astype(np.float64)).all()), key
        checked += 1
    assert checked >= 4 * 50 * 2


def test_scalar_single_bad_value_flags(results):
    ref = results["scalar"]
    checked = 0
    for key in ref:
        parts = key.split("/")
        if parts[0] != "len" or not parts[3].startswith("one_") or parts[-1] != "flag":
            continue
        what, mode = parts[3][4:].split("@")[0], parts[4]
        want = {("inf", "ieee"): False, ("nan", "ieee"): False, ("max", "ieee"): False,
                ("inf", "inputs"): False, ("nan", "inputs"): False, ("max", "inputs"): True,
                ("inf", "check"): False, ("nan", "check"): False, ("max", "check"): True}
        assert bool(ref[key]) == want[(what, mode)], key
        checked += 1
    assert checked > 1000


def test_scalar_half_patterns_against_numpy(results):
    ref = results["scalar"]
    scales = [2.0 ** e for e in range(-24, 25)] + [1.0 / 3.0, 1000.0]
    for dn in ("float16", "bfloat16"):
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(DTYPES[dn])
        for si, s in enumerate(scales):
            assert _same(ref[f"all/{dn}/{si}/ieee/out"], _oracle(x, s)), (dn, s)
            assert not bool(ref[f"all/{dn}/{si}/ieee/flag"])
        fin = x[np.isfinite(x.astype(np.float32))]
        for si in (0, 10, 24, 40, 48):
            want = _oracle(fin, scales[si])
            assert _same(ref[f"allfinite/{dn}/{si}/out"], want)
            assert bool(ref[f"allfinite/{dn}/{si}/flag"]) == bool(
                np.isfinite(want.astype(np.float32)).all())
        assert bool(ref[f"allfinite/{dn}/check"])


def test_big_flags(results):
    for level, res in results.items():
        for dn in DTYPES:
            assert bool(res[f"big/{dn}/check"]) is True, (level, dn)
            assert bool(res[f"big/{dn}/check_nan"]) is False, (level, dn)
            # the sprinkled huge values times 1/3 stay finite
            assert bool(res[f"big/{dn}/ieee/flag"]) is True, (level, dn)


# ------------------------------------------------------- level reporting


def _probe(env_value, code="from lossscale import core; print(core.simd_level())"):
    env = child_env()
    if env_value is None:
        env.pop("LOSSSCALE_SIMD", None)
    else:
        env["LOSSSCALE_SIMD"] = env_value
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=package_root(),
                          capture_output=True, text=True, timeout=120)


def test_default_level_is_best():
    p = _probe(None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == core.simd_best()
    assert core.simd_best() in X86_LEVELS + ARM_LEVELS
    p = _probe("")
    assert p.stdout.strip() == core.simd_best()


@pytest.mark.parametrize("level", X86_LEVELS + ARM_LEVELS[1:])
def test_forced_level_reported(level):
    p = _probe(level)
    if level in levels_here():
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == level
    else:
        assert p.returncode != 0
        assert "RuntimeError" in p.stderr and level in p.stderr


ERROR_CODE = textwrap.dedent('''
    import numpy as np
    from lossscale import core
    a = np.array([1.0, 2.0], dtype=np.float32)
    for call in (core.simd_level, lambda: core.unscale_(a, 0.5), lambda: core.all_finite(a)):
        try:
            call()
        except RuntimeError as e:
            print("RuntimeError:", e)
        else:
            print("no error")
    print("unchanged" if a.tolist() == [1.0, 2.0] else "modified")
    print(core.simd_best())
''')


@pytest.mark.parametrize("forced", ["neon_or_avx", "bogus", "AVX2x", "sse2"])
def test_forcing_unknown_or_missing_level_is_a_clear_error(forced):
    if forced == "neon_or_avx":
        # the other architecture's set: never runnable here
        forced = "avx2" if core.simd_best() == "neon" else "neon"
    p = _probe(forced, ERROR_CODE)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 5, p.stdout
    for line in lines[:3]:
        assert line.startswith("RuntimeError:") and forced in line, line
    assert lines[3] == "unchanged"
    assert lines[4] == core.simd_best()  # simd_best ignores the variable


def test_forcing_a_level_above_best_is_an_error():
    order = levels_here()
    family = ARM_LEVELS if "neon" in order else X86_LEVELS
    above = family[len(order):]
    if not above:
        pytest.skip(f"this CPU runs the widest set ({core.simd_best()})")
    p = _probe(above[0], ERROR_CODE)
    assert p.stdout.startswith("RuntimeError:"), p.stdout + p.stderr
