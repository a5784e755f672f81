# cython: language_level=3
"""numpy bindings of the C core: validate in Python, then one nogil call.

Every argument is checked before any buffer is touched, so a rejected call
leaves every array as it was.  See ``lossscale.core`` for the public names.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc, qsort

cimport numpy as cnp

import math
import numbers

import numpy as np

cnp.import_array()

cdef extern from "lossscale.h" nogil:
    ctypedef enum ls_dtype:
        LS_FLOAT16
        LS_BFLOAT16
        LS_FLOAT32
        LS_FLOAT64

    ctypedef struct ls_buffer:
        const void *src
        void *dst
        size_t length
        ls_dtype dtype

    enum:
        LS_FLUSH_DENORMALS
        LS_CHECK_INPUTS
        LS_OK
        LS_ERR_ARG
        LS_ERR_DTYPE
        LS_ERR_SIMD

    int ls_simd_count()
    const char *ls_simd_name(int level)
    int ls_simd_supported(int level)
    int ls_simd_level()
    int ls_simd_best()
    const char *ls_simd_error()
    void ls_set_num_threads(int n)
    int ls_get_num_threads()
    double ls_round_to_dtype(double value, ls_dtype dtype)
    int ls_unscale(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags)
    int ls_all_finite(const ls_buffer *bufs, size_t count, unsigned flags)

    ctypedef struct ls_scale_config:
        int rule
        int64_t increment_period
        float multiplier
        float backoff_factor
        float min_loss_scale
        float max_loss_scale
        int64_t hysteresis

    ctypedef struct ls_scale_state:
        float scale
        int64_t good_steps
        int64_t overflow_run
        int64_t skipped_steps

    void ls_scale_config_default(ls_scale_config *config, int rule)
    int ls_scale_config_check(const ls_scale_config *config, const char **why)
    int ls_scale_update(const ls_scale_config *config, ls_scale_state *state, int grads_finite)


def _dtype_codes():
    import ml_dtypes
    return {
        np.dtype(np.float16): LS_FLOAT16,
        np.dtype(ml_dtypes.bfloat16): LS_BFLOAT16,
        np.dtype(np.float32): LS_FLOAT32,
        np.dtype(np.float64): LS_FLOAT64,
    }


_CODES = _dtype_codes()
_SUPPORTED = "float16, bfloat16 (ml_dtypes), float32, float64"


def _check_status(int rc):
    if rc >= 0:
        return
    if rc == LS_ERR_SIMD:
        raise RuntimeError(ls_simd_error().decode())
    if rc == LS_ERR_DTYPE:
        raise TypeError("unsupported dtype")
    raise ValueError("lossscale: invalid argument")


def simd_level():
    """The kernel set in use: ``"avx512bf16"``, ``"avx512"``, ``"avx2"``,
    ``"neon"`` or ``"scalar"``.

    Raises RuntimeError when ``LOSSSCALE_SIMD`` asks for a set this CPU
    cannot run (or names no set)."""
    cdef int level = ls_simd_level()
    _check_status(level)
    return ls_simd_name(level).decode()


def simd_best():
    """The best kernel set this CPU supports, ignoring ``LOSSSCALE_SIMD``."""
    return ls_simd_name(ls_simd_best()).decode()


def simd_levels(runnable=True):
    """The kernel sets, best first: those this CPU runs (what
    ``LOSSSCALE_SIMD`` may name), or with ``runnable=False`` every one the
    library knows."""
    return [ls_simd_name(i).decode() for i in range(ls_simd_count())
            if not runnable or ls_simd_supported(i)]


def set_num_threads(int n):
    """Threads used for large inputs; ``n <= 0`` restores the default (all cores)."""
    ls_set_num_threads(n)


def get_num_threads():
    """Threads used for large inputs."""
    return ls_get_num_threads()


def round_to_dtype(double value, dtype):
    """``value`` rounded to nearest-even in ``dtype`` (what unscale multiplies by)."""
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise TypeError(f"unsupported dtype {np.dtype(dtype)}; supported: {_SUPPORTED}")
    return ls_round_to_dtype(value, <ls_dtype>code)


def _as_list(arrays, what):
    if isinstance(arrays, np.ndarray):
        return [arrays]
    if isinstance(arrays, (list, tuple)):
        return list(arrays)
    raise TypeError(f"{what}: expected a numpy array or a list/tuple of numpy arrays, "
                    f"got {type(arrays).__name__}")


def _check_scale(inv_scale):
    if isinstance(inv_scale, (bool, np.bool_)) or not isinstance(inv_scale, numbers.Real):
        raise TypeError(f"unscale_: inv_scale must be a real number, got "
                        f"{type(inv_scale).__name__}")
    try:
        value = float(inv_scale)
    except OverflowError:  # e.g. an int beyond the float range
        raise ValueError(f"unscale_: inv_scale must be finite, got a value of type "
                         f"{type(inv_scale).__name__} too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"unscale_: inv_scale must be finite, got {value}")
    if value <= 0.0:
        raise ValueError(f"unscale_: inv_scale must be positive, got {value}")
    return value


cdef object _BF16 = np.dtype(__import__("ml_dtypes").bfloat16)


cdef int _dtype_code(cnp.ndarray a):
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT32:
        return LS_FLOAT32
    if t == cnp.NPY_FLOAT16:
        return LS_FLOAT16
    if t == cnp.NPY_FLOAT64:
        return LS_FLOAT64
    if a.dtype is _BF16 or a.dtype == _BF16:
        return LS_BFLOAT16
    return -1


cdef int _cmp_range(const void *x, const void *y) noexcept nogil:
    cdef const size_t *p = <const size_t *>x
    cdef const size_t *q = <const size_t *>y
    return (p[0] > q[0]) - (p[0] < q[0])


cdef Py_ssize_t _fill(list arrays, ls_buffer *bufs, str what, bint writable) except -1:
    """Checks every array and fills bufs with the non-empty ones; returns how
    many.  Raises before anything is modified."""
    cdef Py_ssize_t i, filled = 0, n = len(arrays)
    cdef cnp.ndarray a
    cdef int code
    for i in range(n):
        item = arrays[i]
        if not isinstance(item, cnp.ndarray):
            raise TypeError(f"{what}: item {i} is {type(item).__name__}, not a numpy array")
        a = <cnp.ndarray>item
        code = _dtype_code(a)
        if code < 0:
            raise TypeError(f"{what}: item {i} has unsupported dtype {a.dtype}; "
                            f"supported: {_SUPPORTED}")
        if not cnp.PyArray_ISNOTSWAPPED(a):
            # the kernels read native-endian values: a byte-swapped array would
            # be silently misread
            raise TypeError(f"{what}: item {i} has non-native byte order (dtype "
                            f"'{a.dtype.str}'); convert it with "
                            f"a.astype(a.dtype.newbyteorder('='))")
        if not cnp.PyArray_IS_C_CONTIGUOUS(a):
            raise ValueError(f"{what}: item {i} is not C-contiguous; pass "
                             f"np.ascontiguousarray(a) (unscale_ works in place, so it "
                             f"cannot write into a copy for you)")
        if writable and not cnp.PyArray_ISWRITEABLE(a):
            raise ValueError(f"{what}: item {i} is read-only")
        if cnp.PyArray_SIZE(a) == 0:
            # Nothing to check or scale: all() of nothing is True, as in numpy.
            continue
        bufs[filled].src = cnp.PyArray_DATA(a)
        bufs[filled].dst = cnp.PyArray_DATA(a)
        bufs[filled].length = <size_t>cnp.PyArray_SIZE(a)
        bufs[filled].dtype = <ls_dtype>code
        filled += 1
    return filled


cdef int _check_disjoint(ls_buffer *bufs, size_t n, str what) except -1:
    """The same memory twice in one unscale_ call would be scaled twice."""
    if n < 2:
        return 0
    cdef size_t *ranges = <size_t *>malloc(2 * n * sizeof(size_t))
    cdef size_t i, itemsize
    if ranges == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            itemsize = 2 if bufs[i].dtype <= LS_BFLOAT16 else (4 if bufs[i].dtype == LS_FLOAT32 else 8)
            ranges[2 * i] = <size_t>bufs[i].src
            ranges[2 * i + 1] = <size_t>bufs[i].src + bufs[i].length * itemsize
        qsort(ranges, n, 2 * sizeof(size_t), _cmp_range)
        for i in range(1, n):
            if ranges[2 * i] < ranges[2 * i - 1]:
                raise ValueError(f"{what}: two arrays in the list share memory; each "
                                 f"buffer may appear once")
    finally:
        free(ranges)
    return 0


cdef int _run(arrays, str what, double inv_scale, bint unscale, unsigned flags) except -10:
    cdef list items = _as_list(arrays, what)
    cdef size_t count = len(items)
    cdef ls_buffer *bufs = <ls_buffer *>malloc(max(count, 1) * sizeof(ls_buffer))
    cdef int rc
    if bufs == NULL:
        raise MemoryError()
    try:
        count = <size_t>_fill(items, bufs, what, unscale)
        if count == 0:
            return 1
        if unscale:
            _check_disjoint(bufs, count, what)
        with nogil:
            if unscale:
                rc = ls_unscale(bufs, count, inv_scale, flags)
            else:
                rc = ls_all_finite(bufs, count, flags)
        _check_status(rc)
        return rc
    finally:
        free(bufs)


def all_finite(arrays, *, bint flush_denormals=False):
    """True when every element of every array is finite.

    ``arrays``: one numpy array or a list/tuple of them (float16, bfloat16,
    float32, float64; C-contiguous).  Read-only arrays are fine; nothing at all
    (an empty list, zero-length arrays) is finite, as ``np.all`` of nothing is."""
    return bool(_run(arrays, "all_finite", 1.0, False,
                     LS_FLUSH_DENORMALS if flush_denormals else 0))


def unscale_(arrays, inv_scale, *, bint check_inputs=False, bint flush_denormals=False):
    """In place ``x = x * inv_scale`` for every array; True when every result is finite.

    ``inv_scale`` is first rounded to each array's dtype; float16 and
    bfloat16 are widened to float32, multiplied and rounded back to
    nearest-even, so results are bit-identical to numpy / ml_dtypes.
    ``check_inputs=True`` reports on the inputs instead of the results.
    ``flush_denormals=True`` computes as TensorFlow's CPU kernels do
    (subnormals flushed to zero).  Bad input raises TypeError/ValueError
    and leaves every array unchanged."""
    cdef double value = _check_scale(inv_scale)
    cdef unsigned flags = 0
    if check_inputs:
        flags |= LS_CHECK_INPUTS
    if flush_denormals:
        flags |= LS_FLUSH_DENORMALS
    return bool(_run(arrays, "unscale_", value, True, flags))


RULE_TF24 = 0
RULE_KERAS3 = 1


def scale_update(state, bint grads_finite, *, int rule=RULE_TF24, increment_period=2000,
                 multiplier=2.0, backoff_factor=None, min_loss_scale=1.0,
                 max_loss_scale=None, hysteresis=1):
    """One step of the loss-scale state machine of the C core.

    ``state``: a tuple ``(scale, good_steps, overflow_run, skipped_steps)``.
    Returns ``(new_state, should_apply)``.  Exposed for testing the C rule
    against TensorFlow's reference; the TensorFlow op calls the same code."""
    cdef ls_scale_config c
    cdef ls_scale_state s
    cdef const char *why
    ls_scale_config_default(&c, rule)
    c.increment_period = increment_period
    c.multiplier = multiplier
    c.backoff_factor = 0.0 if backoff_factor is None else backoff_factor
    c.min_loss_scale = min_loss_scale
    c.max_loss_scale = math.inf if max_loss_scale is None else max_loss_scale
    c.hysteresis = hysteresis
    if ls_scale_config_check(&c, &why) != LS_OK:
        raise ValueError(why.decode())
    s.scale, s.good_steps, s.overflow_run, s.skipped_steps = state
    cdef int apply = ls_scale_update(&c, &s, grads_finite)
    return (s.scale, s.good_steps, s.overflow_run, s.skipped_steps), bool(apply)
