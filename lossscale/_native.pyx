# cython: language_level=3
"""numpy bindings of the C core: validate in Python, then one nogil call.

Every argument is checked before any buffer is touched, so a rejected call
leaves every array as it was.  See ``lossscale.core`` for the public names.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memset

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
        LS_ERR_MEMORY

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

    const float LS_DEFAULT_LOSS_SCALE
    const int LS_DEFAULT_INCREMENT_PERIOD

    void ls_scale_config_default(ls_scale_config *config, int rule)
    int ls_scale_config_check(const ls_scale_config *config, const char **why)
    int ls_scale_update(const ls_scale_config *config, ls_scale_state *state, int grads_finite)

    ctypedef struct ls_param:
        float *var
        const void *grad
        float *slot[3]
        size_t length
        ls_dtype grad_dtype
        int decay
        float clip_scalar
        const float *grad_term
        float *average
        const int64_t *indices
        size_t slices
        size_t row_length
        float *accumulator

    enum:
        LS_OPTIM_MAX_HYPER

    ctypedef struct ls_optim_config:
        int family
        int unscale
        double scale
        float learning_rate
        float weight_decay
        int num_hyper
        float hyper[LS_OPTIM_MAX_HYPER]
        int clip
        float clip_value
        float ema_momentum
        float ema_rest
        float slice_factor
        int accumulation
        int accumulation_steps

    int ls_optim_family(const char *name)
    const char *ls_optim_family_name(int family)
    int ls_optim_family_count()
    int ls_optim_hyper_count(int family)
    int ls_optim_takes_term(int family)
    int ls_optim_takes_sparse(int family)
    const char *ls_optim_sparse_problem(const ls_optim_config *config)
    int ls_optim_slot_count(const ls_optim_config *config)

    enum:
        LS_UNSCALE_NONE
        LS_UNSCALE_DIVIDE
        LS_UNSCALE_MULTIPLY

    enum:
        LS_ACCUMULATION_NONE
        LS_ACCUMULATION_DIVIDE
        LS_ACCUMULATION_MULTIPLY

    enum:
        LS_CLIP_NONE
        LS_CLIP_VALUE
        LS_CLIP_NORM
        LS_CLIP_GLOBAL

    int ls_optim_step(const ls_param *params, size_t count, const ls_optim_config *config,
                      unsigned flags)

    ctypedef struct ls_norm_param:
        const float *values
        size_t length
        const int64_t *indices
        size_t slices
        size_t row_length
        size_t rows

    ctypedef int (*ls_parallel_fn)(void *host, void *range, const void *ctx, size_t total)
    int ls_squared_norms_with(const ls_norm_param *params, size_t count, int unscale,
                              double scale, int eigen_threads, unsigned flags, float *sums,
                              ls_parallel_fn parallel, void *host)
    long long ls_norm_bad_index(const ls_norm_param *param)


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
    if rc == LS_ERR_MEMORY:
        raise MemoryError("lossscale: out of memory")
    raise ValueError("lossscale: invalid argument")


def simd_level():
    """The kernel set in use: one of ``simd_levels(runnable=False)``
    (``_core/src/kernel_sets.def``), ``"scalar"`` where no vector set runs.

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
# The rules' defaults as the core holds them (lossscale.h): the initial loss
# scale, 2**15, and the growth period.
DEFAULT_LOSS_SCALE = float(LS_DEFAULT_LOSS_SCALE)
DEFAULT_INCREMENT_PERIOD = int(LS_DEFAULT_INCREMENT_PERIOD)


