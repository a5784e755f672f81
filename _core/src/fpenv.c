/*
 * Floating-point control state around a kernel call.  TensorFlow's CPU
 * kernels run with subnormals flushed (FTZ+DAZ on x86, FZ on AArch64);
 * numpy runs IEEE.  The caller says which one it wants and the state is
 * set explicitly either way, so a numpy call made from a thread that
 * TensorFlow left flushing still gets IEEE answers, and restored after.
 */
#include "internal.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define LS_FLUSH_BITS 0x8040u /* MXCSR: FTZ (bit 15) | DAZ (bit 6) */

void ls_fpenv_enter(ls_fpenv *env, int flush)
{
    unsigned csr = _mm_getcsr();
    env->saved = csr;
    unsigned want = flush ? (csr | LS_FLUSH_BITS) : (csr & ~LS_FLUSH_BITS);
    if (want != csr)
        _mm_setcsr(want);
}

void ls_fpenv_leave(const ls_fpenv *env)
{
    if (_mm_getcsr() != (unsigned)env->saved)
        _mm_setcsr((unsigned)env->saved);
}
#elif defined(__aarch64__)
#define LS_FPCR_FZ (1ul << 24)

void ls_fpenv_enter(ls_fpenv *env, int flush)
{
    unsigned long fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    env->saved = fpcr;
    unsigned long want = flush ? (fpcr | LS_FPCR_FZ) : (fpcr & ~LS_FPCR_FZ);
    if (want != fpcr)
        __asm__ volatile("msr fpcr, %0" : : "r"(want));
}

void ls_fpenv_leave(const ls_fpenv *env)
{
    unsigned long fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    if (fpcr != env->saved)
        __asm__ volatile("msr fpcr, %0" : : "r"(env->saved));
}
#else
/* Other targets: IEEE only; flushing is not emulated. */
void ls_fpenv_enter(ls_fpenv *env, int flush) { env->saved = 0; (void)flush; }
void ls_fpenv_leave(const ls_fpenv *env) { (void)env; }
#endif
