"""Writes the fuzz targets' seed corpora (fuzz/corpus/*/seed-*).

For fuzz/fuzz_core.c, hand-made starting points in its input layout, one per
corner the kernels have: every dtype and flag pair, lengths around each
vector width, starts off every alignment, scales that are powers of two,
that round, that are subnormal or huge, lists mixing dtypes with cut
points, lists big enough for the thread pool, every deliberate fault, and
a caller that runs with FTZ/DAZ set.  The content mixes random bits with
the special values of each dtype.  For fuzz/fuzz_scale_rule.c, both rules'
defaults and edge configurations, from fresh states and from counters at
their limits.  Deterministic: rerunning rewrites the same files.  Inputs
the fuzzers add later (merged into fuzz/corpus/*) keep their hash names.

    python fuzz/make_seeds.py
"""

import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ESIZE = [2, 2, 4, 8]  # float16, bfloat16, float32, float64
FLUSH, CHECK_INPUTS, CALLER_FLUSH, BIG = 1, 2, 4, 8

SPECIALS = {
    0: [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01,
        0xFE01, 0x3C00, 0x3555],
    1: [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81,
        0xFFC1, 0x3F80, 0x3EAB],
    2: [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000,
        0xFF800000, 0x7FC00000, 0x7F800001, 0x7FC12345, 0x3F800000, 0x3EAAAAAB],
    3: [0x0, 0x8000000000000000, 0x1, 0x000FFFFFFFFFFFFF, 0x0010000000000000,
        0x7FEFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
        0x7FF0000000000001, 0x7FF8000000012345, 0x3FF0000000000000, 0x3FD5555555555555],
}

SCALES = [2.0 ** -24, 2.0 ** -15, 0.5, 1.0, 2.0, 1.0 / 3.0, 1000.0, 65504.0, 2.0 ** 24,
          2.0 ** -126, 2.0 ** -149, 2.0 ** -1074, 2.0 ** 127, 1e300, -0.25, 0.0]