def scale_update(state, bint grads_finite, *, int rule=RULE_TF24,
                 increment_period=DEFAULT_INCREMENT_PERIOD,
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


# ----------------------------------------------------------------- fused steps

_UNSCALE_MODES = {"divide": LS_UNSCALE_DIVIDE, "multiply": LS_UNSCALE_MULTIPLY}
_ACCUMULATION_MODES = {"divide": LS_ACCUMULATION_DIVIDE, "multiply": LS_ACCUMULATION_MULTIPLY}
_CLIP_MODES = {None: LS_CLIP_NONE, "value": LS_CLIP_VALUE, "norm": LS_CLIP_NORM,
               "global": LS_CLIP_GLOBAL}


def _real(value, str what, str name, bint positive=False, bint nonnegative=False):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: {name} must be a real number, got {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{what}: {name} must be finite, got a value too large for a "
                         f"float") from None
    if not math.isfinite(x):
        raise ValueError(f"{what}: {name} must be finite, got {x}")
    if positive and not x > 0.0:
        raise ValueError(f"{what}: {name} must be positive, got {x}")
    if nonnegative and x < 0.0:
        raise ValueError(f"{what}: {name} must be >= 0, got {x}")
    return x


def _float32(double x, str what, str name):
    f = np.float32(x)
    if not np.isfinite(f):
        raise ValueError(f"{what}: {name} = {x} overflows float32")
    return float(f)


def _param_list(arrays, str what, str name, Py_ssize_t n, bint allow_none=False):
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{what}: {name} must be a list or tuple of numpy arrays, got "
                        f"{type(arrays).__name__}")
    if len(arrays) != n:
        raise ValueError(f"{what}: got {len(arrays)} {name} for {n} variables; they must "
                         f"pair up one to one")
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray) and not (allow_none and a is None):
            raise TypeError(f"{what}: {name}[{i}] is {type(a).__name__}, not a numpy array")
    return list(arrays)


cdef int _check_f32(object obj, object var, str what, str label) except -1:
    cdef cnp.ndarray a = <cnp.ndarray>obj
    if a.dtype != np.float32 or not cnp.PyArray_ISNOTSWAPPED(a):
        raise TypeError(f"{what}: {label} must be float32 (native byte order), got "
                        f"{a.dtype}")
    if var is not None and obj.shape != var.shape:
        raise ValueError(f"{what}: {label} has shape {obj.shape}, its variable has shape "
                         f"{var.shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{what}: {label} is not C-contiguous (updated in place)")
    if not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{what}: {label} is read-only")
    if (<size_t>cnp.PyArray_DATA(a)) % 4:
        raise ValueError(f"{what}: {label} is not aligned to 4 bytes")
    return 0


cdef float *_f32_stream(object obj, object var, str what, str label,
                        ls_buffer *buf) except NULL:
    """A float32 array the step updates in place beside ``var`` (checked as
    ``_check_f32``), its data entered in ``buf`` for the overlap check."""
    _check_f32(obj, var, what, label)
    cdef float *data = <float *>cnp.PyArray_DATA(<cnp.ndarray>obj)
    buf.src = data
    buf.dtype = LS_FLOAT32
    buf.length = <size_t>cnp.PyArray_SIZE(<cnp.ndarray>obj)
    return data


