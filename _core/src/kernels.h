/*
 * The contract between the dispatcher and the per-ISA kernel files.
 *
 * Each kernel set (kernels_<set>.c; the list, with each set's flags and
 * the CPU features it needs, is kernel_sets.def) fills one ls_kernel_set,
 * which dispatch.c's table points at.  Only the per-ISA files are compiled with ISA flags;
 * the dispatcher touches a set only after cpuid said the CPU runs it.
 * The scalar set is the reference every other set is tested against, bit
 * for bit; its per-element arithmetic is the ls_unscale1_* below, which
 * the vector sets' heads and tails use too.
 *
 * A kernel sees one contiguous run of one buffer.  The caller has already
 * set the floating-point control state (FTZ/DAZ on or off, per
 * LS_FLUSH_DENORMALS), so hardware float arithmetic already gives the
 * required answer; a kernel only needs `flags` where an instruction ignores
 * that state (e.g. VCVTNEPS2BF16 always flushes subnormal inputs, which is
 * right under LS_FLUSH_DENORMALS and wrong without it).
 */
#ifndef LOSSSCALE_KERNELS_H
#define LOSSSCALE_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lossscale.h"

/* 1 when all n elements of src are finite, else 0.  May stop early. */
typedef int (*ls_check_fn)(const void *src, size_t n);

/*
 * dst[i] = round(src[i] * inv) for i < n; dst == src allowed.
 * `inv` is already rounded to the buffer's dtype (exact as a double).
 * float16/bfloat16: widen to float32, multiply in float32, round back
 * to nearest-even (NaN stays NaN, payload free).
 * Returns 1 when every result is finite (every input, with
 * LS_CHECK_INPUTS in flags), else 0.  Must process all n elements.
 */
typedef int (*ls_unscale_fn)(const void *src, void *dst, size_t n, double inv,
                             unsigned flags);

/* One set's kernels by dtype.  A NULL entry (a set written before a dtype
 * was added, say) means the scalar set's kernel runs instead. */
typedef struct ls_kernel_set {
    ls_check_fn check[LS_NUM_DTYPES];
    ls_unscale_fn unscale[LS_NUM_DTYPES];
} ls_kernel_set;

/* LS_BUILT_<arch>(x, otherwise): x where kernel_sets.def's `arch` is built,
 * else `otherwise`. */
#define LS_BUILT_ANY(x, otherwise) x
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define LS_BUILT_X86(x, otherwise) x
#else
#define LS_BUILT_X86(x, otherwise) otherwise
#endif
#if defined(__aarch64__)
#define LS_BUILT_ARM64(x, otherwise) x
#else
#define LS_BUILT_ARM64(x, otherwise) otherwise
#endif

/* ls_kernels_<set> of every set built here (kernel_sets.def). */
#define LS_KERNEL_SET(name, arch, needs, unscale, optim, flags) \
    LS_BUILT_##arch(extern const ls_kernel_set ls_kernels_##unscale;, )
#include "kernel_sets.def"
#undef LS_KERNEL_SET

/* Kernels that must be inlined into their loops (the vector sets pass
 * constants such as check_inputs that should specialise them). */
#define LS_INLINE static inline __attribute__((always_inline))

/* Elements before p reaches an `align`-byte boundary, at most n.  A pointer
 * that is not even aligned to its element size never gets there: none. */
static inline size_t ls_elems_to_boundary(const void *p, size_t esize, size_t align, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    if (a % esize)
        return 0;
    size_t k = ((align - a % align) % align) / esize;
    return k < n ? k : n;
}

/* Portable scalar conversions, shared by the scalar set and the tails of
 * the vector sets (the bit-exact reference for every rounding). */
float ls_f16_to_f32(uint16_t h);
uint16_t ls_f32_to_f16(float f);
float ls_bf16_to_f32(uint16_t h);
uint16_t ls_f32_to_bf16(float f);

/* A buffer need not be aligned to its element size (a numpy view may
 * start at any byte), and in C a load or store through a misaligned
 * pointer is undefined: a compiler may assume the alignment (an aligned
 * vector move after peeling, say) and fault.  Every element access outside
 * the vector intrinsics' explicitly unaligned loads goes through these,
 * which compile to plain moves. */
#define LS_DEFINE_LOAD(name, type)                                                         \
    static inline type ls_load_##name(const void *p)                                       \
    {                                                                                      \
        type v;                                                                            \
        memcpy(&v, p, sizeof v);                                                           \
        return v;                                                                          \
    }
LS_DEFINE_LOAD(u16, uint16_t)
LS_DEFINE_LOAD(u32, uint32_t)
LS_DEFINE_LOAD(u64, uint64_t)
LS_DEFINE_LOAD(f32, float)
LS_DEFINE_LOAD(f64, double)
#undef LS_DEFINE_LOAD

static inline void ls_store_u16(void *p, uint16_t v) { memcpy(p, &v, sizeof v); }
static inline void ls_store_f32(void *p, float v) { memcpy(p, &v, sizeof v); }
static inline void ls_store_f64(void *p, double v) { memcpy(p, &v, sizeof v); }

/* Element i of x, times s, rounded to the dtype, stored as element i of y:
 * the scalar reference's arithmetic, which the scalar set runs on every
 * element and the vector sets on their heads and tails.  Each returns 1
 * when the probed value (the input with check_inputs, else the result) is
 * not finite. */
#define LS_DEFINE_UNSCALE1_IEEE(name, type, bits, exponent)                                \
    static inline int ls_unscale1_##name(const void *x, void *y, size_t i, type s,         \
                                         int check_inputs)                                 \
    {                                                                                      \
        type in = ls_load_##name((const char *)x + sizeof(type) * i);                      \
        type out = in * s;                                                                 \
        type probe = check_inputs ? in : out;                                              \
        bits u;                                                                            \
        memcpy(&u, &probe, sizeof u);                                                      \
        ls_store_##name((char *)y + sizeof(type) * i, out);                                \
        return (u & exponent) == exponent;                                                 \
    }
LS_DEFINE_UNSCALE1_IEEE(f32, float, uint32_t, 0x7f800000u)
LS_DEFINE_UNSCALE1_IEEE(f64, double, uint64_t, 0x7ff0000000000000ull)
#undef LS_DEFINE_UNSCALE1_IEEE

/* The 16-bit dtypes: the product in float32, rounded back by the dtype's
 * own conversion. */
#define LS_DEFINE_UNSCALE1_16(name, exponent)                                              \
    static inline int ls_unscale1_##name(const void *x, void *y, size_t i, float s,        \
                                         int check_inputs)                                 \
    {                                                                                      \
        uint16_t in = ls_load_u16((const char *)x + 2 * i);                                \
        uint16_t out = ls_f32_to_##name(ls_##name##_to_f32(in) * s);                       \
        ls_store_u16((char *)y + 2 * i, out);                                              \
        return ((check_inputs ? in : out) & exponent) == exponent;                         \
    }
LS_DEFINE_UNSCALE1_16(f16, 0x7c00u)
LS_DEFINE_UNSCALE1_16(bf16, 0x7f80u)
#undef LS_DEFINE_UNSCALE1_16

#endif /* LOSSSCALE_KERNELS_H */
