"""The fused optimizer step: a stock Keras optimizer's update with the unscale
folded in, as one native op over the whole variable list.

Each fused family is declared once, in ``FAMILIES``: the Keras class whose
``update_step`` it reproduces, its slots, its hyperparameters that must be
plain numbers, the constants and the ``iterations``-derived scalars its
kernel takes (in the order of its ``_core/src/family_<name>.h``), and which
optimizer options it supports.  One native op runs every family by name.  ``decide`` is the
one function that turns an optimizer and a step into either a ``Plan``
(what ``apply`` runs) or the reason the step takes the stock path, which a
user reads in ``LossScaleOptimizer.step_path``.

The fused op writes exactly what the inner optimizer's own ``apply`` would
(variables, slots, ``iterations``), bit for bit: every per-element operation
rounds as Keras' float32 op-by-op arithmetic does, and the scalars Keras
derives from ``iterations`` (the learning rate of a schedule, Adam's
``alpha``) are computed here with the same TensorFlow ops, in the same
order, as Keras computes them.

A sparse gradient (``tf.IndexedSlices``, an ``Embedding``'s) takes the
fused step where its family declares how (``Family.sparse``): its values
are unscaled as the stock step unscales them, the per-slice terms Keras'
``update_step`` densifies are summed per row by TensorFlow's own
conversion (``unsorted_segment_sum``, so duplicate indices add up in
stock's order), and the kernel runs on those dense terms with no further
unscale, in a second native op beside the dense variables' one.

What a family does not support is left to the stock path: an option it
does not declare (clipping, EMA, gradient accumulation, an inner
``loss_scale_factor``), a sparse gradient it has no form for, variable
constraints or
``overwrite_with_gradient``, variables that are not float32, gradients that
are not float16/bfloat16/float32, subclasses that override ``update_step``,
several replicas, and any place the native op cannot run (library missing,
not on the CPU, XLA).
"""

import platform

import keras
import numpy as np
import tensorflow as tf

from lossscale import _compat, _step
from lossscale import ops as native_ops

_GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32)

# Optimizer options a family may support, by the attribute Keras keeps them
# in, with the reason a step gives when its family does not.  Set as Keras
# tests them: a clip of 0 clips nothing, a loss_scale_factor of any value
# divides.
_OPTIONS = (
    ("clipnorm", "the inner optimizer sets clipnorm", bool),
    ("clipvalue", "the inner optimizer sets clipvalue", bool),
    ("global_clipnorm", "the inner optimizer sets global_clipnorm", bool),
    ("use_ema", "the inner optimizer uses EMA", bool),
    ("gradient_accumulation_steps", "the inner optimizer accumulates gradients", bool),
    ("loss_scale_factor", "the inner optimizer sets loss_scale_factor",
     lambda value: value is not None),
)


class Family:
    """One fused optimizer family, as the native op runs it
    (``_core/src/family_<name>.h`` holds its arithmetic).

    Args:
      name: the family's name in the native op (``"sgd"``, ``"adam"``).
      keras_class: the stock class whose ``update_step`` the kernel
        reproduces; a subclass that overrides ``update_step`` is not it.
      slots: ``slots(inner)`` -> the slot kinds this configuration keeps, in
        the kernel's order (``_compat.optimizer_slots`` kinds).
      numbers: hyperparameters that must be plain numbers (the kernel takes
        them as constants).
      hyper: ``hyper(inner)`` -> the kernel's constant numbers, in its order.
      scalars: ``scalars(inner, learning_rate, *state)`` -> the float32
        scalar tensors that follow them, derived from ``iterations`` (and
        the new values of ``state``) as Keras derives them.
      state: ``state(inner)`` -> ``[(variable, new value)]``: the
        optimizer's own scalar state that Keras moves once per applied step
        before the per-variable updates (Nadam's ``_u_product``), the new
        values computed as Keras computes them; assigned only when the step
        applies.
      supports: the ``_OPTIONS`` (and ``"replicas"``) it takes.
      unsupported: ``unsupported(inner)`` -> why the step built here cannot
        be fused, or None.
      sparse: ``sparse(inner, variable)`` -> a ``SparseForm`` (how the kernel
        takes a ``tf.IndexedSlices`` gradient of ``variable``) or a string,
        why it cannot.
    """

    def __init__(self, name, keras_class, *, slots, numbers, hyper, scalars=None,
                 state=None, supports=(), unsupported=None, sparse=None):
        self.name = name
        self.keras_class = keras_class
        self.slots = slots
        self.numbers = tuple(numbers)
        self.hyper = hyper
        self.scalars = scalars or (lambda inner, lr, *state: [])
        self.state = state or (lambda inner: [])
        self.supports = frozenset(supports)
        self.unsupported = unsupported or (lambda inner: None)
        self.sparse = sparse

    def reproduces(self, inner):
        return (isinstance(inner, self.keras_class)
                and _compat.same_update_as(inner, self.keras_class))

    def __repr__(self):
        return f"Family({self.name!r}, {self.keras_class.__name__})"


