/*
 * The AArch64 Advanced SIMD (NEON) kernel set: the vector bodies
 * (kernels_body.h) on 128-bit vectors (simd_neon.h).  NEON has no masked
 * loads or stores, so the ragged ends of a buffer are the scalar
 * reference element by element.
 */
#include "simd_neon.h"
#include "kernels_body.h"
