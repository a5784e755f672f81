/*
 * The fused optimizer kernels, one element at a time: the reference of
 * each family (family_<name>.h) as a kernel set, which every vector set is
 * tested against.
 */
#include "optim.h"

#define LS_SCALAR_DEFINE(family)                                                           \
    static void family##_scalar(const ls_param *p, size_t lo, size_t hi,                   \
                                const ls_optim_args *a)                                    \
    {                                                                                      \
        ls_##family##_elements(p, lo, hi, a);                                              \
    }
LS_OPTIM_FAMILIES(LS_SCALAR_DEFINE)

static void slice_add_scalar(const void *src, size_t n, ls_dtype dt, const ls_optim_args *a,
                             float factor, int kind, float k, float *g, float *t)
{
    for (size_t c = 0; c < n; c++)
        ls_optim_slice_add1(src, c, dt, a, factor, kind, k, g, t);
}

#define LS_CAT2(a, b) a##b
#define LS_CAT(a, b) LS_CAT2(a, b)
#define LS_SET scalar
#define LS_KFN(name) LS_CAT(LS_CAT(ls_, LS_SET), _##name)
#include "adafactor_body.h"
#include "lamb_body.h"

#define LS_SCALAR_ROW(family) {family##_scalar, family##_scalar, family##_scalar, NULL},
const ls_optim_kernels ls_optim_scalar = {
    "scalar",
    {LS_OPTIM_FAMILIES(LS_SCALAR_ROW)},
    slice_add_scalar,
    LS_ADAFACTOR_LOOPS,
    LS_KFN(lamb),
};