class SparseForm:
    """How a family's kernel takes a sparse gradient, as Keras' ``update_step``
    treats a ``tf.IndexedSlices``: ``terms(unscaled, lr)`` -> ``(grad,
    term)``, the dense float32 tensors the kernel reads as the gradient and
    in place of the one function of it its family_<name>.h names (None: the
    kernel computes it), made from the gradient with its values unscaled;
    ``learning_rate(lr)`` and ``hyper(inner)``, the learning rate and the
    constants the kernel then takes."""

    def __init__(self, terms, learning_rate=None, hyper=None):
        self.terms = terms
        self.learning_rate = learning_rate or (lambda lr: lr)
        self.hyper = hyper


class Plan:
    """One fused step: the family, the gradients (None dropped; dense ones as
    tensors, sparse ones as ``tf.IndexedSlices``) with their variables, the
    ``SparseForm`` of each sparse one (None for a dense one), and the native
    form of each variable's weight decay."""

    def __init__(self, family, inner, grads, variables, forms):
        self.family = family
        self.inner = inner
        self.grads = [g if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)
                      for g in grads]
        self.variables = variables
        self.forms = forms
        self.decay = [_decay_form(inner, v, _grappler_reassociates_products())
                      for v in variables]
        self.scalars = None
        self.state = []

    def run(self, library, should_apply, scale, unscale):
        """The family's native op over the plan (``prepare_scalars`` first):
        one over the dense gradients, unscaled by the op, one over the
        sparse ones' dense terms; then the family's own state, when
        ``should_apply``."""
        dense = [i for i, form in enumerate(self.forms) if form is None]
        sparse = [i for i, form in enumerate(self.forms) if form is not None]
        if dense:
            self._launch(library, should_apply, dense, [self.grads[i] for i in dense], [],
                         scale, self.learning_rate, unscale)
        if sparse:
            form = self.forms[sparse[0]]
            grads, terms = [], []
            for i in sparse:
                # The checks of the indices first: a bad index fails there,
                # with the variable's name, not in the densifying op.
                with tf.control_dependencies(self.checks):
                    unscaled = _unscaled_slices(self.grads[i], self.variables[i], scale,
                                                unscale)
                grad, term = form.terms(unscaled, self.learning_rate)
                grads.append(grad)
                if term is not None:
                    terms.append(term)
            self._launch(library, should_apply, sparse, grads, terms, scale,
                         form.learning_rate(self.learning_rate), "none", form.hyper)
        for variable, value in self.state:
            variable = _step.tf_variable(variable)
            variable.assign(tf.where(should_apply, value, variable.read_value()))

    def _launch(self, library, should_apply, which, grads, terms, scale, learning_rate,
                unscale, hyper=None):
        def handles(variables):
            return [_step.tf_variable(v).handle for v in variables]

        variables = [self.variables[i] for i in which]
        slots = [h for kind in self.family.slots(self.inner)
                 for h in handles(_compat.optimizer_slots(self.inner, kind, variables))]
        library.loss_scale_apply_optimizer(
            should_apply, handles(variables), slots, grads, scale, learning_rate,
            self.weight_decay, self.scalars, terms, family=self.family.name,
            hyper=[float(h) for h in (hyper or self.family.hyper)(self.inner)],
            decay=[self.decay[i] for i in which], unscale=unscale)

    def prepare_scalars(self):
        """The step's scalars, computed as Keras computes them, and the
        checks that must pass before any state moves (``self.checks``); made
        before the loss scale moves."""
        inner = self.inner
        name = inner.name
        lr = tf.cast(inner.learning_rate, tf.float32)
        self.checks = [
            tf.debugging.assert_all_finite(
                lr, f"{name}: the learning rate is not finite; no variable was changed"),
            tf.debugging.assert_greater_equal(
                lr, tf.constant(0.0, tf.float32),
                message=f"{name}: the learning rate is negative; no variable was changed"),
        ]
        for g, v in zip(self.grads, self.variables):
            if isinstance(g, tf.IndexedSlices):
                self.checks.extend(_slices_checks(name, g, v))
        wd = inner.weight_decay
        self.learning_rate = lr
        self.weight_decay = tf.constant(0.0 if wd is None else float(wd), tf.float32)
        self.state = list(self.family.state(inner))
        self.scalars = list(self.family.scalars(inner, lr, *[v for _, v in self.state]))
        return self.checks