cdef int _optim_run(str what, list variables, list grads, list slots, list decay,
                    list clip_scalars, ls_optim_config *config, unsigned flags,
                    list terms=None, list averages=None, list indices=None,
                    list accumulators=None) except -10:
    """Checks everything, then one nogil ls_optim_step; nothing is written
    unless every check passed."""
    cdef Py_ssize_t n = len(variables), i, k
    cdef Py_ssize_t nslots = len(slots)
    cdef ls_param *params = <ls_param *>malloc((n if n else 1) * sizeof(ls_param))
    cdef ls_buffer *bufs = <ls_buffer *>malloc(((6 + nslots) * n + 1) * sizeof(ls_buffer))
    cdef cnp.ndarray var, grad, term, index
    cdef int code, rc
    cdef size_t nb = 0
    if params == NULL or bufs == NULL:
        free(params)
        free(bufs)
        raise MemoryError()
    try:
        for i in range(n):
            var = <cnp.ndarray>variables[i]
            _check_f32(<object>var, None, what, f"variables[{i}]")
            grad = <cnp.ndarray>grads[i]
            code = _dtype_code(grad)
            if code not in (LS_FLOAT16, LS_BFLOAT16, LS_FLOAT32) or not cnp.PyArray_ISNOTSWAPPED(grad):
                raise TypeError(f"{what}: grads[{i}] has dtype {grad.dtype}; expected "
                                f"float16, bfloat16 or float32 (native byte order)")
            index = None if indices is None else indices[i]
            if index is None and (<object>grad).shape != (<object>var).shape:
                raise ValueError(f"{what}: grads[{i}] has shape {(<object>grad).shape}, its "
                                 f"variable has shape {(<object>var).shape}")
            if index is not None:
                _check_slices(what, i, <object>var, <object>grad, <object>index)
            if not cnp.PyArray_IS_C_CONTIGUOUS(grad):
                raise ValueError(f"{what}: grads[{i}] is not C-contiguous")
            if (<size_t>cnp.PyArray_DATA(grad)) % (4 if code == LS_FLOAT32 else 2):
                raise ValueError(f"{what}: grads[{i}] is not aligned to its element size")
            params[i].var = <float *>cnp.PyArray_DATA(var)
            params[i].grad = cnp.PyArray_DATA(grad)
            params[i].length = <size_t>cnp.PyArray_SIZE(var)
            params[i].grad_dtype = <ls_dtype>code
            params[i].decay = decay[i]
            params[i].clip_scalar = clip_scalars[i]
            params[i].slot[0] = NULL
            params[i].slot[1] = NULL
            params[i].slot[2] = NULL
            params[i].grad_term = NULL
            params[i].average = NULL
            params[i].indices = NULL
            params[i].slices = 0
            params[i].row_length = 0
            params[i].accumulator = NULL
            if index is not None and params[i].length > 0:
                params[i].indices = <const int64_t *>cnp.PyArray_DATA(index)
                params[i].slices = <size_t>cnp.PyArray_SIZE(index)
                params[i].row_length = params[i].length // <size_t>(<object>var).shape[0]
                bufs[nb].src = <void *>params[i].indices
                bufs[nb].dtype = LS_FLOAT64  # its 8-byte elements, for the overlap check
                bufs[nb].length = params[i].slices
                nb += 1
            if averages is not None:
                params[i].average = _f32_stream(averages[i], <object>var, what,
                                                f"averages[{i}]", &bufs[nb])
                nb += 1
            if accumulators is not None:
                params[i].accumulator = _f32_stream(accumulators[i], <object>var, what,
                                                    f"accumulators[{i}]", &bufs[nb])
                nb += 1
            if terms is not None:
                term = <cnp.ndarray>terms[i]
                if term.dtype != np.float32 or not cnp.PyArray_ISNOTSWAPPED(term):
                    raise TypeError(f"{what}: terms[{i}] must be float32 (native byte "
                                    f"order), got {term.dtype}")
                if (<object>term).shape != (<object>var).shape:
                    raise ValueError(f"{what}: terms[{i}] has shape {(<object>term).shape}, "
                                     f"its variable has shape {(<object>var).shape}")
                if not cnp.PyArray_IS_C_CONTIGUOUS(term) or (<size_t>cnp.PyArray_DATA(term)) % 4:
                    raise ValueError(f"{what}: terms[{i}] is not C-contiguous and aligned "
                                     f"to 4 bytes")
                params[i].grad_term = <const float *>cnp.PyArray_DATA(term)
                bufs[nb].src = params[i].grad_term
                bufs[nb].dtype = LS_FLOAT32
                bufs[nb].length = params[i].length
                nb += 1
            bufs[nb].src = params[i].var
            bufs[nb].dtype = LS_FLOAT32
            bufs[nb].length = params[i].length
            nb += 1
            bufs[nb].src = params[i].grad
            bufs[nb].dtype = <ls_dtype>code
            bufs[nb].length = <size_t>cnp.PyArray_SIZE(grad)
            nb += 1
            for k in range(nslots):
                params[i].slot[k] = _f32_stream(slots[k][1][i], <object>var, what,
                                                f"{slots[k][0]}[{i}]", &bufs[nb])
                nb += 1
        _check_disjoint(bufs, nb, what)
        with nogil:
            rc = ls_optim_step(params, <size_t>n, config, flags)
        _check_status(rc)
        return rc
    finally:
        free(params)
        free(bufs)


