/*
 * The AVX2 + F16C kernel set: the vector bodies (kernels_body.h) on
 * 256-bit vectors (simd_x86.h).  AVX2 has no masked byte loads or stores,
 * so the ragged ends of a buffer are the scalar reference element by
 * element, and no bfloat16 instruction, so bfloat16 rounds on the bits.
 */
#define LS_X86_BITS 256
#include "simd_x86.h"
#include "kernels_body.h"
