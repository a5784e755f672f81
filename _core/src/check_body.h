/*
 * The finite check of one buffer, written once over simd.h's vocabulary
 * and compiled by each kernel set's file.  Finiteness only looks at the
 * bits, so one loop serves every dtype, reading whole vectors of bytes;
 * simd.h's ls_note_magnitudes keeps the largest magnitude seen, so the
 * vector loop has no data-dependent branch but the early exit once per
 * 2 KiB block.  A head brings the reads to a vector boundary; the ragged
 * ends are masked vectors where the set has them, else single elements.
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

/* `len` bytes (a multiple of four vectors) from q noted into worst. */
LS_INLINE LS_VU LS_FN(check_bytes)(LS_VU worst, const char *q, size_t len, ls_dtype dt)
{
    for (size_t k = 0; k < len; k += 4 * LS_VBYTES)
        for (size_t j = 0; j < 4; j++)
            worst = ls_note_magnitudes(worst, vu_load(q + k + j * LS_VBYTES), dt);
    return worst;
}

/* Bytes [from, to) of p, less than one vector, noted into worst (masked)
 * or into *bad (one element at a time). */
LS_INLINE LS_VU LS_FN(check_edge)(LS_VU worst, int *bad, const char *p, size_t from, size_t to,
                                  ls_dtype dt)
{
#if LS_V_MASKED
    (void)bad;
    if (from < to)
        worst = ls_note_magnitudes(worst, vu_load_part(p + from, to - from), dt);
#else
    for (size_t b = from; b < to; b += ls_dtype_size(dt))
        *bad |= ls_nonfinite1(p + b, dt);
#endif
    return worst;
}

LS_INLINE int LS_FN(check_run)(const void *src, size_t n, ls_dtype dt)
{
    const char *p = (const char *)src;
    const size_t esize = ls_dtype_size(dt), bytes = n * esize;
    LS_VU worst = vu_zero();
    int bad = 0;
    size_t i = ls_elems_to_boundary(p, esize, LS_VBYTES, n) * esize;
    worst = LS_FN(check_edge)(worst, &bad, p, 0, i, dt);
    const size_t span = (bytes - i) / (CHECK_STREAMS * CHECK_BLOCK) * CHECK_BLOCK;
    if (span >= CHECK_MIN_SPAN) {
        for (size_t b = 0; b < span; b += CHECK_STEP) {
            for (size_t s = 0; s < CHECK_STREAMS; s++)
                worst = LS_FN(check_bytes)(worst, p + i + s * span + b, CHECK_STEP, dt);
            if (ls_any_nonfinite(worst, dt))
                return 0;
        }
        i += CHECK_STREAMS * span;
    }
    for (; bytes - i >= CHECK_BLOCK; i += CHECK_BLOCK) {
        worst = LS_FN(check_bytes)(worst, p + i, CHECK_BLOCK, dt);
        if (ls_any_nonfinite(worst, dt))
            return 0;
    }
    for (; bytes - i >= LS_VBYTES; i += LS_VBYTES)
        worst = ls_note_magnitudes(worst, vu_load(p + i), dt);
    worst = LS_FN(check_edge)(worst, &bad, p, i, bytes, dt);
    return !bad && !ls_any_nonfinite(worst, dt);
}

#endif /* LOSSSCALE_CHECK_BODY_H */