def _check_slices(what, i, var, grad, index):
    """A sparse gradient's slices ``grad`` and ``index`` (int64, one per
    slice, each a row of ``var``) against ``var``."""
    if not isinstance(index, np.ndarray) or index.dtype != np.int64 or index.ndim != 1 \
            or not index.flags.c_contiguous or not index.dtype.isnative:
        raise TypeError(f"{what}: indices[{i}] must be a 1-D C-contiguous int64 array")
    if var.ndim < 1 or grad.shape != (index.size,) + var.shape[1:]:
        raise ValueError(f"{what}: grads[{i}] has shape {grad.shape}; the slices of "
                         f"{index.size} indices into a variable of shape {var.shape} "
                         f"have shape {(index.size,) + var.shape[1:]}")
    if index.size and (index.min() < 0 or index.max() >= var.shape[0]):
        raise ValueError(f"{what}: indices[{i}] has an index outside [0, {var.shape[0]})")


cdef _prepare(str what, bytes family, variables, grads, learning_rate, weight_decay, decay,
              scale, unscale, clip, clip_value, clip_scalars, ls_optim_config *c):
    """What every step function checks and sets in ``c`` (zeroed first) before
    its family's own hyperparameters and slots: the lists, the unscale, the
    weight decay, the clip, the family and the learning rate."""
    memset(c, 0, sizeof(c[0]))
    variables = _param_list(variables, what, "variables", len(variables)
                            if isinstance(variables, (list, tuple)) else -1)
    n = len(variables)
    grads = _param_list(grads, what, "grads", n)
    c.unscale = LS_UNSCALE_NONE
    c.scale = 1.0
    if scale is not None:
        if unscale not in _UNSCALE_MODES:
            raise ValueError(f"{what}: unscale must be one of {sorted(_UNSCALE_MODES)}, got "
                             f"{unscale!r}")
        c.unscale = _UNSCALE_MODES[unscale]
        c.scale = _real(scale, what, "scale", positive=True)
    c.weight_decay = 0.0
    if weight_decay is None:
        decay = [False] * n
    else:
        c.weight_decay = _float32(_real(weight_decay, what, "weight_decay"), what,
                                  "weight_decay")
        if decay is None:
            decay = [True] * n
        elif not isinstance(decay, (list, tuple)) or len(decay) != n:
            raise ValueError(f"{what}: decay must be a list of {n} entries, one per variable")
    forms = []
    for i, d in enumerate(decay):
        if d is True or d is False or d in (0, 1, 2, 3):
            forms.append(int(d))
        else:
            raise ValueError(f"{what}: decay[{i}] must be False/0 (none), True/1 "
                             f"(var - (var * wd) * lr), 2 (var - var * (wd * lr)) or 3 "
                             f"(var - var * wd, wd the whole factor), got {d!r}")
    clip_scalars = _prepare_clip(what, n, clip, clip_value, clip_scalars, c)
    _set_family(c, family)
    c.learning_rate = _float32(_real(learning_rate, what, "learning_rate", nonnegative=True),
                               what, "learning_rate")
    return variables, grads, forms, clip_scalars


cdef list _prepare_clip(str what, Py_ssize_t n, clip, clip_value, clip_scalars,
                        ls_optim_config *c):
    """The clip mode and value into ``c``; each variable's clip scalar
    (float32; any value, NaN and infinities included, as Keras computes
    them)."""
    if not isinstance(clip, (str, type(None))) or clip not in _CLIP_MODES:
        raise ValueError(f"{what}: clip must be None, 'value', 'norm' or 'global', got "
                         f"{clip!r}")
    c.clip = _CLIP_MODES[clip]
    c.clip_value = 0.0
    if clip in ("value", "norm"):
        if clip_value is None:
            raise ValueError(f"{what}: clip={clip!r} needs clip_value")
        c.clip_value = _float32(_real(clip_value, what, "clip_value", positive=True), what,
                                "clip_value")
    elif clip_value is not None:
        raise ValueError(f"{what}: clip_value is given but clip is {clip!r}")
    if clip == "global":
        clip_scalars = [_real_any(clip_scalars, what, "clip_scalars")] * n
    elif clip == "norm":
        if not isinstance(clip_scalars, (list, tuple)) or len(clip_scalars) != n:
            raise ValueError(f"{what}: clip='norm' needs clip_scalars, one divisor per "
                             f"variable ({n})")
        clip_scalars = [_real_any(x, what, f"clip_scalars[{i}]")
                        for i, x in enumerate(clip_scalars)]
    elif clip_scalars is not None:
        raise ValueError(f"{what}: clip_scalars is given but clip is {clip!r}")
    else:
        clip_scalars = [0.0] * n
    return clip_scalars


