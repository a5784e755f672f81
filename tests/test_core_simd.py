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

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from lossscale import core
from simd_child import BF16, DTYPES, STREAM_BYTES, stream_positions, values

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simd_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every kernel set the library knows, best first (dispatch.c's table).
ALL_LEVELS = core.simd_levels(runnable=False)


def built_levels():
    """The kernel sets the build compiles on this machine (_core/kernel_sets.py)."""
    spec = importlib.util.spec_from_file_location(
        "kernel_sets", os.path.join(ROOT, "_core", "kernel_sets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [name for name, _ in module.sets_for()], module


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
    """Levels this CPU can run, best first (from the core's own cpuid probe,
    which is what LOSSSCALE_SIMD is checked against)."""
    return core.simd_levels()


# The worker: builds every case from fixed seeds, runs it under the forced
# level, saves results (large ones as per-chunk digests) to an .npz.
def run_worker(level, out_path, script=(CHILD,), extra=()):
    """``python *script out_path *extra`` under ``LOSSSCALE_SIMD=level``; the
    .npz it wrote.  ``script`` defaults to this file's child module."""
    env = child_env(LOSSSCALE_SIMD=level)
    proc = subprocess.run([sys.executable, *script, str(out_path), *extra], env=env,
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


def test_table_is_the_build_list():
    """dispatch.c's table and _core/kernel_sets.py name the same sets, and
    every set built here is one the table knows."""
    built, module = built_levels()
    assert sorted(ALL_LEVELS) == sorted(name for name, _, _ in module.KERNEL_SETS)
    assert set(core.simd_levels()) <= set(built)
    assert ALL_LEVELS[-1] == "scalar" and "scalar" in core.simd_levels()


def test_table_order_is_the_list_order():
    """dispatch.c's table is kernel_sets.def, entry for entry, best first."""
    _, module = built_levels()
    assert ALL_LEVELS == [name for name, _, _ in module.KERNEL_SETS]


def readme_listings():
    """Every place the README names the kernel sets: after
    ``LOSSSCALE_SIMD=`` (``a|b|c``) and in the comment on
    ``simd_level()`` (quoted names)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    found = []
    for m in re.finditer(r"LOSSSCALE_SIMD=(\w+(?:\|\w+)+)", text):
        found.append(("LOSSSCALE_SIMD=...", m.group(1).split("|")))
    for line in text.splitlines():
        if "simd_level()" in line and "#" in line:
            names = re.findall(r'"(\w+)"', line.split("#", 1)[1])
            if names:
                found.append((line.strip(), names))
    return found


def test_readme_names_every_kernel_set():
    """The README's copies of the list (the one list is
    _core/src/kernel_sets.def) name exactly its sets."""
    _, module = built_levels()
    want = sorted(name for name, _, _ in module.KERNEL_SETS)
    listings = readme_listings()
    assert listings, "the README no longer lists the kernel sets anywhere this test looks"
    for where, names in listings:
        assert sorted(names) == want, (where, names, want)


@pytest.mark.parametrize("level", [lv for lv in ALL_LEVELS if lv != "scalar"])
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


def test_stream_flags(results):
    """Long checks (read as several streams) find one bad value wherever it is."""
    for level, res in results.items():
        for dn, dt in DTYPES.items():
            for nbytes in STREAM_BYTES:
                n = nbytes // dt.itemsize
                assert bool(res[f"stream/{dn}/{n}/clean"]) is True, (level, dn, n)
                for pos in stream_positions(n):
                    assert bool(res[f"stream/{dn}/{n}/nan@{pos}"]) is False, (level, dn, n, pos)


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
    assert core.simd_best() == core.simd_levels()[0]
    p = _probe("")
    assert p.stdout.strip() == core.simd_best()


@pytest.mark.parametrize("level", ALL_LEVELS)
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
    built, _ = built_levels()
    above = [lv for lv in ALL_LEVELS[:ALL_LEVELS.index(core.simd_best())] if lv in built]
    if not above:
        pytest.skip(f"this CPU runs the widest set ({core.simd_best()})")
    p = _probe(above[0], ERROR_CODE)
    assert p.stdout.startswith("RuntimeError:"), p.stdout + p.stderr