def _slices_checks(name, grad, variable):
    """The run-time checks of a sparse gradient against its variable: every
    index a row of it, one slice per index, each slice a row's shape.  (A
    static mismatch fails before, in ``_step.check_gradients``.)"""
    where = f"{name}: the gradient of {variable.name}"
    after = "; no variable was changed"
    var = _step.tf_variable(variable)
    var_shape = tf.shape(var, out_type=tf.int64)
    values_shape = tf.shape(grad.values, out_type=tf.int64)
    indices = tf.cast(grad.indices, tf.int64)
    return [
        tf.debugging.assert_equal(
            tf.rank(grad.values), tf.rank(var),
            message=f"{where} has slices of another rank than its rows{after}"),
        tf.debugging.assert_equal(
            values_shape[1:], var_shape[1:],
            message=f"{where} has slices of another shape than its rows{after}"),
        tf.debugging.assert_equal(
            tf.size(indices, out_type=tf.int64), values_shape[0],
            message=f"{where} has not one index per slice{after}"),
        tf.debugging.assert_non_negative(
            indices, message=f"{where} has a negative index{after}"),
        tf.debugging.assert_less(
            indices, var_shape[0],
            message=f"{where} has an index past its last row{after}"),
    ]


def _unscaled_slices(grad, variable, scale, unscale):
    """``grad`` (a ``tf.IndexedSlices``) with its values unscaled as the
    stock step unscales them -- ``"divide"``: ``g / scale`` in float32 (Keras
    3's ``ops.divide``), ``"multiply"``: times ``1 / scale`` in their own
    dtype (TensorFlow 2.4), ``"none"``: as they are -- then float32, as the
    inner ``update_step`` casts them."""
    values = grad.values
    if unscale == "divide":
        values = tf.cast(values, tf.float32) / scale
    elif unscale == "multiply":
        values = values * tf.cast(1.0 / scale, values.dtype)
    dense_shape = grad.dense_shape
    if dense_shape is None:
        dense_shape = tf.shape(_step.tf_variable(variable))
    return tf.IndexedSlices(tf.cast(values, tf.float32), tf.identity(grad.indices),
                            dense_shape)


def _densify(slices):
    """``slices`` dense, by TensorFlow's own conversion, as Keras' sparse ops
    densify: ``unsorted_segment_sum``, the slices of a row added in order."""
    return tf.convert_to_tensor(slices)


def _map_values(fn, slices):
    return tf.IndexedSlices(fn(slices.values), slices.indices, slices.dense_shape)


# ------------------------------------------------------------- families
# Each family's numbers in the order of its family_<name>.h.

def _sgd_slots(inner):
    return ("momentum",) if float(inner.momentum) != 0 else ()


def _sgd_hyper(inner):
    return [inner.momentum, 1.0 if inner.nesterov else 0.0]