def _real_any(value, str what, str name):
    """A real number as float32, NaN and infinities kept."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: {name} must be a real number, got {type(value).__name__}")
    return float(np.float32(value))


def sgd_step_(variables, grads, momentums=None, *, learning_rate, momentum=0.0,
              nesterov=False, weight_decay=None, decay=None, scale=None, unscale="divide",
              clip=None, clip_value=None, clip_scalars=None, bint flush_denormals=False):
    """One Keras SGD step over float32 arrays, in place, fused with the
    finite check and the unscale; see ``lossscale.core``."""
    cdef ls_optim_config c
    what = "sgd_step_"
    variables, grads, decay, clip_scalars = _prepare(what, b"sgd", variables, grads,
                                                     learning_rate, weight_decay, decay, scale,
                                                     unscale, clip, clip_value, clip_scalars, &c)
    # family_sgd.h: momentum, nesterov
    c.hyper[0] = _float32(_real(momentum, what, "momentum"), what, "momentum")
    c.hyper[1] = 1.0 if nesterov else 0.0
    slots = []
    if c.hyper[0] != 0.0:
        if momentums is None:
            raise ValueError(f"{what}: momentum={momentum} needs the momentums")
        slots.append(("momentums", _param_list(momentums, what, "momentums", len(variables))))
    elif momentums is not None:
        raise ValueError(f"{what}: momentums given but momentum is 0 (Keras keeps no slot)")
    return bool(_optim_run(what, variables, grads, slots, decay, clip_scalars, &c,
                           LS_FLUSH_DENORMALS if flush_denormals else 0))


def adam_step_(variables, grads, m, v, v_hat=None, *, learning_rate, alpha, beta_1=0.9,
               beta_2=0.999, epsilon=1e-7, weight_decay=None, decay=None, scale=None,
               unscale="divide", clip=None, clip_value=None, clip_scalars=None,
               bint flush_denormals=False):
    """One Keras Adam (AdamW with ``weight_decay``; amsgrad with ``v_hat``)
    step over float32 arrays, in place, fused with the finite check and the
    unscale; see ``lossscale.core``."""
    cdef ls_optim_config c
    what = "adam_step_"
    variables, grads, decay, clip_scalars = _prepare(what, b"adam", variables, grads,
                                                     learning_rate, weight_decay, decay, scale,
                                                     unscale, clip, clip_value, clip_scalars, &c)
    n = len(variables)
    # family_adam.h: 1 - beta_1, 1 - beta_2, epsilon, amsgrad, alpha; as
    # Keras, 1 - beta in Python floats, then float32.
    c.hyper[0] = _float32(1 - _real(beta_1, what, "beta_1"), what, "beta_1")
    c.hyper[1] = _float32(1 - _real(beta_2, what, "beta_2"), what, "beta_2")
    c.hyper[2] = _float32(_real(epsilon, what, "epsilon"), what, "epsilon")
    c.hyper[3] = 0.0 if v_hat is None else 1.0
    c.hyper[4] = _float32(_real(alpha, what, "alpha"), what, "alpha")
    slots = [("m", _param_list(m, what, "m", n)), ("v", _param_list(v, what, "v", n))]
    if v_hat is not None:
        slots.append(("v_hat", _param_list(v_hat, what, "v_hat", n)))
    return bool(_optim_run(what, variables, grads, slots, decay, clip_scalars, &c,
                           LS_FLUSH_DENORMALS if flush_denormals else 0))


cdef _set_family(ls_optim_config *c, bytes name):
    c.family = ls_optim_family(name)
    c.num_hyper = ls_optim_hyper_count(c.family)


def optimizer_families(bint sparse=False):
    """``{name: number of hyperparameters}`` of the core's fused families;
    with ``sparse``, those that take a sparse gradient."""
    return {ls_optim_family_name(f).decode(): ls_optim_hyper_count(f)
            for f in range(ls_optim_family_count())
            if not sparse or ls_optim_takes_sparse(f)}


def optimizer_step_(family, variables, grads, slots, *, hyper, learning_rate,
                    weight_decay=None, decay=None, scale=None, unscale="divide",
                    clip=None, clip_value=None, clip_scalars=None, terms=None,
                    averages=None, ema_momentum=None, indices=None, slice_factor=None,
                    accumulators=None, accumulation_steps=None, accumulation="divide",
                    bint flush_denormals=False):
    """One step of a fused family (``optimizer_families()``) over float32
    arrays, in place, fused with the finite check and the unscale; see
    ``lossscale.core``.  ``clip`` (every step function takes it) clips each
    unscaled gradient as Keras does: ``"value"`` to [-clip_value,
    clip_value]; ``"norm"`` ``(g * clip_value) / clip_scalars[i]`` (the
    divisor ``max(l2norm, clipnorm)`` of each variable); ``"global"``
    ``g * clip_scalars`` (the one factor).  ``terms``: per variable, the
    float32 term the family takes in place of one function of the gradient
    (Adam's g * g, Adamax's |g|, Lion's g * (1 - beta_2): a sparse
    gradient's, summed per row); only for a family that takes one, with no
    unscale (``scale=None``).  ``averages`` (with ``ema_momentum``): per
    variable, its float32 exponential moving average, moved after the
    update as Keras' ``use_ema`` moves it: ``m * average + (1 - m) * var``
    in float32.  ``indices`` (for a family ``optimizer_families(sparse=True)``
    names): per variable, None (its gradient dense) or the int64 rows of
    its sparse gradient's slices (its ``grads`` entry then holds them, one
    per index): the update runs on the dense gradient TensorFlow's
    IndexedSlices conversion makes of them, each slice value unscaled and
    (but under ``"global"``) clipped, times ``slice_factor`` (default 1),
    a row's slices added in order onto 0, the family's term summed alike;
    Adagrad's as Keras' update scatters them (each slice's squares onto
    its row of the accumulator, then each slice's step, in order);
    ``"accumulate"``'s each named row's sum added to that row alone (the
    others are not read: Keras' add of +0 leaves every value its
    accumulators hold).
    ``accumulators`` (with ``accumulation_steps``; dense gradients, no
    ``terms``): per variable, its float32 gradient accumulator, on the
    update step of Keras' ``gradient_accumulation_steps``: the update takes
    ``(g + accumulator) / steps`` (g unscaled; clipped after) and the
    accumulator becomes 0.  ``accumulation="divide"`` divides by
    float32(steps), as Keras does eagerly; ``"multiply"`` multiplies by
    float32(1 / steps), the division as TensorFlow's graph optimizer
    rewrites it."""
    cdef ls_optim_config c
    cdef int f, i, want
    cdef const char *problem
    what = "optimizer_step_"
    names = optimizer_families()
    if family not in names:
        raise ValueError(f"{what}: family must be one of {sorted(names)}, got {family!r}")
    variables, grads, decay, clip_scalars = _prepare(what, family.encode(), variables, grads,
                                                     learning_rate, weight_decay, decay, scale,
                                                     unscale, clip, clip_value, clip_scalars, &c)
    if isinstance(hyper, (str, bytes)) or not hasattr(hyper, "__len__") \
            or len(hyper) != c.num_hyper:
        raise ValueError(f"{what}: {family} takes {c.num_hyper} hyperparameters, got "
                         f"{hyper!r}")
    for i in range(c.num_hyper):
        c.hyper[i] = _float32(_real(hyper[i], what, f"hyper[{i}]"), what, f"hyper[{i}]")
    want = ls_optim_slot_count(&c)
    if not isinstance(slots, (list, tuple)) or len(slots) != want:
        raise ValueError(f"{what}: {family} as configured keeps {want} slots per variable; "
                         f"slots must be a list of {want} lists, got {slots!r}")
    slot_lists = [(f"slots[{k}]", _param_list(slots[k], what, f"slots[{k}]", len(variables)))
                  for k in range(want)]
    if terms is not None:
        if not ls_optim_takes_term(c.family):
            raise ValueError(f"{what}: {family} takes no gradient term")
        if scale is not None:
            raise ValueError(f"{what}: terms are of gradients already unscaled; "
                             f"scale must be None")
        terms = _param_list(terms, what, "terms", len(variables))
    if (averages is None) != (ema_momentum is None):
        raise ValueError(f"{what}: averages and ema_momentum go together")
    if averages is not None:
        averages = _param_list(averages, what, "averages", len(variables))
        c.ema_momentum = _float32(_real(ema_momentum, what, "ema_momentum"), what,
                                  "ema_momentum")
        # Keras' 1 - momentum: the momentum a float32, the difference too.
        c.ema_rest = np.float32(1.0) - np.float32(c.ema_momentum)
    c.slice_factor = 1.0
    if indices is None and slice_factor is not None:
        raise ValueError(f"{what}: slice_factor goes with indices (a sparse gradient's)")
    if indices is not None:
        if not ls_optim_takes_sparse(c.family):
            raise ValueError(f"{what}: {family} takes no sparse gradient")
        if terms is not None:
            raise ValueError(f"{what}: a sparse gradient's terms are summed from its "
                             f"slices; terms must be None")
        indices = _param_list(indices, what, "indices", len(variables), allow_none=True)
        if slice_factor is not None:
            c.slice_factor = _float32(_real(slice_factor, what, "slice_factor"), what,
                                      "slice_factor")
        problem = ls_optim_sparse_problem(&c)
        if problem != NULL:
            raise ValueError(f"{what}: sparse gradients: {problem.decode()}")
        if family == "accumulate" and (averages is not None or any(
                decay[i] for i in range(len(indices)) if indices[i] is not None)):
            raise ValueError(f"{what}: sparse gradients: accumulate adds a sparse gradient "
                             f"as Keras' accumulating step adds it: no weight decay and no "
                             f"average")
    c.accumulation = LS_ACCUMULATION_NONE
    c.accumulation_steps = 0
    if (accumulators is None) != (accumulation_steps is None):
        raise ValueError(f"{what}: accumulators and accumulation_steps go together")
    if accumulators is not None:
        if not isinstance(accumulation, str) or accumulation not in _ACCUMULATION_MODES:
            raise ValueError(f"{what}: accumulation must be one of "
                             f"{sorted(_ACCUMULATION_MODES)}, got {accumulation!r}")
        if isinstance(accumulation_steps, (bool, np.bool_)) \
                or not isinstance(accumulation_steps, numbers.Integral) \
                or not 1 <= accumulation_steps <= 2**31 - 1:
            raise ValueError(f"{what}: accumulation_steps must be an integer >= 1, got "
                             f"{accumulation_steps!r}")
        if terms is not None or indices is not None:
            raise ValueError(f"{what}: accumulators take dense gradients; terms and "
                             f"indices must be None")
        accumulators = _param_list(accumulators, what, "accumulators", len(variables))
        c.accumulation = _ACCUMULATION_MODES[accumulation]
        c.accumulation_steps = int(accumulation_steps)
    return bool(_optim_run(what, variables, grads, slot_lists, decay, clip_scalars, &c,
                           LS_FLUSH_DENORMALS if flush_denormals else 0, terms, averages,
                           indices, accumulators))


def squared_norms(values, *, indices=None, rows=None, scale=None, unscale="divide",
                  int eigen_threads=2, bint flush_denormals=False):
    """TensorFlow's ``reduce_sum(square(u))`` of each float32 array in
    ``values`` (``u`` unscaled: divided by ``scale``, ``unscale="divide"``,
    or times its float32 reciprocal, ``"multiply"``; as it is when ``scale``
    is None), the squares added in the order of TensorFlow's Sum kernel on
    a CPU device of ``eigen_threads`` threads (``lossscale.h``,
    ``ls_squared_norms_with``), as a float32 array.

    ``indices``: None, or one entry per array, None for a dense one or the
    int64 rows of a sparse one's slices (its array ``(slices, row_length)``);
    its sum is that of the densified squares (Keras'
    ``ops.sum(ops.square(slices))``) of a variable of ``rows[i]`` rows.
    Nothing is changed.  Subnormals are flushed as TensorFlow's kernels
    flush them with ``flush_denormals``."""
    what = "squared_norms"
    arrays = _param_list(values, what, "values", len(values)
                         if isinstance(values, (list, tuple)) else -1)
    cdef Py_ssize_t n = len(arrays), i
    if indices is None:
        indices = [None] * n
    indices = _param_list(indices, what, "indices", n, allow_none=True)
    if rows is None:
        rows = [None] * n
    if not isinstance(rows, (list, tuple)) or len(rows) != n:
        raise ValueError(f"{what}: rows must be a list of {n} entries")
    cdef int mode = LS_UNSCALE_NONE
    cdef double s = 1.0
    if scale is not None:
        if unscale not in _UNSCALE_MODES:
            raise ValueError(f"{what}: unscale must be one of {sorted(_UNSCALE_MODES)}, got "
                             f"{unscale!r}")
        mode = _UNSCALE_MODES[unscale]
        s = _real(scale, what, "scale", positive=True)
    if eigen_threads < 1:
        raise ValueError(f"{what}: eigen_threads must be >= 1, got {eigen_threads}")
    cdef ls_norm_param *params = <ls_norm_param *>malloc((n if n else 1) * sizeof(ls_norm_param))
    if params == NULL:
        raise MemoryError(what)
    cdef cnp.ndarray a, index
    cdef cnp.ndarray out = np.zeros(n, np.float32)
    cdef int rc
    cdef long long bad
    keep = []
    try:
        for i in range(n):
            a = <cnp.ndarray>arrays[i]
            if a.dtype != np.float32 or not a.flags.c_contiguous:
                raise TypeError(f"{what}: values[{i}] must be a C-contiguous float32 array, "
                                f"got {a.dtype}")
            memset(&params[i], 0, sizeof(ls_norm_param))
            params[i].values = <const float *>cnp.PyArray_DATA(a)
            params[i].length = a.size
            if indices[i] is None:
                continue
            index = <cnp.ndarray>indices[i]
            if index.dtype != np.int64 or index.ndim != 1 or not index.flags.c_contiguous:
                raise TypeError(f"{what}: indices[{i}] must be a 1-D C-contiguous int64 array")
            if a.ndim != 2 or a.shape[0] != index.shape[0]:
                raise ValueError(f"{what}: values[{i}] must be (slices, row_length) with one "
                                 f"slice per index, got {(<object>a).shape} for "
                                 f"{len(index)} indices")
            if rows[i] is None or int(rows[i]) < 0:
                raise ValueError(f"{what}: rows[{i}] must be the variable's row count")
            params[i].indices = <const int64_t *>cnp.PyArray_DATA(index)
            params[i].slices = a.shape[0]
            params[i].row_length = a.shape[1]
            params[i].rows = int(rows[i])
            bad = ls_norm_bad_index(&params[i])
            if bad >= 0:
                raise ValueError(f"{what}: indices[{i}][{bad}] = {int(index[bad])} is outside "
                                 f"[0, {int(rows[i])})")
            keep.append(index)
        with nogil:
            rc = ls_squared_norms_with(params, n, mode, s, eigen_threads,
                                       LS_FLUSH_DENORMALS if flush_denormals else 0,
                                       <float *>cnp.PyArray_DATA(out), NULL, NULL)
        _check_status(rc)
    finally:
        free(params)
    return out
