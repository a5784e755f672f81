/*
 * The fused optimizer kernels, one element at a time: the reference of
 * optim.h as a kernel set, which every vector set is tested against.
 */
#include "optim.h"

static void sgd_scalar(const ls_param *p, size_t lo, size_t hi, const ls_optim_args *a)
{
    ls_sgd_elements(p, lo, hi, a);
}

static void adam_scalar(const ls_param *p, size_t lo, size_t hi, const ls_optim_args *a)
{
    ls_adam_elements(p, lo, hi, a);
}

const ls_optim_kernels ls_optim_scalar = {
    "scalar",
    {sgd_scalar, sgd_scalar, sgd_scalar, NULL},
    {adam_scalar, adam_scalar, adam_scalar, NULL},
};
