/*
 * What the two AVX-512 kernel sets share: the vocabulary at 512 bits
 * (simd_x86.h) with the unscale body, and kernels_avx512.c's kernels,
 * which the avx512bf16 set reuses for everything but bfloat16 unscaling.
 * Its bfloat16 loop is unscale_bf16_run with VCVTNE2PS2BF16's rounding
 * (kernels_avx512bf16.c, the only file compiled with -mavx512bf16).
 */
#ifndef LOSSSCALE_KERNELS_AVX512_H
#define LOSSSCALE_KERNELS_AVX512_H

#define LS_X86_BITS 512
#include "simd_x86.h"
#include "unscale_body.h"

int ls_avx512_check_f16(const void *src, size_t n);
int ls_avx512_check_bf16(const void *src, size_t n);
int ls_avx512_check_f32(const void *src, size_t n);
int ls_avx512_check_f64(const void *src, size_t n);
int ls_avx512_unscale_f16(const void *src, void *dst, size_t n, double inv, unsigned flags);
int ls_avx512_unscale_bf16(const void *src, void *dst, size_t n, double inv, unsigned flags);
int ls_avx512_unscale_f32(const void *src, void *dst, size_t n, double inv, unsigned flags);
int ls_avx512_unscale_f64(const void *src, void *dst, size_t n, double inv, unsigned flags);

LS_INLINE int unscale_bf16_run(const uint16_t *x, uint16_t *y, size_t n, float inv,
                               int check_inputs, enum bf16_rounding rounding)
{
    return LS_FN(unscale_run)(x, y, n, inv, check_inputs, LS_BFLOAT16, rounding);
}

#endif /* LOSSSCALE_KERNELS_AVX512_H */
