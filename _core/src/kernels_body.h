/*
 * A vector set's unscale/check kernels by dtype and its table
 * (ls_kernels_<set>, kernels.h's ls_kernel_set): check_body.h and
 * unscale_body.h instantiated for each dtype, and for check_inputs on and
 * off so that each loop is compiled for its probe.  The kernels are static
 * unless the set's file defines LS_KERNEL_LINKAGE (the avx512 set's serve
 * avx512bf16 too).  bfloat16 is rounded on the bits here; a set that
 * rounds otherwise fills its own table.
 */
#include "check_body.h"
#include "unscale_body.h"

#ifndef LS_KERNEL_LINKAGE
#define LS_KERNEL_LINKAGE static
#endif

#define LS_KERNELS_OF(dtname, dt)                                                          \
    LS_KERNEL_LINKAGE int LS_KFN(check_##dtname)(const void *src, size_t n)                \
    {                                                                                      \
        return LS_FN(check_run)(src, n, dt);                                               \
    }                                                                                      \
    LS_KERNEL_LINKAGE int LS_KFN(unscale_##dtname)(const void *src, void *dst, size_t n,   \
                                                   double inv, unsigned flags)             \
    {                                                                                      \
        if (flags & LS_CHECK_INPUTS)                                                       \
            return LS_FN(unscale_run)(src, dst, n, inv, 1, dt, BF16_INTEGER);              \
        return LS_FN(unscale_run)(src, dst, n, inv, 0, dt, BF16_INTEGER);                  \
    }

LS_KERNELS_OF(f16, LS_FLOAT16)
LS_KERNELS_OF(bf16, LS_BFLOAT16)
LS_KERNELS_OF(f32, LS_FLOAT32)
LS_KERNELS_OF(f64, LS_FLOAT64)

const ls_kernel_set LS_CAT(ls_kernels_, LS_SET) = {
    {LS_KFN(check_f16), LS_KFN(check_bf16), LS_KFN(check_f32), LS_KFN(check_f64)},
    {LS_KFN(unscale_f16), LS_KFN(unscale_bf16), LS_KFN(unscale_f32), LS_KFN(unscale_f64)},
};
