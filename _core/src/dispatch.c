/*
 * Kernel-set selection.  One table lists every kernel set the library
 * knows, best first, each with the CPU features it needs; the set in use
 * is the first entry whose features this CPU reports, chosen lazily on
 * first use, unless the environment variable LOSSSCALE_SIMD names another
 * one the CPU runs (a later entry: it may only lower).  A request for a
 * set the CPU cannot run is an error that every entry point reports
 * (LS_ERR_SIMD) instead of a silent fallback, so that a test or a bug
 * report forcing a level is never lied to.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "optim.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define LS_X86 1
#include <cpuid.h>
#endif

/* CPU features a kernel set can need (the OS saving the registers
 * included). */
enum {
    CPU_AVX2 = 1u << 0,       /* AVX2 + F16C, YMM state */
    CPU_AVX512 = 1u << 1,     /* AVX-512 F/DQ/BW/VL, opmask + ZMM state */
    CPU_AVX512BF16 = 1u << 2, /* AVX512_BF16 */
    CPU_NEON = 1u << 3,       /* AArch64 Advanced SIMD */
};

/*
 * The kernel sets, best first (kernel_sets.def).  Every entry is listed on
 * every machine so that LOSSSCALE_SIMD can name any of them; a set not
 * built for this architecture has no kernels and needs a feature no CPU of
 * it reports.  Each kernel family has its column: the unscale/check
 * kernels (kernels_<set>.c) and the fused optimizer updates
 * (optim_<set>.c).
 */
typedef struct impl {
    const char *name;
    unsigned needs; /* CPU_* */
    const ls_kernel_set *kernels;
    const ls_optim_kernels *optim;
} impl;

static const impl impls[] = {
#define LS_KERNEL_SET(name, arch, needs, unscale, optim, flags)                    \
    {#name, needs, LS_BUILT_##arch(&ls_kernels_##unscale, NULL),                   \
     LS_BUILT_##arch(&ls_optim_##optim, NULL)},
#include "kernel_sets.def"
#undef LS_KERNEL_SET
};
enum { NUM_IMPLS = sizeof impls / sizeof impls[0] };

#ifdef LS_X86
static uint64_t read_xcr0(void)
{
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static unsigned detect_x86(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && f16c))
        return 0;
    const uint64_t xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) /* OS saves XMM and YMM state */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    const int avx2 = (b >> 5) & 1;
    const int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1;
    const int avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    if (!avx2)
        return 0;
    unsigned found = CPU_AVX2;
    if (!(avx512f && avx512dq && avx512bw && avx512vl && (xcr0 & 0xe6) == 0xe6)) /* opmask + ZMM state */
        return found;
    found |= CPU_AVX512;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1))
        found |= CPU_AVX512BF16;
    return found;
}
#endif

/* cpuid is slow (it traps in a virtual machine), so it is asked once. */
static unsigned cpu_features;
static ls_once_t features_once = LS_ONCE_INIT;

static void detect(void)
{
#if defined(LS_X86)
    cpu_features = detect_x86();
#elif defined(__aarch64__)
    cpu_features = CPU_NEON; /* Advanced SIMD is part of the AArch64 base ISA */
#else
    cpu_features = 0;
#endif
}

int ls_simd_count(void) { return NUM_IMPLS; }

const char *ls_simd_name(int level)
{
    if (level < 0 || level >= NUM_IMPLS)
        return "unknown";
    return impls[level].name;
}

int ls_simd_supported(int level)
{
    if (level < 0 || level >= NUM_IMPLS || impls[level].kernels == NULL)
        return 0;
    ls_once(&features_once, detect);
    return (cpu_features & impls[level].needs) == impls[level].needs;
}

const ls_kernel_set *ls_kernels_at(int level)
{
    return ls_simd_supported(level) ? impls[level].kernels : NULL;
}

const ls_optim_kernels *ls_optim_kernels_at(int level)
{
    return ls_simd_supported(level) ? impls[level].optim : NULL;
}

int ls_simd_best(void)
{
    int level = 0;
    while (!ls_simd_supported(level)) /* the last entry, scalar, always is */
        level++;
    return level;
}

/* Chosen once; a level or LS_ERR_SIMD. */
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
        level = -1;
        for (int i = 0; i < NUM_IMPLS; i++)
            if (strcmp(forced, impls[i].name) == 0)
                level = i;
        if (level < 0) {
            char names[128];
            size_t used = 0;
            for (int i = 0; i < NUM_IMPLS && used < sizeof names; i++)
                used += (size_t)snprintf(names + used, sizeof names - used, "%s%s",
                                         i ? ", " : "", impls[i].name);
            snprintf(simd_error, sizeof simd_error,
                     "LOSSSCALE_SIMD=%s is not a kernel set; use one of "
                     "%s (this CPU supports up to %s)",
                     forced, names, impls[best].name);
            level = LS_ERR_SIMD;
        } else if (!ls_simd_supported(level)) {
            snprintf(simd_error, sizeof simd_error,
                     "LOSSSCALE_SIMD=%s asks for a kernel set this CPU cannot run "
                     "(it supports up to %s)",
                     forced, impls[best].name);
            level = LS_ERR_SIMD;
        }
    }
    chosen_set = level >= 0 ? impls[level].kernels : NULL;
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