def _sgd_sparse(inner, variable):
    # Keras' SGD.update_step on an IndexedSlices, with momentum:
    # ops.subtract(m * momentum, ops.multiply(g, lr)) densifies the
    # products (each slice times lr, then a row's slices summed): the
    # kernel takes those sums as its gradient, at a learning rate of 1
    # (x * 1 is x).  Without momentum Keras subtracts slice by slice.
    if float(inner.momentum) == 0:
        return ("Keras' SGD without momentum applies a sparse gradient slice by slice "
                f"(scatter_sub) to {variable.name}")
    if _decay_form(inner, variable, False):
        return f"SGD's weight decay of {variable.name}, whose gradient is sparse"
    return SparseForm(lambda g, lr: (_densify(_map_values(lambda x: x * lr, g)), None),
                      learning_rate=lambda lr: tf.constant(1.0, tf.float32))


def _adam_slots(inner):
    return ("m", "v", "v_hat") if inner.amsgrad else ("m", "v")


def _adam_hyper(inner):
    # As Keras: 1 - beta in Python floats, then float32.
    return [1 - inner.beta_1, 1 - inner.beta_2, inner.epsilon, 1.0 if inner.amsgrad else 0.0]


def _adam_scalars(inner, lr):
    # Keras' Adam.update_step, scalars only: alpha.
    local_step = tf.cast(inner.iterations + 1, tf.float32)
    beta_1_power = tf.pow(tf.cast(inner.beta_1, tf.float32), local_step)
    beta_2_power = tf.pow(tf.cast(inner.beta_2, tf.float32), local_step)
    return [lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)]


def _adam_sparse(inner, variable):
    # Keras' Adam.update_step on an IndexedSlices: ops.subtract(g, m)
    # densifies the gradient, ops.subtract(ops.square(g), v) its squares
    # (each slice squared, then a row's slices summed); the rest is dense.
    return SparseForm(lambda g, lr: (_densify(g), _densify(_map_values(tf.square, g))))


_ADAM = dict(slots=_adam_slots, numbers=("beta_1", "beta_2", "epsilon"), hyper=_adam_hyper,
             scalars=_adam_scalars, sparse=_adam_sparse)


def _rsqrt_form():
    """1.0 where the stock step built here divides by TensorFlow's Rsqrt:
    the arithmetic optimizer, which reorders the products, also turns
    ``x / sqrt(y)`` into ``x * rsqrt(y)``."""
    return 1.0 if _grappler_reassociates_products() else 0.0


def _push_down_form():
    """1.0 where the stock step built here has a constant added to a
    difference pushed down, ``(v - s) + eps`` -> ``(eps - s) + v``: in a
    graph, by the graph optimizer's constant folding."""
    if tf.executing_eagerly():
        return 0.0
    options = tf.config.optimizer.get_experimental_options()
    return 1.0 if (not options.get("disable_meta_optimizer", False)
                   and options.get("constant_folding", True)) else 0.0


def _rsqrt_reason(inner):
    if not _rsqrt_form():
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "TensorFlow's graph-mode Rsqrt is reproduced on x86 only"
    if not _tf_rsqrt_reproduced():
        return "TensorFlow's Rsqrt here is not the one the fused step reproduces"
    return None


_RSQRT_REPRODUCED = []


def _tf_rsqrt_reproduced():
    """Whether this TensorFlow's CPU Rsqrt is the one the core reproduces
    (the x86 wheels' Eigen: AVX packets, no FMA; a build for other flags
    computes another), checked once over packets and a tail: Adagrad's
    kernel with lr * g = 1, g * g = 0 and epsilon 0 leaves -rsqrt(acc)."""
    if not _RSQRT_REPRODUCED:
        import numpy as np

        from lossscale import core

        rng = np.random.default_rng(0)
        acc = np.exp(rng.uniform(-40, 40, 1003)).astype(np.float32)
        w = np.zeros_like(acc)
        g = np.full_like(acc, 2.0**-100)
        core.optimizer_step_("adagrad", [w], [g], [[acc.copy()]], hyper=[0.0, 1.0],
                             learning_rate=2.0**100, flush_denormals=True)
        with tf.init_scope(), tf.device("CPU:0"):
            want = tf.math.rsqrt(tf.constant(acc)).numpy()
        _RSQRT_REPRODUCED.append(bool(np.array_equal((-w).view(np.uint32),
                                                     want.view(np.uint32))))
    return _RSQRT_REPRODUCED[0]


def _rmsprop_slots(inner):
    return (("velocity",) + (("momentum",) if inner.momentum > 0 else ())
            + (("average_gradient",) if inner.centered else ()))


