/*
 * The AVX-512 kernel set (F/DQ/BW/VL): the vector bodies (kernels_body.h)
 * on 512-bit vectors (simd_x86.h), the ragged ends of a buffer as masked
 * loads and stores.  Its kernels serve the avx512bf16 set too
 * (kernels_avx512bf16.c), which only has a bfloat16 kernel of its own.
 */
#include "kernels_avx512.h"

#define LS_KERNEL_LINKAGE /* external: kernels_avx512bf16.c's table */
#include "kernels_body.h"
