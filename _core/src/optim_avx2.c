/*
 * The fused optimizer kernels on AVX2 + F16C: optim_body.h on eight
 * float32 lanes (simd_x86.h).
 */
#include "optim.h"

#define LS_X86_BITS 256
#include "simd_x86.h"
#include "optim_body.h"