def _rmsprop_hyper(inner):
    # As Keras: rho and 1 - rho in Python floats, then float32.
    return [inner.rho, 1 - inner.rho, inner.epsilon, inner.momentum,
            1.0 if inner.momentum > 0 else 0.0, 1.0 if inner.centered else 0.0, _rsqrt_form(), _push_down_form()]


def _adagrad_hyper(inner):
    return [inner.epsilon, _rsqrt_form()]


def _adamax_hyper(inner):
    # As Keras: 1 - beta_1 in Python floats; beta_2 and epsilon as given.
    return [1 - inner.beta_1, inner.beta_2, inner.epsilon]


def _adamax_scalars(inner, lr):
    # Keras' Adamax.update_step, scalars only: 1 - beta_1^t.
    local_step = tf.cast(inner.iterations + 1, tf.float32)
    beta_1_power = tf.pow(tf.cast(inner.beta_1, tf.float32), local_step)
    return [1 - beta_1_power]


def _adamax_sparse(inner, variable):
    # Keras' Adamax.update_step on an IndexedSlices: ops.subtract(g, m)
    # densifies the gradient, ops.maximum(beta_2 * u, ops.abs(g)) the
    # magnitudes (each slice's, then a row's slices summed).
    return SparseForm(lambda g, lr: (_densify(g), _densify(_map_values(tf.abs, g))))


def _float32_complement(x):
    # Keras' ``1 - cast(x, float32)``: a float32 subtraction.
    return float(np.float32(1) - np.float32(x))


def _nadam_hyper(inner):
    return [_float32_complement(inner.beta_1), _float32_complement(inner.beta_2),
            inner.epsilon]


def _nadam_state(inner):
    # Keras' Nadam._backend_update_step, the same ops on the same values.
    u_product = _compat.nadam_u_product(inner)
    dtype = u_product.dtype
    return [(u_product, u_product * inner.beta_1 * (
        1.0 - 0.5 * keras.ops.power(0.96, keras.ops.cast(inner.iterations + 1, dtype))))]


def _nadam_scalars(inner, lr, u_product_t):
    # Keras' Nadam.update_step, scalars only, u_product_t as it reads it.
    local_step = tf.cast(inner.iterations + 1, tf.float32)
    next_step = tf.cast(inner.iterations + 2, tf.float32)
    decay = tf.cast(0.96, tf.float32)
    beta_1 = tf.cast(inner.beta_1, tf.float32)
    beta_2 = tf.cast(inner.beta_2, tf.float32)
    u_t = beta_1 * (1.0 - 0.5 * (tf.pow(decay, local_step)))
    u_t_1 = beta_1 * (1.0 - 0.5 * (tf.pow(decay, next_step)))
    u_product_t = tf.cast(u_product_t, tf.float32)
    u_product_t_1 = u_product_t * u_t_1
    beta_2_power = tf.pow(beta_2, local_step)
    return [u_t_1, 1 - u_product_t_1, 1 - u_t, 1 - u_product_t, 1 - beta_2_power]


def _lion_hyper(inner):
    return [inner.beta_1, _float32_complement(inner.beta_1), inner.beta_2,
            _float32_complement(inner.beta_2)]


def _lion_sparse(inner, variable):
    # Keras' Lion.update_step on an IndexedSlices: ops.add(m * beta_1,
    # ops.multiply(g, 1 - beta_1)) densifies the products (each slice's,
    # then a row's summed), and so does the moment's g * (1 - beta_2): the
    # first sums are the kernel's gradient, at a (1 - beta_1) of 1 (x * 1
    # is x), the second its term.
    def terms(g, lr):
        beta_1 = tf.cast(inner.beta_1, tf.float32)
        beta_2 = tf.cast(inner.beta_2, tf.float32)
        return (_densify(_map_values(lambda x: x * (1.0 - beta_1), g)),
                _densify(_map_values(lambda x: x * (1.0 - beta_2), g)))

    def hyper(inner):
        h = _lion_hyper(inner)
        h[1] = 1.0
        return h

    return SparseForm(terms, hyper=hyper)

