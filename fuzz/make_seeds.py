"""Writes the fuzz targets' seed corpora (fuzz/corpus/*/seed-*).

For fuzz/fuzz_core.c, hand-made starting points in its input layout, one per
corner the kernels have: every dtype and flag pair, lengths around each
vector width, starts off every alignment, scales that are powers of two,
that round, that are subnormal or huge, lists mixing dtypes with cut
points, lists big enough for the thread pool, every deliberate fault, and
a caller that runs with FTZ/DAZ set.  The content mixes random bits with
the special values of each dtype.  For fuzz/fuzz_scale_rule.c, both rules'
defaults and edge configurations, from fresh states and from counters at
their limits.  For fuzz/fuzz_norms.c, each path of the sums of squares:
dense lengths around a packet, a run of four, a leaf and a tree's splits,
lengths that Eigen cuts into 2 to 8 shards, sparse tables with repeated,
sorted and crowded indices, a table no slice touches, every unscale mode
with ordinary and extreme scales, flushing on and off (values whose
squares are subnormal), the host's cut points on and around leaf starts,
and every refusal.  For fuzz/fuzz_optim.c (whose corpus the fuzzer grew),
the RMSprop step forms raw hyperparameter bits rarely reach: lr * rsqrt(d)
first and g * rsqrt(d) first; and the update step of a gradient
accumulation (accumulators averaged, divided or times the reciprocal, over
a count of steps that is a power of two and one that is not) for each
family, gradients of every dtype, an EMA beside it, both unscales, and its
refusals (an accumulator on a sparse gradient, beside a term, without a
mode, an unknown mode, no steps); and sparse gradients for every family
and form that takes one (every clip mode the form takes, each gradient
dtype, rows of 1, 3 and 8 elements, repeated indices, an EMA, no slices)
with their refusals (an index one row too far or negative, a legacy
form's clip norm or slice factor) and a non-finite slice.  For
fuzz/fuzz_adafactor.c, each path of Adafactor's step: unfactored lengths
around a packet and a leaf, a tree's splits and two shards; factored
shapes with axes of 1 anywhere, rows below and past 16 (not multiples of
4), columns that put a packet of 8 outputs across two slices, rows past a
leaf, two shards, one row; several variables with the host's cut points,
in order and reversed; both unscales, scales that are powers of two
(subnormal, past the largest float) and raw ones; Adafactor's numbers
zero, NaN, infinite, subnormal or raw bits; Rsqrt on and off, flushing on
and off, special values; and every refusal.  For fuzz/fuzz_lamb.c, Lamb's
elementwise pass: lengths around a vector and past a thread's share, several
variables with the host's cut points in order and reversed, both unscales
with powers of two (subnormal, past the largest float) and raw scales,
its numbers ordinary, zero, special or raw bits, u over the gradient
itself, flushing on and off (by the flags and by the caller), special
values; and every refusal; then sparse gradients (rows of 1 element to
the whole variable, rows across a block of the gather, fewer slices than
rows and more, no slices, indices drawn, crowded, ascending and
descending) beside dense ones, and their refusals (a term, a row length
that does not divide or 0, an index one row too far or negative, no
indices, misaligned ones, slices on m, v or the variable, u on the slices,
too many slices); then the sums of the variable and of u (lengths within a
leaf, past a thread's share (several leaves) and across Eigen's 1 to 4
shards, each eigen_threads, the variable decayed or given as weights, sparse
gradients, the host's cut points on and around leaf edges, special
values, flushing on and off) and their refusals (the sums on m, v, u, the
term, the gradient or the variable, the weights on u, m or v or missing,
eigen_threads 0; and where these are valid: a decayed variable, a
variable of length 0, a gradient with no values).  Deterministic: rerunning
rewrites the same files.  Inputs the fuzzers add later (merged into fuzz/corpus/*) keep their
hash names.

    python fuzz/make_seeds.py
"""

import math
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


# fuzz/fuzz_norms.c
NONE, DIVIDE, MULTIPLY = 0, 1, 2
N_FLUSH, N_UNKNOWN_FLAG, N_CALLER_FLUSH, N_RAW = 4, 8, 16, 32
F_NULL_PARAMS, F_NULL_SUMS, F_NULL_VALUES, F_HUGE_LENGTH, F_HUGE_ROWS = 1, 2, 3, 4, 5
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
# Eigen's shards begin at 258,462 values (two); 997,000 values make eight.
TWO_SHARDS = 258462


def eigen_byte(threads):
    if 1 <= threads <= 8:
        return threads - 1
    if threads == INT32_MIN:
        return 254
    if threads == INT32_MAX:
        return 255
    assert -8 <= threads <= 5
    return threads + 248


