/*
 * Kernel-set selection: a priority-ordered list of sets, chosen lazily on
 * first use from cpuid, which the environment variable LOSSSCALE_SIMD may
 * only lower.  A request for a set the CPU cannot run is an error that
 * every entry point reports (LS_ERR_SIMD) instead of a silent fallback, so
 * that a test or a bug report forcing a level is never lied to.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define LS_X86 1
#include <cpuid.h>
#endif

static const char *const level_names[] = {"scalar", "neon", "avx2", "avx512"};

const char *ls_simd_name(int level)
{
    if (level < 0 || level > LS_SIMD_AVX512)
        return "unknown";
    return level_names[level];
}

#ifdef LS_X86
static uint64_t read_xcr0(void)
{
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int detect_x86(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return LS_SIMD_SCALAR;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && f16c))
        return LS_SIMD_SCALAR;
    const uint64_t xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) /* OS saves XMM and YMM state */
        return LS_SIMD_SCALAR;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return LS_SIMD_SCALAR;
    const int avx2 = (b >> 5) & 1;
    const int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1;
    const int avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    if (!avx2)
        return LS_SIMD_SCALAR;
    if (avx512f && avx512dq && avx512bw && avx512vl && (xcr0 & 0xe6) == 0xe6) /* opmask + ZMM state */
        return LS_SIMD_AVX512;
    return LS_SIMD_AVX2;
}

int ls_cpu_has_avx512bf16(void)
{
    unsigned a, b, c, d;
    if (ls_simd_best() < LS_SIMD_AVX512)
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d))
        return 0;
    return (a >> 5) & 1;
}
#else
int ls_cpu_has_avx512bf16(void) { return 0; }
#endif

int ls_simd_best(void)
{
#if defined(LS_X86)
    return detect_x86();
#elif defined(__aarch64__)
    return LS_SIMD_NEON; /* Advanced SIMD is part of the AArch64 base ISA */
#else
    return LS_SIMD_SCALAR;
#endif
}

static const ls_kernel_set *set_for_level(int level)
{
    switch (level) {
#ifdef LS_X86
    case LS_SIMD_AVX512:
        return &ls_kernels_avx512;
    case LS_SIMD_AVX2:
        return &ls_kernels_avx2;
#endif
#if defined(__aarch64__)
    case LS_SIMD_NEON:
        return &ls_kernels_neon;
#endif
    default:
        return &ls_kernels_scalar;
    }
}

/* Chosen once; a level number or LS_ERR_SIMD. */
static int chosen_level = -100;
static const ls_kernel_set *chosen_set;
static char simd_error[256];
static ls_once_t dispatch_once = LS_ONCE_INIT;

static void choose(void)
{
    const int best = ls_simd_best();
    const char *forced = getenv("LOSSSCALE_SIMD");
    int level = best;
    if (forced && *forced) {
        int wanted = -1;
        for (int i = 0; i <= LS_SIMD_AVX512; i++)
            if (strcmp(forced, level_names[i]) == 0)
                wanted = i;
        if (wanted < 0) {
            snprintf(simd_error, sizeof simd_error,
                     "LOSSSCALE_SIMD=%s is not a kernel set; use one of "
                     "scalar, neon, avx2, avx512 (this CPU supports up to %s)",
                     forced, level_names[best]);
            level = LS_ERR_SIMD;
        } else if (wanted != LS_SIMD_SCALAR &&
                   (wanted > best || (wanted == LS_SIMD_NEON) != (best == LS_SIMD_NEON))) {
            snprintf(simd_error, sizeof simd_error,
                     "LOSSSCALE_SIMD=%s asks for a kernel set this CPU cannot run "
                     "(it supports up to %s)",
                     forced, level_names[best]);
            level = LS_ERR_SIMD;
        } else {
            level = wanted;
        }
    }
    chosen_set = level >= 0 ? set_for_level(level) : NULL;
    chosen_level = level;
}

int ls_simd_level(void)
{
    ls_once(&dispatch_once, choose);
    return chosen_level;
}

const char *ls_simd_error(void)
{
    ls_once(&dispatch_once, choose);
    return simd_error;
}

const ls_kernel_set *ls_active_kernels(void)
{
    ls_once(&dispatch_once, choose);
    return chosen_set;
}
