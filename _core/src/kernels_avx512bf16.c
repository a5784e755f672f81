/*
 * The AVX-512 kernel set for CPUs with AVX512_BF16 too: the avx512 set
 * (kernels_avx512.c) with bfloat16 results rounded by VCVTNE2PS2BF16, two
 * vectors of float32 products to one of bfloat16 in one instruction, except
 * in IEEE mode on a vector that holds a subnormal product (see
 * kernels_avx512.h).  dispatch.c picks it only on a CPU with AVX512_BF16.
 */
#include "kernels_avx512.h"

static int unscale_bf16_avx512bf16(const void *src, void *dst, size_t n, double inv,
                                   unsigned flags)
{
    const uint16_t *x = (const uint16_t *)src;
    uint16_t *y = (uint16_t *)dst;
    const float s = (float)inv;
    const int check_inputs = (flags & LS_CHECK_INPUTS) != 0;
    if (flags & LS_FLUSH_DENORMALS)
        return check_inputs ? unscale_bf16_run(x, y, n, s, 1, BF16_CVTNE)
                            : unscale_bf16_run(x, y, n, s, 0, BF16_CVTNE);
    return check_inputs ? unscale_bf16_run(x, y, n, s, 1, BF16_CVTNE_GUARD)
                        : unscale_bf16_run(x, y, n, s, 0, BF16_CVTNE_GUARD);
}

const ls_kernel_set ls_kernels_avx512bf16 = {
    {ls_avx512_check_f16, ls_avx512_check_bf16, ls_avx512_check_f32, ls_avx512_check_f64},
    {ls_avx512_unscale_f16, unscale_bf16_avx512bf16, ls_avx512_unscale_f32,
     ls_avx512_unscale_f64},
};