def content(rng, dtypes_lengths, finite_only=False):
    """Bytes for the buffers in order: random bits with specials sprinkled."""
    out = bytearray()
    for dtype, n in dtypes_lengths:
        size = ESIZE[dtype]
        fmt = {2: "<H", 4: "<I", 8: "<Q"}[size]
        specials = [v for v in SPECIALS[dtype]
                    if not finite_only or v not in SPECIALS[dtype][6:11]]
        for _ in range(min(n, 512 // size)):
            if rng.random() < 0.25:
                out += struct.pack(fmt, rng.choice(specials))
            else:
                v = rng.getrandbits(8 * size)
                if finite_only:  # clear the top exponent bit: never all ones
                    v &= ~(1 << (8 * size - 2))
                out += struct.pack(fmt, v)
    return bytes(out)


def encode(mode, scale, buffers, cuts=(), fault=0, data=b""):
    """buffers: (dtype, in_place, null_when_empty, src_off, dst_off, length)."""
    out = bytearray([mode]) + struct.pack("<d", scale)
    out += bytes([len(buffers) - 1, len(cuts), fault])
    for dtype, in_place, null_when_empty, soff, doff, length in buffers:
        out += bytes([dtype | in_place << 2 | null_when_empty << 3, soff, doff])
        out += struct.pack("<H", length)
    out += bytes(cuts)
    return bytes(out) + data


def seeds():
    rng = random.Random(20240611)
    lengths = [1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 1000, 4095]
    for dtype in range(4):
        for flags in range(4):
            for k, n in enumerate(lengths[flags::4]):
                soff = [0, ESIZE[dtype], 1, 3, 32, 62][(k + dtype) % 6]
                doff = [0, 5, ESIZE[dtype], 60][(k + flags) % 4]
                in_place = (k + dtype) % 2
                scale = SCALES[(k * 5 + dtype + flags) % len(SCALES)]
                data = content(rng, [(dtype, n)], finite_only=k % 3 == 0)
                yield (f"d{dtype}-f{flags}-n{n}",
                       encode(flags, scale, [(dtype, in_place, 0, soff, doff, n)], data=data))
    # lists mixing dtypes, split by cut points for the range entry points
    for k in range(12):
        count = 2 + k % 3
        bufs = [((k + i) % 4, (k + i) % 2, i == 1, (7 * i + k) % 64, (11 * i) % 64,
                 [0, 5, 33, 300, 1025][(k + 2 * i) % 5]) for i in range(count)]
        cuts = [rng.randrange(256) for _ in range(k % 8)]
        data = content(rng, [(b[0], b[5]) for b in bufs], finite_only=k % 2 == 0)
        yield (f"list-{k}",
               encode(k % 4 | (CALLER_FLUSH if k % 5 == 0 else 0), SCALES[k], bufs, cuts,
                      data=data))
    # big first buffers: the thread pool splits them (threads in the high nibble)
    for k, (dtype, threads) in enumerate([(0, 2), (1, 3), (2, 4), (3, 2), (2, 0), (0, 7)]):
        bufs = [(dtype, k % 2, 0, k, 3 * k, 4095 - 37 * k)]
        if k % 2:
            bufs.append(((dtype + 1) % 4, 1, 0, 1, 0, 100))
        data = content(rng, [(b[0], b[5]) for b in bufs], finite_only=k % 3 != 2)
        yield (f"big-{k}", encode(BIG | threads << 4 | k % 4, 0.5 + k, bufs, [128, 64][: k % 3],
                                  data=data))
    # every deliberate fault, on in-place and out-of-place lists
    for fault in range(1, 7):
        for in_place in (0, 1):
            bufs = [(fault % 4, in_place, 0, 1, 2, 40), (2, 0, 0, 0, 0, 9)]
            data = content(rng, [(b[0], b[5]) for b in bufs])
            yield (f"fault-{fault}-{in_place}",
                   encode(fault % 4, 0.125, bufs, [100], fault=fault, data=data))
    # non-finite scales straight from the input
    for name, scale in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
        yield (f"scale-{name}", encode(0, scale, [(2, 1, 0, 0, 0, 20)],
                                       data=content(rng, [(2, 20)])))
    # empty buffers, with and without pointers
    yield ("empty", encode(0, 2.0, [(0, 0, 1, 0, 0, 0), (3, 1, 0, 5, 5, 0), (1, 0, 0, 0, 0, 3)],
                           [0, 255], data=content(rng, [(1, 3)])))


INT64_MAX = 2 ** 63 - 1


def encode_rule(rule, period, multiplier, backoff, min_scale, max_scale, hysteresis,
                state, steps):
    out = struct.pack("<Bqffffq", rule, period, multiplier, backoff, min_scale, max_scale,
                      hysteresis)
    out += struct.pack("<fqqq", *state)
    return out + bytes(steps)


def rule_seeds():
    inf = float("inf")
    mixed = [1, 1, 0, 1, 0, 0, 1, 1, 1, 0] * 3
    yield "tf24-default", encode_rule(0, 2000, 2.0, 0.0, 1.0, inf, 1, (32768.0, 0, 0, 0), mixed)
    yield "tf24-period1", encode_rule(0, 1, 2.0, 0.0, 1.0, inf, 1, (2.0 ** 120, 0, 0, 0),
                                      [1] * 12 + [0] * 3)
    yield "tf24-ext", encode_rule(0, 3, 4.0, 0.5, 0.25, 1024.0, 2, (512.0, 2, 1, 7), mixed)
    yield "tf24-floor0", encode_rule(0, 2, 2.0, 0.0, 0.0, inf, 1, (2.0 ** -120, 0, 0, 0),
                                     [0] * 12)
    yield "tf24-limits", encode_rule(0, INT64_MAX, 2.0, 0.0, 1.0, inf, INT64_MAX,
                                     (1.0, INT64_MAX, INT64_MAX, INT64_MAX), [1, 0, 0, 1])
    yield "keras3-default", encode_rule(1, 2000, 2.0, 0.0, 1.0, inf, 1, (32768.0, 1998, 0, 0),
                                        mixed)
    yield "keras3-limits", encode_rule(1, 5, 2.0, 0.0, 1.0, inf, 1,
                                       (2.0 ** -125, INT64_MAX - 1, 0, INT64_MAX - 1),
                                       [1, 1, 0, 0])
    yield "bad-rule", encode_rule(2, 2000, 2.0, 0.0, 1.0, inf, 1, (1.0, 0, 0, 0), [1])
    yield "bad-multiplier", encode_rule(0, 2000, float("nan"), 0.0, 1.0, inf, 1,
                                        (1.0, 0, 0, 0), [1])


def main():
    for sub, generate in (("core", seeds), ("scale_rule", rule_seeds)):
        out = os.path.join(HERE, "corpus", sub)
        os.makedirs(out, exist_ok=True)
        n = 0
        for name, data in generate():
            with open(os.path.join(out, f"seed-{name}"), "wb") as f:
                f.write(data)
            n += 1
        print(f"{n} seeds in {out}")


if __name__ == "__main__":
    main()
