/*
 * The finite check of one buffer, written once over simd.h's vocabulary
 * and compiled by each kernel set's file.  Finiteness only looks at the
 * bits, so one loop serves every dtype, reading whole vectors of bytes;
 * simd.h's ls_note_magnitudes keeps the largest magnitude seen, so the
 * vector loop has no data-dependent branch but the early exit once per
 * 2 KiB block.  The ragged ends are masked vectors where the set has
 * them, else single elements.
 *
 * A large buffer is read as CHECK_STREAMS sequential streams, 512 bytes
 * of each in turn: a read-only pass is bound by the cache misses one core
 * keeps in flight, and the hardware prefetchers restart at every 4 KiB
 * page (TensorFlow's buffers are not on huge pages), so one stream leaves
 * bandwidth unused.  Measured on TensorFlow-allocated buffers (Xeon, 2
 * threads): 4 streams about 20% faster than 1; 8 no faster than 4.
 */
#ifndef LOSSSCALE_CHECK_BODY_H
#define LOSSSCALE_CHECK_BODY_H

#include "simd.h"

enum { CHECK_BLOCK = 2048, CHECK_STREAMS = 4, CHECK_STEP = CHECK_BLOCK / CHECK_STREAMS };
enum { CHECK_MIN_SPAN = 64 * 1024 }; /* bytes per stream before streams pay */

/* `len` bytes (a multiple of four vectors) from q noted into four
 * records, one per vector of a pass: one record alone would make the loop
 * wait on its every maximum. */
LS_INLINE void LS_FN(check_bytes)(LS_VU w[4], const char *q, size_t len, ls_dtype dt)
{
    for (size_t k = 0; k < len; k += 4 * LS_VBYTES)
        for (size_t j = 0; j < 4; j++)
            w[j] = ls_note_magnitudes(w[j], vu_load(q + k + j * LS_VBYTES), dt);
}

LS_INLINE LS_VU LS_FN(check_merge)(const LS_VU w[4], ls_dtype dt)
{
    return ls_merge_magnitudes(ls_merge_magnitudes(w[0], w[1], dt),
                               ls_merge_magnitudes(w[2], w[3], dt), dt);
}

/* Bytes [from, to) of p, less than one vector, noted into worst (a
 * masked load) or into *bad (one element at a time, where a set has no
 * masked loads: cheaper than simd.h's trip through the stack). */
LS_INLINE LS_VU LS_FN(check_edge)(LS_VU worst, int *bad, const char *p, size_t from, size_t to,
                                  ls_dtype dt)
{
    if (LS_V_MASKED) {
        if (from < to)
            worst = ls_note_magnitudes(worst, vu_load_part(p + from, to - from), dt);
        return worst;
    }
    for (size_t b = from; b < to; b += ls_dtype_size(dt))
        *bad |= ls_nonfinite1(p + b, dt);
    return worst;
}

LS_INLINE int LS_FN(check_run)(const void *src, size_t n, ls_dtype dt)
{
    const char *p = (const char *)src;
    const size_t esize = ls_dtype_size(dt), bytes = n * esize;
    LS_VU w[4] = {vu_zero(), vu_zero(), vu_zero(), vu_zero()};
    int bad = 0;
    size_t i = ls_head_bytes(p, n, dt);
    w[0] = LS_FN(check_edge)(w[0], &bad, p, 0, i, dt);
    const size_t span = (bytes - i) / (CHECK_STREAMS * CHECK_BLOCK) * CHECK_BLOCK;
    if (span >= CHECK_MIN_SPAN) {
        for (size_t b = 0; b < span; b += CHECK_STEP) {
            for (size_t s = 0; s < CHECK_STREAMS; s++)
                LS_FN(check_bytes)(w, p + i + s * span + b, CHECK_STEP, dt);
            if (ls_any_nonfinite(LS_FN(check_merge)(w, dt), dt))
                return 0;
        }
        i += CHECK_STREAMS * span;
    }
    for (; bytes - i >= CHECK_BLOCK; i += CHECK_BLOCK) {
        LS_FN(check_bytes)(w, p + i, CHECK_BLOCK, dt);
        if (ls_any_nonfinite(LS_FN(check_merge)(w, dt), dt))
            return 0;
    }
    LS_VU worst = LS_FN(check_merge)(w, dt);
    for (; bytes - i >= LS_VBYTES; i += LS_VBYTES)
        worst = ls_note_magnitudes(worst, vu_load(p + i), dt);
    worst = LS_FN(check_edge)(worst, &bad, p, i, bytes, dt);
    return !bad && !ls_any_nonfinite(worst, dt);
}

#endif /* LOSSSCALE_CHECK_BODY_H */