# Most derived class first: AdamW is an Adam.
FAMILIES = (
    Family("adam", keras.optimizers.AdamW, **_ADAM),
    Family("adam", keras.optimizers.Adam, **_ADAM),
    Family("sgd", keras.optimizers.SGD, slots=_sgd_slots, numbers=("momentum",),
           hyper=_sgd_hyper, sparse=_sgd_sparse),
    Family("rmsprop", keras.optimizers.RMSprop, slots=_rmsprop_slots,
           numbers=("rho", "momentum", "epsilon"), hyper=_rmsprop_hyper,
           unsupported=_rsqrt_reason,
           sparse=lambda inner, v: (
               "Keras' RMSprop divides each slice of a sparse gradient by its row's "
               "denominator (taking in the rows where that is 0 or NaN)")),
    Family("adagrad", keras.optimizers.Adagrad, slots=lambda inner: ("accumulator",),
           numbers=("epsilon",), hyper=_adagrad_hyper, unsupported=_rsqrt_reason,
           sparse=lambda inner, v: (
               "Keras' Adagrad applies a sparse gradient slice by slice (scatter_add, "
               "scatter_sub) to the rows it indexes")),
    Family("adamax", keras.optimizers.Adamax, slots=lambda inner: ("adamax_m", "u"),
           numbers=("beta_1", "beta_2", "epsilon"), hyper=_adamax_hyper,
           scalars=_adamax_scalars, sparse=_adamax_sparse),
    Family("nadam", keras.optimizers.Nadam, slots=lambda inner: ("m", "v"),
           numbers=("beta_1", "beta_2", "epsilon"), hyper=_nadam_hyper,
           scalars=_nadam_scalars, state=_nadam_state,
           sparse=lambda inner, v: (
               "Keras' Nadam takes a row's sum of ((1 - u_t) * slice) / (1 - u_product) "
               "for a sparse gradient, a term the fused kernel does not take")),
    Family("lion", keras.optimizers.Lion, slots=lambda inner: ("m",),
           numbers=("beta_1", "beta_2"), hyper=_lion_hyper, sparse=_lion_sparse),
)

_CLASS_NAMES = sorted({f.keras_class.__name__ for f in FAMILIES}, key=str.lower)
_FAMILY_NAMES = ", ".join(_CLASS_NAMES[:-1]) + " or " + _CLASS_NAMES[-1]


def family_of(inner):
    """The ``Family`` that reproduces ``inner``, or None."""
    return next((f for f in FAMILIES if f.reproduces(inner)), None)


# -------------------------------------------------------------- decision

class Decision:
    """``plan`` (a ``Plan``, or None for the stock path) and ``path``, what
    ``step_path`` reports: ``"fused (Adam)"`` or ``"stock: <reason>"``."""

    __slots__ = ("plan", "path")

    def __init__(self, inner, plan=None, reason=None):
        self.plan = plan
        self.path = f"stock: {reason}" if reason else f"fused ({type(inner).__name__})"


def decide(inner, *, enabled=True, rule_reason=None, grads=None, variables=None):
    """The fused ``Plan`` for this step, or the reason it takes the stock path.

    ``enabled`` is the optimizer's ``fused`` switch; ``rule_reason`` what
    its loss-scale rule says against fusing (None: nothing).  Without
    ``grads`` it answers for the configuration alone (``step_path`` before
    any step) and never holds a plan.
    """
    def stock(reason):
        return Decision(inner, reason=reason)

    if not enabled:
        return stock("fused=False")
    if rule_reason:
        return stock(rule_reason)
    family = family_of(inner)
    if family is None:
        return stock(f"the inner optimizer ({type(inner).__name__}) is not a stock "
                     f"{_FAMILY_NAMES}")
    for attr, reason, is_set in _OPTIONS:
        if attr not in family.supports and is_set(getattr(inner, attr, None)):
            return stock(reason)
    for attr in family.numbers:
        value = getattr(inner, attr, 0.0)
        if callable(value) or isinstance(value, (tf.Tensor, tf.Variable)):
            return stock(f"the inner optimizer's {attr} is not a number")
    if (inner.weight_decay is not None and _compat.optimizer_learning_rate_variable(inner) is None
            and _grappler_reassociates_products()):
        # Each variable's decay evaluates the schedule anew, and the graph
        # optimizer merges that product into the decay's chain of multiplies,
        # folding the schedule's constants with weight_decay (ExponentialDecay:
        # var * (pow * (initial_rate * wd))): an order set by the schedule's
        # own ops, which the kernel does not follow.
        return stock("weight decay with a learning-rate schedule in a graph "
                     "(TensorFlow's graph optimizer reorders its products)")
    if grads is None:
        return Decision(inner)
    reason = family.unsupported(inner) or _step_reason(family, inner, grads, variables)
    if reason is not None:
        return stock(reason)
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    forms = [family.sparse(inner, v) if isinstance(g, tf.IndexedSlices) else None
             for g, v in pairs]
    return Decision(inner, plan=Plan(family, inner, [g for g, _ in pairs],
                                     [v for _, v in pairs], forms))


