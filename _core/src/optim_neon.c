/*
 * The fused optimizer kernels on AArch64 Advanced SIMD: optim_body.h on
 * four float32 lanes (simd_neon.h).
 */
#include "optim.h"

#include "simd_neon.h"
#include "optim_body.h"
