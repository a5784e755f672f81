/*
 * The fused optimizer kernels on AVX-512 F: optim_body.h on sixteen
 * float32 lanes (simd_x86.h).
 */
#include "optim.h"

#define LS_X86_BITS 512
#include "simd_x86.h"
#include "optim_body.h"
