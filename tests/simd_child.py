"""The child process of test_core_simd: runs every deterministic case
under the kernel set that ``LOSSSCALE_SIMD`` forces and saves each result
(large ones as per-chunk digests) to an ``.npz``.

A level is chosen once per process, so each level needs its own
interpreter: the test runs ``python tests/simd_child.py OUT.npz`` with the
variable set, and imports ``values`` from here to re-derive the inputs for
its numpy oracle.
"""

import hashlib
import sys

import ml_dtypes
import numpy as np

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


def main(out_path):
    """Every case under the forced level, saved to ``out_path``."""
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

    # 2. lengths around every vector width and around the sizes from which
    #    the vector sets align a buffer (512 and 2048 bytes), misplaced
    #    starts, one bad value
    LENGTHS = sorted({1, 2, 3, 4, 5} | {w * m + d for w in (2, 4, 8, 16, 32, 64)
                                         for m in (1, 2, 4) for d in (-1, 0, 1)} |
                     {k * 128 + d for k in (1, 2, 4, 8) for d in (-1, 0, 1)} |
                     {1000, 4099})
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

    # 5. checks long enough to be read as several streams: one non-finite
    #    value around every stream's start and end, and in the remainder
    for dn, dt in DTYPES.items():
        for nbytes in STREAM_BYTES:
            n = nbytes // dt.itemsize
            big = np.empty(n + 1, dtype=dt)
            big[1:] = values(dt, n, seed=n) * dt.type(1e-3)
            x = big[1:]  # starts one element off the allocation
            res[f"stream/{dn}/{n}/clean"] = np.array(core.all_finite(x))
            for pos in stream_positions(n):
                keep = x[pos]
                x[pos] = np.nan
                res[f"stream/{dn}/{n}/nan@{pos}"] = np.array(core.all_finite(x))
                x[pos] = keep
            del big, x

    np.savez(out_path, **res)


# Byte lengths around the checks' multi-stream thresholds (4 streams of at
# least 64 KiB, in 2 KiB blocks) and one well past them.
STREAM_BYTES = [4 * 65536 - 8, 4 * 65536 + 8, 4 * 65536 + 4 * 2048 + 24, (1 << 20) + 4104]


def stream_positions(n):
    """Where one bad value goes: either side of every quarter and eighth of
    the buffer, and its ends."""
    marks = {n * k // 8 for k in range(9)}
    return sorted({min(n - 1, max(0, m + d)) for m in marks for d in (-2, -1, 0, 1)})


if __name__ == "__main__":
    main(sys.argv[1])
