/* Placeholder until the avx512 kernels land: the scalar set under another name. */
#include "kernels.h"
const ls_kernel_set ls_kernels_avx512 = {
    "avx512",
    {NULL, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL},
};