def _step_reason(family, inner, grads, variables):
    """Why these gradients and variables cannot take ``family``'s fused step."""
    replica_context = tf.distribute.get_replica_context()
    if "replicas" not in family.supports and tf.distribute.has_strategy() and (
            replica_context is None or replica_context.num_replicas_in_sync > 1):
        return "a tf.distribute strategy with several replicas"
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if not pairs:
        return "no gradients"
    devices = []
    for g, v in pairs:
        if isinstance(g, tf.IndexedSlices):
            form = family.sparse(inner, v) if family.sparse else None
            if not isinstance(form, SparseForm):
                return form or f"the gradient of {v.name} is sparse (IndexedSlices)"
        if getattr(v, "overwrite_with_gradient", False):
            return f"{v.name} is overwritten with its gradient"
        if getattr(v, "constraint", None) is not None:
            return f"{v.name} has a constraint"
        if tf.as_dtype(v.dtype) != tf.float32:
            return f"{v.name} is {tf.as_dtype(v.dtype).name}, not float32"
        if tf.as_dtype(g.dtype) not in _GRAD_DTYPES:
            return f"the gradient of {v.name} is {tf.as_dtype(g.dtype).name}"
        devices.append(native_ops.device_of(_step.tf_variable(v)))
        devices.append(native_ops.device_of(g))
    if native_ops.native_library_for(devices) is None:
        status = native_ops.native_available()
        if not status:
            return f"the native op library is not available ({status.reason})"
        return "a tensor is not on the CPU, or XLA is compiling"
    return None


# ------------------------------------------------------------------ run

def _grappler_reassociates_products():
    """Whether the stock step built here will have ``var * wd * lr``
    reordered to ``var * (wd * lr)``: in a graph that TensorFlow's graph
    optimizer rewrites (its arithmetic optimizer minimises broadcasts in
    chains of multiplies), not eagerly."""
    if tf.executing_eagerly():
        return False
    options = tf.config.optimizer.get_experimental_options()
    return (not options.get("disable_meta_optimizer", False)
            and options.get("arithmetic_optimization", True))


def _decay_form(inner, variable, reassociated):
    """The core's ls_decay for ``variable``: 0 none, 1 op by op, 2 reordered."""
    if inner.weight_decay is None or not _compat.uses_weight_decay(inner, variable):
        return 0
    # A one-element variable has nothing to broadcast: the graph optimizer
    # leaves its product alone.
    size = 1
    for d in variable.shape:
        size *= int(d)
    return 2 if reassociated and size > 1 else 1


def apply(plan, *, scale, unscale, should_apply, advance_iterations_always=False):
    """The fused step: when ``should_apply`` (a bool tensor), the inner
    optimizer's update of ``plan``'s variables by its gradients unscaled by
    ``scale`` — ``"divide"`` (Keras 3), ``"multiply"`` (TensorFlow 2.4) or
    ``"none"`` — and ``iterations`` advanced; when not, nothing changes.
    ``plan.prepare_scalars()`` must have run before the loss scale moved.
    With ``advance_iterations_always`` a skipped step advances
    ``iterations`` too, as TensorFlow 2.4's optimizer did."""
    scale = tf.convert_to_tensor(scale, tf.float32)
    plan.run(native_ops.native_library_for([]), should_apply, scale, unscale)
    iterations = _compat.optimizer_iterations(plan.inner)
    if advance_iterations_always:
        iterations.assign_add(1)
    else:
        iterations.assign_add(tf.cast(should_apply, iterations.dtype))