def dense(n):
    """A dense gradient of n values: (form, L, W, S, X)."""
    if n < 320:
        return (0, n, 0, 0, 0)
    if n < 40000:
        return (1 << 1, n, 0, 0, 0)
    if n < 4 * 65536:
        return (2 << 1, n // 4, 0, 0, n % 4)
    assert 200000 <= n < 200000 + 16 * 65536
    return (3 << 1, (n - 200000) // 16, 0, 0, (n - 200000) % 16)


NORM_ROWS = [64, 4096, 16384, 65536]
NORM_WIDTH = [17, 33, 65, 33]


def sparse(rows, width, slices, off=0, null_when_empty=False, ordered=False, crowded=False):
    """A sparse gradient: the smallest size class that holds its table."""
    cls = next(c for c in range(4) if rows < NORM_ROWS[c] and width < NORM_WIDTH[c])
    form = 1 | cls << 1 | (off != 0) << 3 | (off > 0) << 4 | null_when_empty << 5
    form |= ordered << 6 | crowded << 7
    return (form, rows, width, slices, 0)


def norm_codes(rng, n, specials=0.0, exponents=range(16), which=range(16)):
    """n 2-byte value codes (fuzz_norms.c's value_of): magnitudes 2^-8..2^8,
    a share of them special values (0xFE00 | one of `which`)."""
    out = bytearray()
    for _ in range(n):
        if rng.random() < specials:
            code = 0xFE00 | rng.choice(which)
        else:
            code = rng.getrandbits(16) & ~(15 << 11) | rng.choice(exponents) << 11
            if code & 0xFE00 == 0xFE00:
                code &= 0x7FFF
        out += struct.pack("<H", code)
    return bytes(out)


def norm_indices(rng, rows, slices, bad=()):
    """slices indices, unsorted, with repeats; `bad`: (slice, raw value)."""
    values = [rng.randrange(max(rows, 1)) for _ in range(slices)]
    if rows > 1 and slices > 2:
        values[1] = values[0]  # a row named twice
    for k, raw in bad:
        values[k] = raw
    return b"".join(struct.pack("<q", v) if v < 0 else struct.pack("<Q", v) for v in values)


def encode_norms(grads, unscale=NONE, mode=0, lib_threads=1, eigen=2, scale=1.0, fault=0,
                 cuts=(), reverse=False, wild=False, data=b""):
    out = bytearray([unscale | mode | (lib_threads - 1) << 6, eigen_byte(eigen)])
    out += struct.pack("<d", scale)
    out += bytes([len(grads), fault | len(cuts) << 3 | reverse << 6 | wild << 7])
    out += struct.pack("<7I", *(list(cuts) + [0] * (7 - len(cuts))))
    for form, length, width, slices, extra in grads:
        out += bytes([form]) + struct.pack("<H", length) + bytes([width, slices, extra])
    return bytes(out) + data


def norm_seeds():
    rng = random.Random(20250301)
    modes = [(NONE, 1.0), (DIVIDE, 1024.0), (MULTIPLY, 1024.0), (DIVIDE, 3.0), (MULTIPLY, 3.0)]
    # dense lengths around a packet, a run of four packets and a leaf
    small = [0, 1, 7, 8, 9, 31, 32, 33, 39, 40, 63, 64, 65, 100, 255, 319]
    for k, (unscale, scale) in enumerate(modes):
        for flush in (0, N_FLUSH):
            lengths = small[(k * 2 + flush // 4) % 4::4]
            grads = [dense(n) for n in lengths]
            data = norm_codes(rng, sum(lengths), specials=0.04 if flush else 0.0)
            yield (f"dense-small-u{unscale}-s{scale:g}-f{flush // 4}",
                   encode_norms(grads, unscale, flush, scale=scale, data=data))
    # values whose squares are not finite
    for k, (unscale, scale) in enumerate(modes[:3]):
        grads = [dense(45), sparse(6, 5, 9), dense(300)]
        data = (norm_codes(rng, 45, specials=0.1) + norm_indices(rng, 6, 9)
                + norm_codes(rng, 345, specials=0.02))
        yield (f"wild-u{unscale}", encode_norms(grads, unscale, k % 2 * N_FLUSH, scale=scale,
                                                wild=True, data=data))
    for n in (8191, 8192, 8193, 8200, 16384, 16385, 24577, 39999):
        yield (f"dense-leaf-{n}", encode_norms([dense(n)], DIVIDE, scale=2.0,
                                               data=norm_codes(rng, min(n, 1500))))
    for n in (100000, 258461):
        yield (f"dense-tree-{n}", encode_norms([dense(n)], eigen=8,
                                               data=norm_codes(rng, 1500)))
    # Eigen's shards: 2 at 258,462, 3 at 400,000 (4 threads), 8 from 997,000
    for n, eigen, threads in ((TWO_SHARDS, 2, 2), (TWO_SHARDS + 1, 8, 1), (400000, 4, 3),
                              (996000, 8, 4), (997000, 8, 2), (1248575, 8, 4),
                              (1000000, INT32_MAX, 2), (500000, 1, 2)):
        yield (f"dense-shards-{n}-e{eigen}",
               encode_norms([dense(n)], MULTIPLY, lib_threads=threads, eigen=eigen,
                            scale=0.5, data=norm_codes(rng, 1200)))
    # sparse: repeated rows, sorted, crowded, untouched leaves, empty ones
    for k, (rows, width, slices, kw) in enumerate([
            (10, 4, 12, {}), (10, 4, 12, {"ordered": True}), (40, 16, 60, {"crowded": True}),
            (4000, 32, 100, {}), (4095, 32, 127, {"crowded": True, "ordered": True}),
            (16000, 20, 50, {}), (300, 0, 20, {}), (200, 7, 0, {}), (0, 5, 0, {}),
            (30000, 32, 3, {})]):
        unscale, scale = modes[k % len(modes)]
        data = norm_indices(rng, rows, slices) + norm_codes(rng, slices * width)
        yield (f"sparse-{rows}x{width}-{slices}{'-sorted' if kw.get('ordered') else ''}",
               encode_norms([sparse(rows, width, slices, **kw)], unscale, (k % 2) * N_FLUSH,
                            lib_threads=1 + k % 3, eigen=[2, 4, 8][k % 3], scale=scale,
                            data=data))
    # a list mixing both, split by the host at and around leaf starts
    # (20,000 values: leaves at 0, 5,000, 10,000 and 15,000)
    grads = [sparse(50, 8, 30), sparse(12, 3, 9), dense(20000), dense(65)]
    data = (norm_indices(rng, 50, 30) + norm_codes(rng, 240) + norm_indices(rng, 12, 9)
            + norm_codes(rng, 27 + 2000, specials=0.001))
    at = 400 + 36  # where the dense gradient begins
    for name, cuts, reverse in (("at", (at + 5000, at + 10000, at + 15000), False),
                                ("around", (at + 4999, at + 5001, at + 10000, at + 10000,
                                            at + 15001, 1), True),
                                ("edges", (0, 400, 401, at, at + 20000, at + 20001), False)):
        yield (f"list-cuts-{name}",
               encode_norms(grads, DIVIDE, eigen=4, scale=4.0, cuts=cuts, reverse=reverse,
                            data=data))
    # scales: subnormal, huge, zero, negative, non-finite, and unscaled
    # values whose squares are subnormal, flushed or not
    # (the second gradient's values all zeros, subnormals and 2^-75, which
    # even a subnormal scale leaves finite)
    tiny = (norm_codes(rng, 300, specials=0.02, exponents=[0, 1])
            + norm_codes(rng, 70, 1.0, which=[0, 1, 2, 3, 4, 6]))
    for k, (unscale, scale) in enumerate([
            (DIVIDE, 2.0 ** 70), (MULTIPLY, 2.0 ** 70), (DIVIDE, 2.0 ** -130),
            (MULTIPLY, 2.0 ** -127.5), (DIVIDE, 1e300), (MULTIPLY, 1e300), (DIVIDE, 0.0),
            (MULTIPLY, 0.0), (DIVIDE, -2.0), (MULTIPLY, -2.0), (DIVIDE, float("inf")),
            (MULTIPLY, float("inf")), (DIVIDE, float("nan")), (MULTIPLY, float("nan")),
            (MULTIPLY, 2.0 ** -140), (DIVIDE, 5e-324)]):
        for flush in (0, N_FLUSH):
            yield (f"scale-u{unscale}-{scale:g}-f{flush // 4}",
                   encode_norms([dense(300), dense(70)], unscale, flush, scale=scale,
                                data=tiny))
    raw = bytes(rng.getrandbits(8) for _ in range(1440))
    yield ("raw-bits", encode_norms([dense(300), sparse(20, 6, 10)], DIVIDE, N_RAW, scale=8.0,
                                    data=raw[:1200] + norm_indices(rng, 20, 10) + raw[1200:]))
    yield ("caller-flush", encode_norms([dense(5000)], NONE, N_CALLER_FLUSH,
                                        data=norm_codes(rng, 400, exponents=[0])))
    # refusals, each against an otherwise valid call
    base = [sparse(20, 4, 8), dense(100)]
    data = norm_indices(rng, 20, 8) + norm_codes(rng, 132)
    for name, kw in (("unscale-3", {"unscale": 3}), ("flag", {"mode": N_UNKNOWN_FLAG}),
                     ("eigen-0", {"eigen": 0}), ("eigen-neg", {"eigen": -3}),
                     ("eigen-min", {"eigen": INT32_MIN})):
        yield (f"refuse-{name}", encode_norms(base, data=data, **kw))
    for fault in (F_NULL_PARAMS, F_NULL_SUMS, F_NULL_VALUES, F_HUGE_LENGTH, F_HUGE_ROWS):
        yield (f"fault-{fault}-sparse", encode_norms(base, DIVIDE, fault=fault, data=data))
        yield (f"fault-{fault}-dense", encode_norms([dense(100), dense(7)], fault=fault,
                                                    data=data[64:]))
    # no gradients: NULL params and sums are taken
    for fault in (0, F_NULL_PARAMS, F_NULL_SUMS):
        yield (f"empty-list-{fault}", encode_norms([], fault=fault))
    yield ("empty-values-null", encode_norms([sparse(9, 2, 0, null_when_empty=True), dense(0)],
                                             fault=F_NULL_VALUES))
    for name, bad in (("past", [(3, 20)]), ("negative", [(0, -1)]),
                      ("far", [(7, 0x7F00000000000000)]), ("min", [(5, -2 ** 63)])):
        yield (f"refuse-index-{name}",
               encode_norms(base, data=norm_indices(rng, 20, 8, bad) + data[64:]))
    for off in (-1, 1):
        yield (f"refuse-length{off:+d}",
               encode_norms([sparse(20, 4, 8, off=off), dense(3)], data=data))


# fuzz_optim.c's family index of RMSprop (optim_families.h's order), and
# its step forms (family_rmsprop.h's ls_rmsprop_form).
OPTIM_RMSPROP = 2
RMSPROP_LR_RSQRT, RMSPROP_G_RSQRT = 2.0, 3.0

# fuzz_optim.c's family indices (optim_families.h's order) with numbers that
# pass each family's checks (family_<name>.h's order).
OPTIM_FAMILIES = {
    "sgd": (0, [0.9, 0.0]),
    "adam": (1, [0.1, 0.001, 1e-7, 1.0, 0.001]),
    "rmsprop": (2, [0.9, 0.1, 1e-7, 0.9, 1.0, 1.0, 1.0, 1.0]),
    "adagrad": (3, [1e-7, 1.0]),
    "adamax": (4, [0.1, 0.999, 1e-7, 0.1]),
    "nadam": (5, [0.1, 0.001, 1e-7, 0.45, 0.9, 0.55, 0.5, 0.001]),
    "lion": (6, [0.9, 0.1, 0.99, 0.01]),
    "legacy_sgd": (7, [1.0, 1.0, 0.9]),
    "legacy_adam": (8, [1.0, 0.0, 0.1, 0.001, 1e-7, 0.001]),
    "legacy_rmsprop": (9, [1.0, 1.0, 0.0, 0.9, 0.1, 0.5, 1e-7]),
    "legacy_adagrad": (10, [1e-7]),
    "accumulate": (11, []),
    "tf_keras_adam": (12, [0.1, 0.001, 1e-7, 1.0, 0.001]),
    "tf_keras_sgd": (13, [1.0, 1.0, 0.9]),
    "tf_keras_rmsprop": (14, [0.9, 0.1, 1e-7, 0.9, 1.0, 1.0, 2.0, 1.0]),
}
# A variable's dtype byte: its gradient term, its EMA, a sparse gradient.
TERM, AVERAGE, SPARSE = 4, 8, 16
# ls_accumulation_mode
ACC_NONE, ACC_DIVIDE, ACC_MULTIPLY = 0, 1, 2


def encode_optim(family, unscale, scale, lr, weight_decay, hyper, variables, data,
                 accumulation=(ACC_NONE, 0, 0)):
    """fuzz_optim.c's input: ``variables`` as (gradient dtype byte, decay byte,
    length); ``accumulation`` as (mode, which variables have an accumulator
    (a bit each), steps)."""
    out = bytearray(72)
    out[0] = (family & 7) << 1 | unscale << 4
    out[1:17] = struct.pack("<dff", scale, lr, weight_decay)
    out[17:17 + 4 * len(hyper)] = struct.pack(f"<{len(hyper)}f", *hyper)
    mode, which, steps = accumulation
    out[53] = mode | which << 2
    out[54:57] = steps.to_bytes(3, "little")
    out[65] = (len(variables) - 1) | (family >> 3) << 7
    out[66] = 100
    for dtype, decay, length in variables:
        out += bytes([dtype, decay]) + struct.pack("<Hf", length, 0.0)
    return bytes(out) + data


def optim_seeds():
    rng = random.Random(20250302)
    values = [0.0, -0.0, 1e-40, 3e38, 1.0, -2.5e-3]
    data = b"".join(struct.pack("<f", rng.choice(values) if rng.random() < 0.2
                                else rng.uniform(-3, 3) * 10.0 ** rng.randint(-4, 4))
                    for _ in range(600))
    # A one-element variable, one a packet and one past a packet and a
    # half-vector, decayed op by op or not; float32 gradients, divided.
    variables = [(2, 1, 1), (2, 0, 9), (2, 1, 37)]
    for name, form, centered in (("lr-rsqrt", RMSPROP_LR_RSQRT, 0.0),
                                 ("g-rsqrt-centered", RMSPROP_G_RSQRT, 1.0)):
        hyper = [0.9, 0.1, 1e-6, 0.5, 1.0, centered, form, 1.0]
        yield (f"rmsprop-{name}",
               encode_optim(OPTIM_RMSPROP, DIVIDE, 1024.0, 0.003, 0.004, hyper, variables, data))
    # Weight decay by a whole factor (ls_decay 3), beside the other forms.
    adam, adam_hyper = OPTIM_FAMILIES["adam"]
    yield ("decay-factor",
           encode_optim(adam, DIVIDE, 1024.0, 0.003, 0.0137, adam_hyper,
                        [(2, 3, 9), (0, 3, 37), (2, 2, 17), (1, 1, 5), (2, 0, 3)], data))
    yield from accumulation_seeds(data)
    yield from sparse_seeds()


# ls_clip_mode
CLIP_NONE, CLIP_VALUE, CLIP_NORM, CLIP_GLOBAL = 0, 1, 2, 3
# The bytes of a slice index that fuzz_optim.c reads as it is (its top
# byte 0xFF: negative), and one row too far is ``rows`` itself.
NEGATIVE_INDEX = 0xFF00000000000001


def grad_bytes(dtype, values):
    if dtype == 0:
        return struct.pack(f"<{len(values)}e", *values)
    if dtype == 1:  # bfloat16: the top half of the float32 (truncated)
        return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0] >> 16)[:2]
                        for v in values)
    return struct.pack(f"<{len(values)}f", *values)


def encode_sparse(family, hyper, unscale, scale, variables, rng, clip=CLIP_NONE,
                  clip_value=0.0, slice_factor=1.0, ema=(0.0, 0.0), flush=False,
                  caller_flush=False, lr=0.01, weight_decay=0.004, grad_override=None):
    """fuzz_optim.c's input with each buffer's content laid out exactly (no
    wrap-around), so that the indices are the rows given: ``variables`` as
    (gradient dtype, flags (TERM, AVERAGE), decay, row length, rows,
    indices, clip scalar)."""
    out = bytearray(72)
    out[0] = (int(flush) | (family & 7) << 1 | unscale << 4 | int(caller_flush) << 7)
    out[1:17] = struct.pack("<dff", scale, lr, weight_decay)
    out[17:17 + 4 * len(hyper)] = struct.pack(f"<{len(hyper)}f", *hyper)
    out[49:53] = struct.pack("<f", slice_factor) if slice_factor != 1.0 else bytes(4)
    out[57:65] = struct.pack("<ff", *ema)
    out[65] = (len(variables) - 1) | (family >> 3) << 7
    out[66] = 100
    out[67] = clip
    out[68:72] = struct.pack("<f", clip_value)
    body = bytearray()
    for dtype, flags, decay, width, rows, indices, clip_scalar in variables:
        assert 1 <= width <= 8 and len(indices) < 32
        out += bytes([dtype | flags | SPARSE | (width - 1) << 5, decay | len(indices) << 2])
        out += struct.pack("<Hf", rows * width, clip_scalar)
        n, slices = rows * width, len(indices)
        body += struct.pack(f"<{n}f", *(rng.uniform(-2, 2) for _ in range(n)))
        grads = [rng.uniform(-3, 3) * 10.0 ** rng.randint(-3, 2) for _ in range(slices * width)]
        if grad_override is not None and grads:
            grads[len(grads) // 2] = grad_override
        body += grad_bytes(dtype, grads)
        # the slots: moments, accumulators and mean squares are >= 0 where
        # a family needs them so; a first slot of any sign reads as a momentum
        for _ in range(3):
            body += struct.pack(f"<{n}f", *(rng.uniform(0, 1) for _ in range(n)))
        if flags & TERM:
            body += struct.pack(f"<{n}f", *(rng.uniform(0, 1) for _ in range(n)))
        if flags & AVERAGE:
            body += struct.pack(f"<{n}f", *(rng.uniform(-2, 2) for _ in range(n)))
        body += b"".join(struct.pack("<Q", i) for i in indices)
    return bytes(out) + bytes(body)


# The families that take a sparse gradient (ls_optim_takes_sparse), each
# form its numbers choose: (name, numbers, clip modes its sparse form
# takes, slice factor).  The legacy forms take the sparse numbers
# (family_legacy_adam.h: beta_1 and beta_2 themselves).
SPARSE_FORMS = [
    ("sgd", [0.9, 0.0], (CLIP_NONE, CLIP_VALUE, CLIP_NORM, CLIP_GLOBAL), 0.01),
    ("sgd-nesterov", [0.9, 1.0], (CLIP_NONE, CLIP_VALUE), 0.01),
    ("adam", [0.1, 0.001, 1e-7, 1.0, 0.001], (CLIP_NONE, CLIP_VALUE, CLIP_NORM, CLIP_GLOBAL),
     1.0),
    ("adamax", [0.1, 0.999, 1e-7, 0.1], (CLIP_NONE, CLIP_NORM, CLIP_GLOBAL), 1.0),
    ("lion", [0.9, 0.1, 0.99, 0.01], (CLIP_NONE, CLIP_VALUE, CLIP_GLOBAL), 0.1),
    ("adagrad", [1e-7, 0.0], (CLIP_NONE, CLIP_VALUE, CLIP_NORM), 1.0),
    ("legacy_sgd", [0.0, 0.0, 0.0], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_sgd-momentum", [1.0, 0.0, 0.9], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_sgd-nesterov", [1.0, 1.0, 0.9], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_adam", [0.0, 0.0, 0.9, 0.999, 1e-7, 0.001], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_adam-amsgrad-graph", [1.0, 1.0, 0.9, 0.999, 1e-7, 0.001], (CLIP_NONE, CLIP_VALUE),
     1.0),
    ("legacy_rmsprop", [0.0, 0.0, 0.0, 0.9, 0.1, 0.0, 1e-7], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_rmsprop-centered-graph", [0.0, 1.0, 1.0, 0.9, 0.1, 0.0, 1e-7],
     (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_rmsprop-momentum", [1.0, 0.0, 0.0, 0.9, 0.1, 0.5, 1e-7], (CLIP_NONE, CLIP_VALUE),
     1.0),
    ("legacy_rmsprop-momentum-centered", [1.0, 1.0, 0.0, 0.9, 0.1, 0.5, 1e-7],
     (CLIP_NONE, CLIP_VALUE), 1.0),
    ("legacy_adagrad", [1e-7], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_adam", [0.1, 0.001, 1e-7, 0.0, 0.001], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_adam-amsgrad", [0.1, 0.001, 1e-7, 1.0, 0.001], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_sgd-nesterov", [1.0, 1.0, 0.9], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_sgd-momentum", [1.0, 0.0, 0.9], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_sgd-no-slot", [0.0, 1.0, 0.0], (CLIP_NONE,), 1.0),
    ("tf_keras_rmsprop", [0.9, 0.1, 1e-7, 0.0, 0.0, 0.0, 1.0, 0.0], (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_rmsprop-momentum-graph", [0.9, 0.1, 1e-7, 0.9, 1.0, 0.0, 2.0, 0.0],
     (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_rmsprop-centered-push-down", [0.8, 0.2, 1e-3, 0.0, 0.0, 1.0, 2.0, 1.0],
     (CLIP_NONE, CLIP_VALUE), 1.0),
    ("tf_keras_rmsprop-centered-momentum", [0.9, 0.1, 1e-7, 0.5, 1.0, 1.0, 3.0, 0.0],
     (CLIP_NONE,), 1.0),
    # Keras 3's RMSprop scatters a sparse gradient without momentum, not
    # centered, dividing by a true square root; the other forms are refused.
    ("rmsprop", [0.9, 0.1, 1e-7, 0.0, 0.0, 0.0, 0.0, 0.0], (CLIP_NONE, CLIP_VALUE, CLIP_NORM),
     1.0),
    ("rmsprop-refused-momentum", [0.9, 0.1, 1e-7, 0.9, 1.0, 0.0, 0.0, 0.0], (CLIP_NONE,), 1.0),
    ("rmsprop-refused-centered", [0.9, 0.1, 1e-7, 0.0, 0.0, 1.0, 0.0, 0.0], (CLIP_NONE,), 1.0),
    ("rmsprop-refused-rsqrt", [0.9, 0.1, 1e-7, 0.0, 0.0, 0.0, 1.0, 0.0], (CLIP_NONE,), 1.0),
]


def sparse_seeds():
    """Sparse gradients for every family that takes one, each form: a
    float16, a bfloat16 and a float32 gradient in turn (one a row of one
    element, one of three, one of eight over 40 rows with an EMA and
    empty rows), indices repeated and unsorted, every clip mode the form
    takes, each unscale, flushing on and off; one of no slices; then the
    refusals (a clip or slice factor the form does not take, an index one
    row too far, a negative one) and a non-finite slice value (skipped);
    tf_keras RMSprop's rows gathered in an order of their own."""
    rng = random.Random(20261204)
    unscales = [(DIVIDE, 1024.0), (MULTIPLY, 1000.0), (NONE, 1.0)]
    for k, (form, hyper, clips, factor) in enumerate(SPARSE_FORMS):
        family = OPTIM_FAMILIES[form.split("-")[0]][0]
        for j, clip in enumerate(clips):
            dtypes = [(k + j + d) % 3 for d in range(3)]
            unscale, scale = unscales[(k + j) % 3]
            variables = [
                (dtypes[0], 0, 1, 1, 7, [3, 0, 3, 6, 3], 1.5),
                (dtypes[1], 0, 2, 3, 4, [2, 1, 2, 2], 0.75),
                (dtypes[2], AVERAGE, 1, 8, 40, [39, 5, 17, 5, 0, 22, 5, 39, 1, 30], 2.0),
            ]
            yield (f"sparse-{form}-clip{clip}",
                   encode_sparse(family, hyper, unscale, scale, variables, rng, clip=clip,
                                 clip_value=0.5, slice_factor=factor if clip != CLIP_GLOBAL else 1.0,
                                 ema=(0.99, 0.01), flush=(j % 2 == 1), caller_flush=(k % 2 == 1)))
        one = [(2, AVERAGE, 0, 4, 5, [], 1.0), (0, 0, 1, 1, 3, [2, 2], 1.0)]
        yield (f"sparse-{form}-no-slices",
               encode_sparse(family, hyper, DIVIDE, 8.0, one, rng, slice_factor=factor))
        bad = {"far": [1, 5], "negative": [1, NEGATIVE_INDEX]}
        for why, indices in bad.items():
            yield (f"sparse-{form}-refuse-{why}",
                   encode_sparse(family, hyper, DIVIDE, 8.0,
                                 [(2, 0, 0, 2, 5, indices, 1.0)], rng, slice_factor=factor))
        yield (f"sparse-{form}-nonfinite",
               encode_sparse(family, hyper, DIVIDE, 8.0, [(2, 0, 0, 2, 5, [4, 1, 4], 1.0)], rng,
                             slice_factor=factor, grad_override=float("inf")))
        if form.startswith("tf_keras_rmsprop"):
            # The named rows' denominators gathered by their first slice, a
            # packet of TensorFlow's Rsqrt and a tail, in an order not the
            # rows' own.
            gathered = [(2, 0, 1, 3, 9, [7, 2, 7, 0, 5, 2], 1.0),
                        (1, AVERAGE, 0, 5, 12, [11, 3, 8, 3, 0, 11], 1.0)]
            yield (f"sparse-{form}-gathered",
                   encode_sparse(family, hyper, DIVIDE, 8.0, gathered, rng, ema=(0.99, 0.01)))
        if form.startswith("legacy"):
            yield (f"sparse-{form}-refuse-clipnorm",
                   encode_sparse(family, hyper, NONE, 1.0, [(2, 0, 0, 2, 5, [4, 1], 1.0)], rng,
                                 clip=CLIP_NORM, clip_value=0.5))
            yield (f"sparse-{form}-refuse-factor",
                   encode_sparse(family, hyper, NONE, 1.0, [(2, 0, 0, 2, 5, [4, 1], 1.0)], rng,
                                 slice_factor=0.5))


def accumulation_seeds(data):
    """The update step of a gradient accumulation: every family, averaged by
    a division and by the reciprocal, over 3 and 4 steps; a float16, a
    bfloat16 and a float32 gradient (one, a vector and a half, a long one
    with an EMA); Keras 3's unscale, TensorFlow 2.4's (whose float16 product
    is rounded) and none; then each refusal."""
    variables = [(0, 1, 1), (1, 0, 37), (2 | AVERAGE, 1, 300)]
    unscales = [(DIVIDE, 1000.0), (MULTIPLY, 1024.0), (NONE, 1.0)]
    for name, (family, hyper) in OPTIM_FAMILIES.items():
        for mode, steps in ((ACC_DIVIDE, 3), (ACC_MULTIPLY, 3), (ACC_DIVIDE, 4),
                            (ACC_MULTIPLY, 4)):
            unscale, scale = unscales[(family + steps + mode) % 3]
            kind = "divide" if mode == ACC_DIVIDE else "multiply"
            yield (f"accumulate-{name}-{kind}-{steps}",
                   encode_optim(family, unscale, scale, 0.003, 0.004, hyper, variables, data,
                                accumulation=(mode, 0b111, steps)))
    sgd, sgd_hyper = OPTIM_FAMILIES["sgd"]
    adam, adam_hyper = OPTIM_FAMILIES["adam"]
    # (name, family, numbers, unscale, variables, accumulation): one
    # variable of each refused.
    refusals = [
        ("sparse", sgd, sgd_hyper, DIVIDE, [(2, 1, 8), (2 | SPARSE | 3 << 5, 3 << 2, 16)],
         (ACC_DIVIDE, 0b10, 2)),
        ("term", adam, adam_hyper, NONE, [(2 | TERM, 0, 17), (2, 0, 5)], (ACC_DIVIDE, 0b01, 2)),
        ("no-mode", sgd, sgd_hyper, DIVIDE, [(2, 0, 9)], (ACC_NONE, 0b1, 2)),
        ("unknown-mode", sgd, sgd_hyper, DIVIDE, [(2, 0, 9)], (3, 0b1, 2)),
        ("no-steps", sgd, sgd_hyper, DIVIDE, [(2, 0, 9)], (ACC_MULTIPLY, 0b1, 0)),
    ]
    for name, family, hyper, unscale, refused, accumulation in refusals:
        yield (f"accumulate-refuse-{name}",
               encode_optim(family, unscale, 1000.0, 0.003, 0.0, hyper, refused, data,
                            accumulation=accumulation))
    # An odd count past 2^16, and the most steps the input holds.
    for steps in (65537, (1 << 24) - 1):
        yield (f"accumulate-steps-{steps}",
               encode_optim(sgd, DIVIDE, 2.0 ** 15, 0.01, 0.0, sgd_hyper, variables, data,
                            accumulation=(ACC_DIVIDE, 0b101, steps)))


# ------------------------------------------------------------ Adafactor

AF_FLUSH, AF_UNKNOWN_FLAG, AF_CALLER_FLUSH, AF_RSQRT = 4, 8, 16, 32
AF_NONE, AF_DIVIDE, AF_DIVIDE_POW2, AF_UNKNOWN = 0, 1, 2, 3
AF_FAULTS = dict(null_config=1, null_params=2, null_var=3, null_grad=4, null_v=5, null_r=6,
                 null_c=7, bad_shape=8, zero_cols=9, overflow=10, huge_length=11, empty=12)
# fuzz_adafactor.c's shape classes: (outer, rows, cols) as (base, modulus)
# pairs over O, R and C
AF_CLASSES = [((1, 3), (1, 20), (1, 20)), ((1, 4), (1, 64), (1, 100)),
              ((1, 2), (1, 4), (8193, 12000)), ((1, 3), (1, 300), (1, 13)),
              ((1, 1), (380, 300), (680, 200)), ((1, 4), (1, 2000), (1, 1)),
              ((1, 4), (1, 1), (1, 3000)), ((1, 1), (1, 3), (1, 30000))]


def af_hyper(lo, value):
    """The sane code (fuzz_adafactor.c's hyper_of) nearest below value."""
    k = 0
    while 2.0 ** (lo + k + 1) <= value:
        k += 1
    return k << 7 | int((value / 2.0 ** (lo + k) - 1) * 128)


AF_SPECIAL = dict(zero=0xF000, neg_zero=0xF001, one=0xF002, neg_one=0xF003, nan=0xF004,
                  inf=0xF005, neg_inf=0xF006, tiny=0xF007, max_subnormal=0xF008,
                  min_normal=0xF009, max=0xF00A, big=0xF00B, small=0xF00C, half=0xF00D,
                  subnormal=0xF00E, neg_subnormal=0xF00F)
# rho, beta, rest (1 - beta), epsilon_1, epsilon_2, clip_threshold as Keras' defaults
# make them at step 10 with a learning rate of 0.001
AF_DEFAULT = [af_hyper(-14, 0.001), af_hyper(-8, 1 - 10 ** -0.8), 0, af_hyper(-110, 1e-30),
              af_hyper(-14, 1e-3), af_hyper(-3, 1.0)]


def af_unfactored(n):
    """An unfactored variable of n values: (form, O, R, C)."""
    if n == 0:
        return (4 << 1, 0, 0, 0)
    if n < 64:
        return (0, 0, n, 0)
    if n < 1100:
        return (1 << 1, 0, n, 0)
    if 8000 <= n < 20000:
        return (2 << 1, 0, n - 8000, 0)
    assert 258000 <= n < 258000 + 4096
    return (3 << 1, 0, n - 258000, 0)


def af_factored(outer, rows, cols):
    """A factored [outer, rows, cols]: the first class that makes it."""
    if outer == 1 and rows == 1 and cols >= 258000:
        return (1 | 7 << 1, 0, 0x8000, cols - 258000)
    for cls, ranges in enumerate(AF_CLASSES):
        codes = []
        for size, (base, mod) in zip((outer, rows, cols), ranges):
            if not base <= size < base + mod:
                break
            codes.append(size - base)
        else:
            return (1 | cls << 1, codes[0], codes[1], codes[2])
    raise ValueError((outer, rows, cols))


def af_size(var):
    form, o, r, c = var
    cls = form >> 1 & 7
    if not form & 1:
        return [r % 64, r % 1100, 8000 + r % 12000, 258000 + r % 4096, 0][cls] if cls < 5 \
            else r % 300
    if cls == 7 and r & 0x8000:
        return 1, 1, 258000 + c % 8192
    (ob, om), (rb, rm), (cb, cm) = AF_CLASSES[cls]
    return ob + o % om, rb + r % rm, cb + c % cm


def af_content(rng, variables, specials=0.0, which=range(8), limit=1024):
    """Codes for each variable's var, grad, then r and c (factored) and v,
    at most `limit` in all (the target repeats the content)."""
    n = 0
    for var in variables:
        size = af_size(var)
        if isinstance(size, tuple):
            o, r, c = size
            n += 3 * o * r * c + o * r + o * c
        else:
            n += 3 * size
    return norm_codes(rng, min(n, limit), specials=specials, which=which)


def encode_adafactor(variables, unscale=AF_NONE, scale=0x3F800000, flags=0, lib_threads=1,
                     eigen=1, fault=0, raw=False, wild=False, cuts=(), reverse=False,
                     dummy_rc=False, hyper=None, data=b""):
    out = bytearray([unscale | flags | (lib_threads - 1) << 6, eigen_byte(eigen),
                     len(variables) | fault << 2 | raw << 6 | wild << 7,
                     len(cuts) | reverse << 3 | dummy_rc << 4])
    out += struct.pack("<I", scale)
    out += struct.pack("<6H", *(hyper or AF_DEFAULT))
    out += struct.pack("<7I", *(list(cuts) + [0] * (7 - len(cuts))))
    for form, o, r, c in variables:
        out += bytes([form, o]) + struct.pack("<HH", r, c)
    return bytes(out) + data


def af_pow2(exponent):
    """fuzz_adafactor.c's power-of-two scale 2^exponent (its byte 4)."""
    return exponent + 149


def adafactor_seeds():
    rng = random.Random(20260105)
    three = struct.unpack("<I", struct.pack("<f", 3.0))[0]
    # unfactored lengths around a packet, a run of four and a leaf; trees; shards
    for k, n in enumerate([0, 1, 7, 9, 33, 63, 100, 1099, 16391]):
        flags = AF_FLUSH if k % 2 else 0
        v = [af_unfactored(n)]
        yield (f"unfactored-{n}-f{k % 2}",
               encode_adafactor(v, AF_DIVIDE if k % 3 else AF_NONE, three, flags,
                                eigen=1 + k % 3, data=af_content(rng, v)))
    for n, eigen in ((258461, 2), (258462, 2), (262000, 8)):
        v = [af_unfactored(n)]
        yield (f"unfactored-{n}-e{eigen}",
               encode_adafactor(v, AF_DIVIDE_POW2, af_pow2(10), eigen=eigen,
                                data=af_content(rng, v)))
    # factored shapes: axes of 1 anywhere, rows across 16 and not a multiple
    # of 4, columns no multiple of 8 (packets straddling slices), rows past a
    # leaf, two shards, one row
    shapes = [(1, 1, 1), (1, 1, 7), (1, 7, 1), (3, 1, 1), (2, 3, 5), (3, 17, 9), (1, 16, 8),
              (2, 19, 13), (3, 20, 6), (4, 63, 99), (1, 20, 20), (2, 4, 8200), (1, 2, 20000),
              (3, 299, 13), (1, 383, 683), (1, 1999, 1), (4, 15, 1), (4, 1, 2999), (1, 1, 266191),
              (1, 3, 29999), (2, 33, 3)]
    for k, (o, r, c) in enumerate(shapes):
        v = [af_factored(o, r, c)]
        flags = (AF_FLUSH if k % 2 else 0) | (AF_RSQRT if k % 3 == 1 else 0)
        unscale = [AF_NONE, AF_DIVIDE, AF_DIVIDE_POW2][k % 3]
        scale = af_pow2(-7) if unscale == AF_DIVIDE_POW2 else three
        eigen = 2 if o * r * c > 250000 else 1 + k % 4
        yield (f"factored-{o}x{r}x{c}-f{flags}",
               encode_adafactor(v, unscale, scale, flags, eigen=eigen, lib_threads=1 + k % 4,
                                data=af_content(rng, v)))
    # several variables, the host's cuts in order and reversed, r and c given
    # to an unfactored one
    mixed = [af_factored(2, 19, 13), af_unfactored(100), af_factored(3, 1, 1)]
    for reverse in (False, True):
        yield (f"mixed-cuts-r{int(reverse)}",
               encode_adafactor(mixed, AF_DIVIDE, three, AF_FLUSH, lib_threads=4, eigen=3,
                                cuts=(0, 1, 494, 495, 600, 600, 10 ** 9), reverse=reverse,
                                dummy_rc=True, data=af_content(rng, mixed)))
    # scales: subnormal, the least normal, past the largest (inf) powers of
    # two, under the flush and not; raw zero, NaN and negative
    small = [af_factored(2, 19, 13), af_unfactored(33)]
    for e in (-127, -149, 128):
        for flags in (0, AF_FLUSH):
            yield (f"scale-pow2-{e}-f{flags // AF_FLUSH}",
                   encode_adafactor(small, AF_DIVIDE_POW2, af_pow2(e), flags,
                                    data=af_content(rng, small)))
    for name, bits in (("zero", 0), ("nan", 0x7FC00000), ("neg", 0xC0000000),
                       ("subnormal", 0x00012345)):
        yield (f"scale-{name}", encode_adafactor(small, AF_DIVIDE, bits, AF_FLUSH,
                                                 data=af_content(rng, small)))
    # hyperparameters out of the ordinary
    odd = [(0, "zero"), (0, "nan"), (1, "zero"), (2, "inf"), (2, "subnormal"), (3, "zero"),
           (3, "subnormal"), (4, "nan"), (4, "inf"), (5, "zero"), (5, "nan"), (5, "neg_one"),
           (5, "small")]
    names = ["rho", "beta", "rest", "epsilon_1", "epsilon_2", "clip"]
    for k, (i, special) in enumerate(odd):
        hyper = list(AF_DEFAULT)
        hyper[i] = AF_SPECIAL[special]
        if i == 1:
            hyper[2] = AF_SPECIAL["one"]
        yield (f"hyper-{names[i]}-{special}",
               encode_adafactor(small, AF_DIVIDE, three, AF_FLUSH if k % 2 else 0, hyper=hyper,
                                data=af_content(rng, small)))
    hyper = list(AF_DEFAULT)
    hyper[5] = af_hyper(-3, 0.125)  # a clip below the RMS of u: m > 1
    yield ("hyper-clip-low", encode_adafactor(small, AF_NONE, hyper=hyper,
                                              data=af_content(rng, small)))
    hyper = [0xE123, 0xE456, 0xE789, 0xEABC, 0xEDEF, 0xE0F0]
    yield ("hyper-raw", encode_adafactor(small, AF_DIVIDE, three, hyper=hyper,
                                         data=af_content(rng, small)))
    # values: subnormal and special, flushed or not, the caller's own FTZ/DAZ
    for flags in (0, AF_FLUSH, AF_CALLER_FLUSH, AF_FLUSH | AF_CALLER_FLUSH | AF_RSQRT):
        yield (f"specials-f{flags}",
               encode_adafactor(small, AF_DIVIDE, three, flags, wild=True,
                                data=af_content(rng, small, specials=0.3, which=range(16))))
    yield ("raw-values", encode_adafactor(small, AF_DIVIDE, three, AF_FLUSH, raw=True,
                                          data=bytes(rng.getrandbits(8) for _ in range(2048))))
    # no variables; refusals
    yield ("no-variables", encode_adafactor([], AF_DIVIDE, three))
    for fault, number in AF_FAULTS.items():
        yield (f"fault-{fault}", encode_adafactor(small, AF_DIVIDE, three, fault=number,
                                                  data=af_content(rng, small)))
    yield ("fault-null_r-unfactored",
           encode_adafactor([af_unfactored(9)], fault=AF_FAULTS["null_r"], dummy_rc=True,
                            data=af_content(rng, [af_unfactored(9)])))
    for eigen in (0, -3, INT32_MIN):
        yield (f"eigen-{eigen}", encode_adafactor(small, AF_DIVIDE, three, eigen=eigen,
                                                  data=af_content(rng, small)))
    yield ("unknown-flag", encode_adafactor(small, flags=AF_UNKNOWN_FLAG | AF_FLUSH,
                                            data=af_content(rng, small)))
    for bits in (0, 1):
        yield (f"unknown-unscale-{bits}", encode_adafactor(small, AF_UNKNOWN, bits,
                                                           data=af_content(rng, small)))


# ----------------------------------------------------------------- Lamb

LAMB_NONE, LAMB_DIVIDE, LAMB_DIVIDE_POW2, LAMB_UNKNOWN = 0, 1, 2, 3
LAMB_FLUSH, LAMB_UNKNOWN_FLAG, LAMB_CALLER_FLUSH = 4, 8, 16
LAMB_FAULTS = dict(null_config=1, null_params=2, null_grad=3, null_m=4, u_on_m=5,
                   u_is_grad=6, huge_length=7)
LAMB_SPARSE_MARK = 30  # a class byte's bits 2-7 for a sparse gradient
LAMB_SPARSE_FAULTS = dict(u_over=1, index_high=2, index_negative=3, no_indices=4, misaligned=5,
                          on_other=6, huge_slices=7)
LAMB_SUMS_MARK, LAMB_SUMS_KEY = 29, 10  # a class byte's bits 2-7, the next byte's bits 4-7
LAMB_SUMS_FAULTS = dict(on_m=1, on_u=2, on_grad=3, weights_on=4, no_weights=5, no_threads=6,
                        weights_beside=7)
LAMB_PAST_SHARDS = 250000  # the first length a sums-asking variable's bit 3 gives


def lamb_code(value):
    """fuzz_lamb.c's 2-byte code (value_of) nearest below a positive value
    between 2^-8 and 2^8 (its numbers)."""
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2^exponent, 0.5 <= m < 1
    e = max(0, min(15, exponent - 1 + 8))
    return e << 11 | int((value / 2.0 ** (e - 8) - 1) * 2048) & 2047


LAMB_DEFAULT = [0.1, 0.00390625, 0.00390625, 0.25, 0.0078125]


def lamb_sparse(n, row_length, slices, fault=0, null_grad=False, order=0, choice=0,
                ragged=False):
    """A sparse gradient's 4 header bytes in fuzz_lamb.c's layout for a
    variable of n elements: rows of row_length (ragged: taken as it is,
    0 to 63, else one of n's divisors), `slices` slices."""
    if ragged:
        shape = 0xC0 | row_length
    elif n == 0:
        shape = row_length - 1
    else:
        shape = [d for d in range(1, n + 1) if n % d == 0].index(row_length)
    rows = n // row_length if row_length else 0
    assert shape < 256 and slices < 2 * rows + 2
    how = fault | null_grad << 3 | order << 4 | choice << 6
    return bytes([shape]) + struct.pack("<H", slices) + bytes([how])


def encode_lamb(lengths, unscale=LAMB_DIVIDE, scale=0x40400000, flags=0, lib_threads=1,
                fault=0, wild=False, raw=False, cuts=(), reverse=False, numbers=None,
                data=b"", termed=(), term_on_m=False, decay=None, bad_decay=False,
                sparse=None, sums=None):
    """sparse: {variable: its lamb_sparse bytes} for the sparse gradients;
    sums: {variable: (eigen_threads, fault, choice)} for the variables that
    ask for their sums (the configuration takes the first one's threads; a
    length from LAMB_PAST_SHARDS on takes the sums' own length form, and
    lengths from 1,100 to 65,535 have none)."""
    sparse = sparse or {}
    sums = sums or {}
    terms = sum(1 << (4 + i) for i in termed)
    out = bytearray([unscale | flags | (lib_threads - 1) << 5 | raw << 7,
                     len(lengths) | fault << 2 | wild << 5 | (decay is not None) << 6
                     | bad_decay << 7,
                     len(cuts) | reverse << 3 | terms | term_on_m << 7])
    out += struct.pack("<I", scale)
    for n in (numbers or [lamb_code(x) for x in LAMB_DEFAULT]) + list(decay or ()):
        out += struct.pack("<I", n)
    out += struct.pack("<7I", *(list(cuts) + [0] * (7 - len(cuts))))
    for i, n in enumerate(lengths):
        cls, l = (0, n) if n < 64 else (1, n) if n < 1100 else (2, n - 65536)
        if i in sums:
            threads, fault, choice = sums[i]
            past = n >= LAMB_PAST_SHARDS
            if past:
                cls, l = (n - LAMB_PAST_SHARDS) % 4, (n - LAMB_PAST_SHARDS) // 4
            assert 1 <= threads <= 4 and l < 65536
            assert past or n < 1100 or 65536 <= n < 65536 + 70000
            ask = LAMB_SUMS_KEY << 4 | (threads - 1) | (i in sparse) << 2 | past << 3
            out += bytes([cls | LAMB_SUMS_MARK << 2]) + struct.pack("<H", l)
            out += bytes([ask, fault | choice << 3]) + sparse.get(i, b"")
        elif i in sparse:
            out += bytes([cls | LAMB_SPARSE_MARK << 2]) + struct.pack("<H", l) + sparse[i]
        else:
            out += bytes([cls]) + struct.pack("<H", l)
    return bytes(out) + data


def lamb_seeds():
    rng = random.Random(20261207)
    def content(lengths, specials=0.0):
        return norm_codes(rng, min(3 * sum(lengths), 3000), specials=specials)
    for k, n in enumerate([0, 1, 7, 8, 9, 17, 63, 1099, 65536, 65536 + 65535]):
        flags = LAMB_FLUSH if k % 2 else 0
        yield (f"length-{n}-f{k % 2}", encode_lamb([n], flags=flags, lib_threads=1 + k % 4,
                                                 data=content([n])))
    mixed = [100, 65600, 33]
    for reverse in (False, True):
        yield (f"mixed-cuts-r{int(reverse)}",
               encode_lamb(mixed, flags=LAMB_FLUSH, lib_threads=4,
                           cuts=(0, 1, 99, 100, 101, 65700, 10 ** 9), reverse=reverse,
                           data=content(mixed)))
    small = [33, 9]
    for e in (-149, -127, -9, 0, 20, 126, 128):
        for flags in (0, LAMB_FLUSH):
            yield (f"scale-pow2-{e}-f{flags // LAMB_FLUSH}",
                   encode_lamb(small, LAMB_DIVIDE_POW2, e + 149, flags, data=content(small)))
    for name, bits in (("zero", 0), ("nan", 0x7FC00000), ("neg", 0xC0000000),
                       ("subnormal", 0x00012345), ("three", 0x40400000)):
        yield (f"scale-{name}", encode_lamb(small, LAMB_DIVIDE, bits, LAMB_FLUSH,
                                            data=content(small)))
    yield ("unscale-none", encode_lamb(small, LAMB_NONE, data=content(small)))
    for i, special in enumerate((0xFE00, 0xFE02, 0xFE08, 0xFE0B)):
        numbers = [lamb_code(x) for x in LAMB_DEFAULT]
        numbers[i % 5] = special
        numbers[(i + 3) % 5] = special
        yield (f"numbers-special-{i}", encode_lamb(small, numbers=numbers, wild=True,
                                                   data=content(small)))
    yield ("numbers-raw", encode_lamb(small, raw=True, numbers=[rng.getrandbits(32)
                                                                 for _ in range(5)],
                                      data=bytes(rng.getrandbits(8) for _ in range(2048))))
    for flags in (0, LAMB_FLUSH, LAMB_CALLER_FLUSH, LAMB_FLUSH | LAMB_CALLER_FLUSH):
        yield (f"specials-f{flags}", encode_lamb(small, flags=flags, wild=True,
                                                 data=content(small, specials=0.3)))
    yield ("u-is-grad", encode_lamb([65536 + 31, 17], fault=LAMB_FAULTS["u_is_grad"],
                                    lib_threads=2, data=content([600, 17])))
    yield ("no-variables", encode_lamb([]))
    for fault, number in LAMB_FAULTS.items():
        if fault != "u_is_grad":
            yield (f"fault-{fault}", encode_lamb(small, fault=number, data=content(small)))
    yield ("fault-null_m-empty", encode_lamb([0, 9], fault=LAMB_FAULTS["null_m"],
                                             data=content([9])))
    yield ("unknown-flag", encode_lamb(small, flags=LAMB_UNKNOWN_FLAG | LAMB_FLUSH,
                                       data=content(small)))
    yield ("unknown-unscale", encode_lamb(small, LAMB_UNKNOWN, data=content(small)))
    # Variables given a term (a sparse gradient densified, with its squares).
    three = [40, 65600, 9]
    for termed in ((0,), (1,), (0, 2), (0, 1, 2)):
        name = "".join(str(i) for i in termed)
        for unscale in (LAMB_DIVIDE, LAMB_NONE):
            yield (f"term-{name}-u{unscale}",
                   encode_lamb(three, unscale, flags=LAMB_FLUSH, lib_threads=2, termed=termed,
                               cuts=(3, 41, 65641), data=content([40 * 4, 4000, 9 * 4])))
    yield ("term-specials", encode_lamb(small, termed=(0, 1), wild=True,
                                        data=content([33 * 4, 9 * 4], specials=0.3)))
    yield ("term-u-is-grad", encode_lamb(small, termed=(0,), fault=LAMB_FAULTS["u_is_grad"],
                                         data=content([33 * 4, 9 * 4])))
    yield ("term-on-m", encode_lamb(small, termed=(0,), term_on_m=True, data=content(small)))
    yield ("term-on-m-empty", encode_lamb([0, 9], termed=(0,), term_on_m=True,
                                          data=content([9])))
    # Variables decayed in the pass, by each form (weight decay, learning rate).
    for k, (wd, lr) in enumerate(((0.01, 0.005), (0.05, 0.37), (1.5, 2.0))):
        for termed in ((), (1,)):
            yield (f"decay-{k}-t{len(termed)}",
                   encode_lamb(three, flags=LAMB_FLUSH, lib_threads=2, termed=termed,
                               cuts=(5, 40, 70000), decay=(lamb_code(wd), lamb_code(lr)),
                               data=content([40 * 5, 4000, 9 * 5])))
    yield ("decay-specials", encode_lamb(small, wild=True, decay=(0xFE00, 0xFE08),
                                         data=content([33 * 5, 9 * 5], specials=0.3)))
    yield ("decay-unknown", encode_lamb(small, decay=(lamb_code(0.01), lamb_code(0.1)),
                                        bad_decay=True, data=content(small)))
    yield ("decay-unknown-empty", encode_lamb([0, 9], decay=(lamb_code(0.01), lamb_code(0.1)),
                                              bad_decay=True, data=content([9])))
    # Sparse gradients: rows of 1 to 48 elements, fewer slices than rows and
    # more (so repeated), each unscale, flushing on and off.
    for k, (row_length, slices) in enumerate(((1, 97), (3, 5), (8, 13), (48, 3))):
        for unscale, scale in ((LAMB_DIVIDE, 0x40400000), (LAMB_DIVIDE_POW2, 149 + 10),
                               (LAMB_NONE, 0)):
            yield (f"sparse-rows-{row_length}-u{unscale}",
                   encode_lamb([48], unscale, scale, LAMB_FLUSH if k % 2 else 0,
                               sparse={0: lamb_sparse(48, row_length, slices)},
                               data=content([3 * 48])))
    for order in range(4):
        yield (f"sparse-order-{order}",
               encode_lamb([60], lib_threads=2, cuts=(7, 30),
                           sparse={0: lamb_sparse(60, 4, 31, order=order)},
                           data=content([3 * 60])))
    for null_grad in (False, True):
        yield (f"sparse-no-slices-g{int(null_grad)}",
               encode_lamb([33], sparse={0: lamb_sparse(33, 3, 0, null_grad=null_grad)},
                           data=content([66])))
    yield ("sparse-length-0", encode_lamb([0, 9], sparse={0: lamb_sparse(0, 2, 1)},
                                          data=content([9])))
    # Rows across the gather's blocks of 4096 and the threads' shares: rows
    # of 3 (a block ends inside one), of 5000 (one spans two blocks) and
    # of 1, with many slices.
    for name, n, row_length, slices in (("rows-3", 65538, 3, 30000),
                                        ("rows-5000", 70000, 5000, 29),
                                        ("rows-1", 65536 + 999, 1, 50000)):
        yield (f"sparse-big-{name}",
               encode_lamb([n], flags=LAMB_FLUSH, lib_threads=4, cuts=(4095, 4097, 40000),
                           sparse={0: lamb_sparse(n, row_length, slices)},
                           data=content([3000])))
    # Dense and sparse variables together, decayed, the host's pieces.
    mixed = [40, 65600, 9]
    for reverse in (False, True):
        yield (f"sparse-mixed-r{int(reverse)}",
               encode_lamb(mixed, flags=LAMB_FLUSH, lib_threads=3, cuts=(3, 41, 4137, 65641),
                           reverse=reverse, decay=(lamb_code(0.01), lamb_code(0.005)),
                           sparse={1: lamb_sparse(65600, 41, 2000, order=1),
                                   2: lamb_sparse(9, 3, 7, order=3)},
                           data=content([3000])))
    for flags in (0, LAMB_FLUSH, LAMB_CALLER_FLUSH):
        yield (f"sparse-specials-f{flags}",
               encode_lamb([24, 9], flags=flags, wild=True,
                           sparse={0: lamb_sparse(24, 2, 20), 1: lamb_sparse(9, 1, 12)},
                           data=content([200], specials=0.3)))
    yield ("sparse-raw", encode_lamb([24], raw=True, sparse={0: lamb_sparse(24, 4, 9)},
                                     data=bytes(rng.getrandbits(8) for _ in range(1024))))
    # Refusals: a row length that does not divide, or 0 (and one that does).
    for row_length in (0, 5, 6):
        yield (f"sparse-ragged-{row_length}",
               encode_lamb([48], sparse={0: lamb_sparse(48, row_length, 3 if row_length else 1,
                                                         ragged=True)},
                           data=content([100])))
    # Each fault of a sparse gradient's own, by each choice; with slices and
    # (where that makes it valid) without.
    small = [33, 12]
    for fault, number in LAMB_SPARSE_FAULTS.items():
        choices = range(4) if fault in ("u_over", "index_high", "index_negative",
                                        "on_other") else (0,)
        decay = (lamb_code(0.01), lamb_code(0.1)) if fault == "on_other" else None
        for choice in choices:
            yield (f"sparse-fault-{fault}-{choice}",
                   encode_lamb(small, decay=decay,
                               sparse={0: lamb_sparse(33, 11, 4),
                                       1: lamb_sparse(12, 3, 6, fault=number, choice=choice)},
                               data=content([150])))
        yield (f"sparse-fault-{fault}-no-slices",
               encode_lamb(small, decay=decay,
                           sparse={1: lamb_sparse(12, 3, 0, fault=number)},
                           data=content([100])))
    # The target's faults on a sparse gradient's variable, with slices and
    # without; a term.
    for fault in ("null_grad", "null_m", "u_on_m", "u_is_grad", "huge_length"):
        for slices in (0, 5):
            yield (f"sparse-{fault}-s{slices}",
                   encode_lamb(small, fault=LAMB_FAULTS[fault],
                               sparse={0: lamb_sparse(33, 3, slices)}, data=content([150])))
    yield ("sparse-term", encode_lamb(small, termed=(0,), sparse={0: lamb_sparse(33, 3, 5)},
                                      data=content([150])))
    yield ("sparse-term-on-m", encode_lamb(small, termed=(0,), term_on_m=True,
                                           sparse={0: lamb_sparse(33, 3, 5)},
                                           data=content([150])))
    yield ("sparse-decay-unknown", encode_lamb(small, decay=(lamb_code(0.01), lamb_code(0.1)),
                                               bad_decay=True,
                                               sparse={0: lamb_sparse(33, 3, 5)},
                                               data=content([150])))
    # The sums of the variable and of u (appended: the seeds above keep their
    # bytes).  Lengths within a leaf (8,192 values), from a thread's share
    # (65,536: eight leaves) on, each eigen_threads, the library's threads.
    for k, (n, threads) in enumerate(((0, 1), (1, 2), (31, 1), (33, 3), (1099, 4), (65536, 1),
                                      (65537, 2), (65536 + 8193, 2), (65536 + 32771, 3),
                                      (65536 + 65535, 4))):
        yield (f"sums-length-{n}-t{threads}",
               encode_lamb([n], flags=LAMB_FLUSH if k % 2 else 0, lib_threads=1 + k % 4,
                           sums={0: (threads, 0, 0)}, data=content([2 * n])))
    # Eigen's shards: 2 from 258,462 values at eigen_threads 2 or more, 3
    # from 381,539, 4 from 504,616; the host's cuts on and around leaf edges.
    for n, threads in ((250000, 4), (258461, 2), (258462, 2), (300001, 3), (381539, 3),
                       (450003, 4), (504616, 4), (512143, 2)):
        yield (f"sums-shards-{n}-t{threads}",
               encode_lamb([n], flags=LAMB_FLUSH, lib_threads=2,
                           cuts=(8191, 8192, 129231, n // 2 + 3, n - 1),
                           sums={0: (threads, 0, 0)}, data=content([1000])))
    yield ("sums-shards-decay",
           encode_lamb([400000, 33], flags=LAMB_FLUSH, lib_threads=3, cuts=(8193, 200003),
                       decay=(lamb_code(0.01), lamb_code(0.005)),
                       sums={0: (4, 0, 0), 1: (4, 0, 0)}, data=content([1000])))
    yield ("sums-shards-sparse",
           encode_lamb([504620], lib_threads=2, cuts=(4096, 252310),
                       sparse={0: lamb_sparse(504620, 20, 30000, order=2)},
                       sums={0: (4, 0, 0)}, data=content([1000])))
    # Several variables, the host's pieces in order and reversed, cut at
    # and beside the leaves' edges (the second's leaves hold 4,100 values).
    mixed = [100, 65600, 66000]
    for reverse in (False, True):
        yield (f"sums-mixed-r{int(reverse)}",
               encode_lamb(mixed, flags=LAMB_FLUSH, lib_threads=4,
                           cuts=(99, 100 + 4099, 100 + 4100, 100 + 4101, 100 + 32800,
                                 65700 + 8199, 10 ** 9), reverse=reverse,
                           sums={0: (2, 0, 0), 1: (3, 0, 0), 2: (1, 0, 0)},
                           data=content([3000])))
    yield ("sums-some", encode_lamb(mixed, lib_threads=2, cuts=(5000,),
                                    sums={1: (2, 0, 0)}, data=content([3000])))
    for unscale, scale in ((LAMB_NONE, 0), (LAMB_DIVIDE_POW2, 149 - 130)):
        yield (f"sums-unscale-{unscale}",
               encode_lamb([40, 9], unscale, scale, sums={0: (1, 0, 0), 1: (1, 0, 0)},
                           data=content([150])))
    # Decayed variables: the sums read the variable after its decay.
    three = [40, 65600, 9]
    for k, (wd, lr) in enumerate(((0.01, 0.005), (0.05, 0.37), (1.5, 2.0))):
        for termed in ((), (1,)):
            yield (f"sums-decay-{k}-t{len(termed)}",
                   encode_lamb(three, flags=LAMB_FLUSH, lib_threads=2, termed=termed,
                               cuts=(5, 40, 4140, 70000), decay=(lamb_code(wd), lamb_code(lr)),
                               sums={0: (2, 0, 0), 1: (2, 0, 0), 2: (2, 0, 0)},
                               data=content([40 * 5, 4000, 9 * 5])))
    # Sparse gradients with sums.
    for k, (row_length, slices) in enumerate(((1, 97), (3, 5), (8, 13), (48, 3))):
        yield (f"sums-sparse-rows-{row_length}",
               encode_lamb([48], flags=LAMB_FLUSH if k % 2 else 0,
                           sparse={0: lamb_sparse(48, row_length, slices)},
                           sums={0: (1 + k % 4, 0, 0)}, data=content([3 * 48])))
    for name, n, row_length, slices in (("rows-3", 65538, 3, 30000),
                                        ("rows-5000", 70000, 5000, 29)):
        yield (f"sums-sparse-big-{name}",
               encode_lamb([n], flags=LAMB_FLUSH, lib_threads=4, cuts=(4095, 4097, 8192, 40000),
                           sparse={0: lamb_sparse(n, row_length, slices)},
                           sums={0: (2, 0, 0)}, data=content([3000])))
    for reverse in (False, True):
        yield (f"sums-sparse-mixed-r{int(reverse)}",
               encode_lamb(three, flags=LAMB_FLUSH, lib_threads=3, cuts=(3, 41, 4137, 65641),
                           reverse=reverse, decay=(lamb_code(0.01), lamb_code(0.005)),
                           sparse={1: lamb_sparse(65600, 41, 2000, order=1),
                                   2: lamb_sparse(9, 3, 7, order=3)},
                           sums={0: (3, 0, 0), 1: (3, 0, 0), 2: (3, 0, 0)},
                           data=content([3000])))
    for null_grad in (False, True):
        yield (f"sums-sparse-no-slices-g{int(null_grad)}",
               encode_lamb([33], sparse={0: lamb_sparse(33, 3, 0, null_grad=null_grad)},
                           sums={0: (1, 0, 0)}, data=content([99])))
    yield ("sums-sparse-u-past-slices",
           encode_lamb([33, 12], sparse={1: lamb_sparse(12, 3, 6, fault=1, choice=2)},
                       sums={0: (1, 0, 0), 1: (1, 0, 0)}, data=content([150])))
    yield ("sums-u-is-grad", encode_lamb([65536 + 31, 17], fault=LAMB_FAULTS["u_is_grad"],
                                         lib_threads=2, sums={0: (2, 0, 0), 1: (1, 0, 0)},
                                         data=content([600, 17])))
    # Special values (squares subnormal or underflowing, inf, NaN), flushing
    # by the flags and by the caller; raw bits.
    for flags in (0, LAMB_FLUSH, LAMB_CALLER_FLUSH, LAMB_FLUSH | LAMB_CALLER_FLUSH):
        yield (f"sums-specials-f{flags}",
               encode_lamb([33, 9], flags=flags, wild=flags != LAMB_FLUSH,
                           sums={0: (1, 0, 0), 1: (1, 0, 0)},
                           data=content([33 * 3, 27], specials=0.3)))
    yield ("sums-raw", encode_lamb([33, 9], raw=True, numbers=[rng.getrandbits(32)
                                                               for _ in range(5)],
                                   sums={0: (1, 0, 0), 1: (2, 0, 0)},
                                   data=bytes(rng.getrandbits(8) for _ in range(2048))))
    # The sums' faults, by each choice, the variable decayed and not (its
    # weights then unread): the second variable's, given a term.
    small = [33, 12]
    decay = (lamb_code(0.01), lamb_code(0.1))
    for fault, number in LAMB_SUMS_FAULTS.items():
        choices = range(4) if fault in ("on_m", "on_u", "on_grad", "weights_on") else (0,)
        for choice in choices:
            for decayed in (False, True):
                yield (f"sums-fault-{fault}-{choice}-d{int(decayed)}",
                       encode_lamb(small, termed=(1,), decay=decay if decayed else None,
                                   sums={0: (1, 0, 0), 1: (2, number, choice)},
                                   data=content([33 * 5, 12 * 6])))
        # on a variable of length 0 (its sums {0, 0}, whatever the fault)
        yield (f"sums-fault-{fault}-empty",
               encode_lamb([0, 9], sums={0: (1, number, 1)}, data=content([9])))
    yield ("sums-no-threads-all-empty",
           encode_lamb([0, 0], sums={0: (1, 0, 0), 1: (1, LAMB_SUMS_FAULTS["no_threads"], 0)}))
    # on a sparse gradient's slices, and on one with none (then apart)
    for slices in (0, 6):
        for choice in (0, 1):
            yield (f"sums-fault-on_grad-sparse-s{slices}-{choice}",
                   encode_lamb(small, sparse={1: lamb_sparse(12, 3, slices)},
                               sums={1: (1, LAMB_SUMS_FAULTS["on_grad"], choice)},
                               data=content([150])))
    yield ("sums-fault-weights_on-sparse",
           encode_lamb(small, sparse={1: lamb_sparse(12, 3, 6)},
                       sums={1: (1, LAMB_SUMS_FAULTS["weights_on"], 3)}, data=content([150])))
    yield ("sums-fault-weights_on-u-is-grad",
           encode_lamb(small, fault=LAMB_FAULTS["u_is_grad"],
                       sums={0: (1, LAMB_SUMS_FAULTS["weights_on"], 3)}, data=content([150])))
    # Calls refused for another reason: the sums keep their bits too.
    for fault in ("null_config", "null_params", "null_m", "u_on_m", "huge_length"):
        yield (f"sums-other-{fault}", encode_lamb(small, fault=LAMB_FAULTS[fault],
                                                  sums={0: (1, 0, 0), 1: (1, 0, 0)},
                                                  data=content([150])))
    yield ("sums-unknown-flag", encode_lamb(small, flags=LAMB_UNKNOWN_FLAG,
                                            sums={0: (1, 0, 0)}, data=content([150])))
    yield ("sums-unknown-unscale", encode_lamb(small, LAMB_UNKNOWN, sums={1: (1, 0, 0)},
                                               data=content([150])))


def main():
    for sub, generate in (("core", seeds), ("scale_rule", rule_seeds), ("norms", norm_seeds),
                          ("optim", optim_seeds), ("adafactor", adafactor_seeds),
                          ("lamb", lamb_seeds)):
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
