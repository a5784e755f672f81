"""The fused optimizer step: a stock Keras optimizer's update with the unscale
folded in, as one native op over the whole variable list.

Each fused family is declared once, in ``FAMILIES``: the Keras class whose
``update_step`` it reproduces, its slots, its hyperparameters that must be
plain numbers, the constants and the ``iterations``-derived scalars its
kernel takes (in the order of its ``_core/src/family_<name>.h``), and which
optimizer options it supports.  One native op runs every family by name,
but Adafactor, whose slots are not shaped as its variables and whose update
takes means over each one, and Lamb, whose update divides by two norms
between its moments and its move: each has an op of its own
(``OWN_OP_FAMILIES``, ``Plan.run``; Lamb's makes its moments and step and
the sums for its norms, and the move follows as Keras takes it,
``_lamb_moves``).
``decide`` is the one function that turns an optimizer and a step into either a ``Plan``
(what ``apply`` runs) or the reason the step takes the stock path, which a
user reads in ``LossScaleOptimizer.step_path``.

The fused op writes exactly what the inner optimizer's own ``apply`` would
(variables, slots, ``iterations``), bit for bit: every per-element operation
rounds as Keras' float32 op-by-op arithmetic does, and the scalars Keras
derives from ``iterations`` (the learning rate of a schedule, Adam's
``alpha``) are computed here with the same TensorFlow ops, in the same
order, as Keras computes them.

EMA (``use_ema``) and gradient accumulation (``gradient_accumulation_steps``)
wrap any family's update as Keras' ``_backend_apply_gradients`` wraps
``update_step`` (see ``apply``): the accumulating steps add the unscaled
gradients to the accumulators in one native pass (the ``accumulate``
family); an update step is one pass too, the family's op reading each
gradient and its accumulator (``Accumulation``): the gradient unscaled,
plus the accumulator, divided by the steps as the stock step divides
(eagerly a division, in a ``tf.function`` the product by ``1 / steps``
that TensorFlow's graph optimizer makes of it), the update, and the
accumulator zeroed; the accumulators of variables without a gradient are
zeroed apart (``LossScaleZeroVariables``).  The EMA follows every
applied step: without accumulation the op itself moves each average right
after its variable's update (``ls_param.average``, with the momentum and
``1 - momentum`` of its Keras, ``KerasLine.moving_average_numbers``); the
averages no op moved (accumulation) by Keras' ops.  Under a ``tf.distribute``
strategy the op moves each replica's copies of the averages, where Keras'
ops would make the strategy's merge call inside a ``cond``: the EMA fuses
there where the op moves every average and, in a ``tf.function``, nothing
is overwritten with them; accumulation does not
(``_strategy_around_update_reason``).

Keras' gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``)
is every family's: the native op clips each unscaled gradient in its one
gradient load, with the factors ``Plan.check_finite`` computes (the
section "clipping" below says how, and what it costs).

A sparse gradient (``tf.IndexedSlices``, an ``Embedding``'s) takes the
fused step where its family declares how (``Family.sparse``): the native
op takes the slices and their rows as they came, and sums them per row a
block at a time, in cache (``ls_param.indices``): each slice value
unscaled and clipped as the stock step unscales and clips it, then a row's
slices added in their order onto 0, as TensorFlow's conversion
(``unsorted_segment_sum``) adds the per-slice terms Keras' ``update_step``
densifies -- the gradient and the family's term (Adam's squares) alike --
so that no dense gradient is ever made.  Adagrad, whose Keras update
scatters its slices, takes them as it scatters them: the op updates the
rows they index alone, slice by slice in their order.  A family whose
sparse update no kernel reproduces (Keras' SGD without momentum or with
weight decay, RMSprop, Nadam, Adafactor; tf_keras' legacy SGD without
momentum) takes
the fused step on one replica all the same: that variable moves by the
inner optimizer's own update, its ops inside the step (``BY_OWN_UPDATE``),
the others by the kernels.  Clipped, a sparse
gradient is what Keras' clip makes of it: dense under ``global_clipnorm``
(``DENSIFIED_BY_CLIP``, any family: the row sums clipped, or TensorFlow's
conversion where the family takes no slices), its slices clipped under
``clipnorm`` and ``clipvalue``.  With Keras 3's gradient accumulation a
sparse gradient is dense too, for every family that accumulates: Keras'
add to (or of) its accumulator densifies it, on every step
(``DENSIFIED_BY_ACCUMULATION``: on a step that only accumulates, the
kernel adds each row's slices, summed as TensorFlow's conversion sums them,
to the rows named alone, with no dense copy; on an update step, TensorFlow's
conversion of the unscaled slices, then the update pass as for a dense one).
``tf_keras``' current optimizers sum a
sparse gradient's duplicate slices per row before their update, which then
scatters the sums: where that comes to the dense update of the densified
gradient bit for bit (SGD without Nesterov), the kernel takes it so
(``SUMMED_BY_ROW``); Adam and AdamW, whose sparse update is a form of its
own (``m`` and ``v`` decayed on every row, the sums' terms scatter-added),
run the core's summed family ``tf_keras_adam`` (``SparseForm.family``),
Nesterov SGD (the sums times -lr scatter-added to the weights before
``m * momentum``) the summed ``tf_keras_sgd``, RMSprop (the sums times lr
and TensorFlow's Rsqrt of the named rows' denominators gathered, which
rounds an element by its place in that tensor) the summed
``tf_keras_rmsprop`` (a one-element variable's in a graph stays stock, its
product ordered by the names of its tensors).  tf_keras clips a sparse
gradient's slices as they came, before that sum (``tf.clip_by_global_norm``
keeps it sparse there): a step with a clip and a sparse gradient runs its
own clip ops before the fused pass (``Plan.clip_by_own_ops``).

Some of what TensorFlow's graph optimizer does to the stock step in a
``tf.function`` hangs on whether that function returns a value (it then
knows the function's outputs): SGD's ``u * factor * lr`` under
``global_clipnorm`` is reordered only then (where the IdentityN of the
gradients' all-reduce is removed), centered RMSprop's ``(v - s) + eps``
pushed down only then.  Some hangs on the names its tensors end up with:
tf_keras RMSprop's ``lr * g * rsqrt(d)`` of a one-element variable.
Tracing cannot see that, so the step reads it at run time from a probe of
the same chain, which the optimizer rewrites as it rewrites stock's
(``_graph_reorders_clip``, ``_graph_pushes_down``,
``_graph_orders_gradient_first``), and runs the kernel form it names.

What a family does not support is left to the stock path: an option it
does not declare (an inner ``loss_scale_factor``), clipping together with
gradient accumulation over a count that is not a power of two in a graph
(Keras clips each update step's averages: ``_update_by_averages``), a
sparse gradient its family has no form for (with accumulation every
family densifies it, as Keras' add does), variable constraints or
``overwrite_with_gradient``, variables that are not float32, gradients that
are not float16/bfloat16/float32, subclasses that override ``update_step``,
a ``tf.distribute`` strategy other than Mirrored and MultiWorkerMirrored
(or one with a cross-device op of its own), and any place the native op
cannot run (library missing, not on the CPU, XLA).

Under ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy`` with several
replicas the step keeps stock Keras' order: each replica unscales its own
gradients (as stock divides them, in the same dtype), the strategy's own
all-reduce sums them (the same call on the same list, so the same sums),
and the fused op applies the sums on each replica's device, to that
device's copies.  The finite check reads the sums: every replica holds the
same ones, so every replica takes the same decision without a collective
of its own, and a non-finite gradient on any replica makes its sum
non-finite, so every replica skips.  (Stock checks each replica's scaled
gradients and trusts the first replica's flag.)  Where every replica's
gradients are finite but their sum is not (beyond float32's range), stock
applies it and the step here is skipped.  A sparse gradient's
all-reduce is TensorFlow's concatenation of the replicas' slices, in
replica order, which the family's sparse form takes as one replica's.
With a clip, each replica clips its unscaled gradients by Keras' own
``_clip_gradients`` before the all-reduce, as stock does (each replica by
its own norms), and the fused op clips nothing (``Plan.sum_replicas``).

``tf_keras`` (Keras 2) optimizers have families of their own
(``tf_keras_families``): the current ones (``tf_keras.optimizers``) run
Keras 3's kernels where their arithmetic is the same, and the legacy ones
(``tf_keras.optimizers.legacy``) the ``legacy_*`` kernels, which reproduce
TensorFlow's ``ResourceApply*`` ops.  A legacy one takes a sparse gradient
as tf_keras hands it to TensorFlow (``_legacy_sparse``): each row's slices
summed in ``unsorted_segment_sum``'s order (its
``_deduplicate_indexed_slices``), then the rows named alone updated as
TensorFlow's ``ResourceSparseApply*`` kernels update them (SGD with
momentum, RMSprop with momentum, Adagrad), or every row's slots decayed
first as tf_keras' own ops do (Adam, RMSprop without momentum); SGD
without momentum adds the slices one by one, by its own op inside the
fused step (``BY_OWN_UPDATE``).  tf_keras clips a sparse gradient's slices
before the sum: with a sparse gradient its own clip ops run before the
fused pass (``Plan.clip_by_own_ops``).  Each such family says through its
``line`` (``KerasLine``) where that Keras keeps the learning rate, the
slots, the weight decay and the EMA.  The current ones take ``use_ema``:
the op moves each average as ``tf_keras`` does (``ema_momentum`` and
``1 - ema_momentum`` as float32 constants, on the first step too), and
``tf_keras``' own ``_overwrite_model_variables_with_average_value``
overwrites the step's variables on its schedule (under a strategy that
EMA stays stock).  Under ``MirroredStrategy`` they follow ``tf_keras``'
loss-scale optimizer, whose order is the one above (it multiplies by
``1 / scale``, and checks the sums, so a sum beyond float32's range is
skipped there too), and so under ``MultiWorkerMirroredStrategy``, where
the one all-reduce both sum with is the workers' collective one.
Both lines clip with TensorFlow's ``clip_by_norm``,
``clip_by_global_norm`` (``_tf_global_clip_factor``) and
``clip_by_value``; the current ones' update, Python-level ops, leaves the
clip's products alone in a graph (the clipped gradient feeds several ops),
but for RMSprop's one-element order (``_tf_keras_rmsprop_variable_hyper``).
"""

import platform

import keras
import numpy as np
import tensorflow as tf

from lossscale import _compat, _step, _which_keras
from lossscale import ops as native_ops

_GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32)

# Optimizer options a family may support, by the attribute Keras keeps them
# in, with the reason a step gives when its family does not.  Set as Keras
# tests them: a loss_scale_factor of any value divides.  (Clipping is not
# among them: the native op's common gradient load clips for every family,
# _CLIP_OPTIONS.)
_OPTIONS = (
    ("use_ema", "the inner optimizer uses EMA", bool),
    ("gradient_accumulation_steps", "the inner optimizer accumulates gradients", bool),
    ("loss_scale_factor", "the inner optimizer sets loss_scale_factor",
     lambda value: value is not None),
)

# The options ``apply`` runs around the update of any family: the EMA after
# it, the accumulation before it.
_AROUND_UPDATE = ("use_ema", "gradient_accumulation_steps")

# Stock optimizers no family reproduces, and why none does.
_NOT_FUSED = (
    ("Muon", "Muon orthogonalises each gradient matrix (Newton-Schulz matrix products)"),
)

# Keras' clip options, in the order its _clip_gradients tests them, with
# the native op's name for each; a clip of 0 clips nothing, as in Keras.
_CLIP_OPTIONS = (("clipnorm", "norm"), ("global_clipnorm", "global"), ("clipvalue", "value"))
_CLIP_ATTRS = {mode: attr for attr, mode in _CLIP_OPTIONS}


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
      supports: the ``_OPTIONS`` it takes.
      unsupported: ``unsupported(inner)`` -> why the step built here cannot
        be fused, or None.
      unsupported_variables: ``unsupported_variables(inner, variables)`` ->
        why the step built here cannot be fused for ``variables``, or None.
      scales_gradient: whether ``update_step`` multiplies the gradient by
        a scalar (SGD's ``g * lr``), a product TensorFlow's graph optimizer
        merges with the ``1 / steps`` of an accumulated average.
      line: the ``KerasLine`` the class belongs to (Keras 3 by default).
      sparse: ``sparse(inner, variable)`` -> a ``SparseForm`` (how the kernel
        takes a ``tf.IndexedSlices`` gradient of ``variable``) or a string,
        why it cannot.
      run_time_forms: ``run_time_forms(inner, numbers)`` -> ``[(index,
        other, probe)]``: the kernel's number at ``index`` (as ``numbers``,
        its numbers for some variables, has it) is a form of the stock
        graph that the graph optimizer applies or not by what tracing cannot
        see (whether the function returns a value, the names the graph's
        tensors end up with), ``probe()`` a bool tensor that tells at run
        time whether it did, ``other`` the number where it did not.
      merges_global_clip: ``merges_global_clip(inner)`` -> whether the stock
        step built here may multiply a gradient by ``global_clipnorm``'s
        factor times the learning rate (the graph optimizer's order) rather
        than by the factor and then the learning rate.
      variable_hyper: ``variable_hyper(inner, variable, numbers)`` -> the
        kernel's numbers for ``variable`` (``numbers``: ``hyper``'s), where
        the graph optimizer rewrites the stock step by the variable's
        shape; variables whose numbers differ run in ops of their own.
    """

    def __init__(self, name, keras_class, *, slots, numbers, hyper, scalars=None,
                 state=None, supports=(), unsupported=None, scales_gradient=True, line=None,
                 sparse=None, merges_global_clip=None, run_time_forms=None,
                 variable_hyper=None, unsupported_variables=None):
        self.name = name
        self._keras_class = keras_class
        self.line = line or KERAS_3
        self.slots = slots
        self.numbers = tuple(numbers)
        self.hyper = hyper
        self.scalars = scalars or (lambda inner, lr, *state: [])
        self.state = state or (lambda inner: [])
        self.supports = frozenset(supports)
        self.unsupported = unsupported or (lambda inner: None)
        self.unsupported_variables = unsupported_variables or (lambda inner, variables: None)
        self.scales_gradient = scales_gradient
        self.sparse = sparse
        self.merges_global_clip = merges_global_clip or (lambda inner: False)
        self.run_time_forms = run_time_forms or (lambda inner, numbers: [])
        self.variable_hyper = variable_hyper or (lambda inner, variable, numbers: numbers)

    @property
    def keras_class(self):
        # A tf_keras family names its class by a function: tf_keras is
        # imported only once one of its optimizers is seen.
        cls = self._keras_class
        return cls if isinstance(cls, type) else cls()

    def reproduces(self, inner):
        return (isinstance(inner, self.keras_class)
                and self.line.same_update_as(inner, self.keras_class))

    def __repr__(self):
        return f"Family({self.name!r}, {self.keras_class.__name__})"


class SparseForm:
    """How a family's kernel takes a sparse gradient, as Keras' ``update_step``
    treats a ``tf.IndexedSlices``: the native op takes the slices and sums
    them per row a block at a time (``ls_param.indices``), each slice value
    unscaled and clipped as a dense one, times ``slice_factor(lr)`` (None:
    1), the term its family_<name>.h names summed alike; ``learning_rate(lr)``
    and ``hyper(inner)``, the learning rate and the constants the kernel
    then takes.

    Adagrad's kernel (the core's row family), whose Keras update applies
    the slices row by row (scatters), takes them so: the rows they index
    alone, slice by slice.

    tf_keras' legacy families (the core's summed families) take the slices
    as tf_keras hands them to TensorFlow: a row's slices summed, then the
    family's sparse form of each element (what a row no slice names does
    is the family's own); ``scalars(inner, lr)``, where given, the
    ``iterations``-derived scalars of that form, in place of the family's.
    ``family``, where given, names the core's family that runs the slices
    in place of the family's own (tf_keras' current Adam: its dense update
    is Keras 3's ``adam``, its sparse one the summed ``tf_keras_adam``)."""

    def __init__(self, slice_factor=None, learning_rate=None, hyper=None, scalars=None,
                 family=None):
        self.slice_factor = slice_factor
        self.learning_rate = learning_rate or (lambda lr: lr)
        self.hyper = hyper
        self.scalars = scalars
        self.family = family


# A sparse gradient that Keras' global_clipnorm makes dense, for every
# family: ``clip_by_global_norm`` multiplies each gradient by the factor,
# and a tf.IndexedSlices times a tensor is the densified slices times it.
# The kernel takes the densified slices as a dense gradient and multiplies
# them by the factor as it does the others: the native op sums the slices
# itself where the family takes them (``NATIVE_SPARSE``), TensorFlow's
# conversion densifies them for the others.  (clipnorm and clipvalue keep
# a gradient sparse: TensorFlow's clip_by_norm and clip_by_value clip its
# slices, as the op clips each slice value.)
DENSIFIED_BY_CLIP = SparseForm()

# A sparse gradient under Keras 3's gradient_accumulation_steps, for every
# family that accumulates: Keras adds it to its accumulator on a step that
# only accumulates (``var.assign(var + grad)``) and its accumulator to it on
# an update step (``(g + acc_g) / steps``), and either add densifies the
# slices first (TensorFlow's conversion: ``unsorted_segment_sum``, a row's
# slices added in order onto 0), unscaled as stock unscales them.  On a
# step that only accumulates the kernel's accumulate family takes the slices
# (lossscale.h, ls_param.indices: each named row's sum added to it, the other
# rows left as Keras' +0 leaves them); on an update step they are densified
# so (``Plan._densified``) and the update pass takes them as a dense gradient.
DENSIFIED_BY_ACCUMULATION = SparseForm()

# A sparse gradient that tf_keras' current optimizers sum per row before
# their update: ``apply_gradients`` adds a row's duplicate slices
# (``_deduplicate_sparse_grad``: ``unsorted_segment_sum`` onto 0, in their
# order), and where ``update_step``'s scatters of those sums come to the
# dense update of the densified gradient bit for bit (a row without slices
# taking a gradient of 0 unchanged), the kernel takes the gradient dense, as
# TensorFlow's conversion densifies it (the same sums).
SUMMED_BY_ROW = SparseForm()

# A sparse gradient whose update no kernel reproduces, on one replica: the
# inner optimizer's own update of that variable (its ops: Keras 3's
# ``update_step``, tf_keras' legacy ``_resource_apply_sparse_duplicate_indices``)
# runs inside the fused step, under its decision, after the slices' checks,
# on the gradient unscaled (and clipped) as stock unscales (and clips) it;
# every other variable takes the kernels.  Only for families whose update
# of one variable reads nothing the step moves for the others but what
# moves before every update in stock's step too (SGD and RMSprop: the
# learning rate and the variable's own slots; Adafactor: iterations too;
# Nadam: its u_product, which ``Plan.run`` moves first, as Keras does).
BY_OWN_UPDATE = SparseForm()

# A sparse gradient that Keras' Lamb densifies twice: its slices (the
# subtraction from m densifies them) and their squares (``ops.square`` of an
# IndexedSlices squares its slices, a row's duplicates apart, and the
# subtraction from v densifies those).  The Lamb op takes the slices and
# makes both a block at a time in its pass, as TensorFlow's conversion adds
# them (lossscale.h, ls_lamb_param.indices), never whole
# (``Plan._own_op_gradients``).
DENSIFIED_WITH_SQUARES = SparseForm()

# A clip the kernels do not take, run as the inner optimizer's own ops on
# the unscaled gradients before the fused pass (``Plan.clip_by_own_ops``):
# tf_keras' legacy optimizers clip by every option set, by 0 too, in turn.
OWN_CLIP = ("own", None)

# The families whose native kernels take a sparse gradient's slices (the
# core's LS_OPTIM_SPARSE_FAMILIES: an element's update reads that element
# alone).
NATIVE_SPARSE = ("sgd", "adam", "adamax", "lion")
# Families with an op of their own (Plan.run): it takes no accumulator, clip
# or weight decay; Keras' own ops make those around it.
OWN_OP_FAMILIES = ("adafactor", "lamb")


class Plan:
    """One fused step: the family, the gradients (None dropped; dense ones as
    tensors, sparse ones as ``tf.IndexedSlices``) with their variables, the
    ``SparseForm`` of each sparse one (None for a dense one), the native
    form of each variable's weight decay, the inner optimizer's clip
    (``clip_of``), and whether several replicas take it (``replicated``:
    their gradients are summed by ``sum_replicas`` first)."""

    def __init__(self, family, inner, grads, variables, forms, clip=None):
        self.family = family
        self.inner = inner
        self.grads = [g if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)
                      for g in grads]
        self.variables = variables
        self.forms = forms
        self.decay = [_decay_form(inner, v, _grappler_reassociates_products())
                      for v in variables]
        # Where the graph optimizer folds a schedule's own products into the
        # decay's chain, the fused pass decays by the one factor that chain
        # becomes (_DECAY_FACTOR, the factor from ``decay_factor_probe``);
        # a variable of one element, whose chain the graph optimizer orders
        # by names, and Adafactor's (its op decays nothing) decay by Keras'
        # own ops (so rewritten as stock's are) before the fused pass, which
        # then decays nothing.
        scheduled = _decay_follows_schedule(inner)
        self.decay_by_ops = [bool(d) and (family.name == "adafactor" or form is BY_OWN_UPDATE
                                          or (scheduled and not _more_than_one(v)))
                             for d, form, v in zip(self.decay, forms, variables)]
        self.decay = [0 if by_ops else _DECAY_FACTOR if d and scheduled else d
                      for d, by_ops in zip(self.decay, self.decay_by_ops)]
        # Set by ``prepare_scalars`` where a variable decays by the factor:
        # the factor, and whether the probe found the chain to be one.
        self.decay_factor = self.decay_factor_taken = None
        self.clip = clip
        # With gradient accumulation, the clip of an update step's averages
        # (``_update_by_averages``); the step's own gradients unclipped.
        self.average_clip = None
        self.replicated = _replicas() > 1
        # A rank-0 gradient has nothing to broadcast: the graph optimizer
        # leaves its chain of products alone.
        merges = clip is not None and family.merges_global_clip(inner)
        self.merged_clip = [merges and len(v.shape) > 0 for v in variables]
        self.clip_scalars = []
        # Where Keras' own ops clip before the fused pass: whether the
        # gradients were finite before the clip, which may make an infinity
        # finite (``sum_replicas`` under several replicas with clipvalue:
        # every replica's; ``clip_by_own_ops``).
        self.finite_before_clip = None
        self.scalars = None
        self.sparse_scalars = None
        self.state = []
        # use_ema: Keras' momentum and 1 - momentum for the op to move the
        # averages with (``prepare_scalars``), and the variables whose
        # average an op moved (the rest move by Keras' own ops).
        self.ema = None
        self.ema_done = []

    def sum_replicas(self, rule, scale, unscale):
        """Under several replicas, stock's order before its update: this
        replica's gradients unscaled by ``rule`` (a ``_step`` rule) as stock
        unscales them, unless ``unscale`` is ``"none"`` (they came
        unscaled), clipped as Keras 3's inner optimizer clips them, then
        summed over the replicas as stock sums them (Keras 3's
        ``_all_reduce_sum_gradients``, tf_keras' loss-scale optimizer's
        ``aggregate_gradients``: one all-reduce of the whole list by the
        strategy's own cross-device op, so the same packing and order of
        additions give the same sums).  Returns the unscale the fused pass
        then applies: ``"none"``, or ``unscale`` without replicas.

        A sparse gradient's all-reduce is TensorFlow's: the replicas' slices
        and indices concatenated in replica order (no sum), which the
        family's sparse form then takes as a single replica's, a row's
        slices added in that order.

        Keras 3 clips each replica's gradients before their all-reduce (its
        ``_clip_gradients``, in ``_backend_apply_gradients``), each by its
        own norms: the clip here is that one call, its ops in its order,
        and the fused pass clips nothing.  ``global_clipnorm`` makes a
        sparse gradient dense there, so its sum is dense.  A non-finite
        gradient on any replica still reaches every sum as a NaN through a
        norm (its norm is not finite, and the clipped values of its replica
        are NaN); ``clipvalue`` clips an infinity to a finite value, so its
        replicas' own finite checks are summed too (``finite_before_clip``).
        tf_keras' loss-scale optimizer sums the gradients first and its
        inner optimizer clips the sums: the fused pass clips them there
        (with a sparse gradient, its own ops: ``clip_by_own_ops``)."""
        if not self.replicated:
            return unscale
        context = tf.distribute.get_replica_context()
        finite = None
        if unscale != "none":
            self.grads, finite = rule.unscale_and_check(self.grads, scale)
        if self.clip is not None and self.family.line is KERAS_3:
            if self.clip[0] == "value":
                if finite is None:
                    finite = native_ops.all_finite_grouped(self.grads)
                self.finite_before_clip = _step.all_replicas_finite(context, finite)
            self.grads = list(_compat.clip_gradients(self.inner, self.grads))
            self.forms = [form if isinstance(g, tf.IndexedSlices) else None
                          for g, form in zip(self.grads, self.forms)]
            self.clip = None
        self.grads = list(context.all_reduce(tf.distribute.ReduceOp.SUM, self.grads))
        return "none"

    def clip_by_own_ops(self, rule, scale, unscale):
        """tf_keras' clip of a step with a sparse gradient, before the fused
        pass: its optimizers clip a sparse gradient's slices as they came,
        duplicates apart (``clip_by_norm`` by the slices' norm,
        ``clip_by_global_norm`` by their ``l2_loss`` among the others'),
        before the update sums a row's slices, where the kernels clip a
        row's sum.  So with a clip and a sparse gradient, the gradients are
        unscaled as stock unscales them (by ``rule``, unless ``unscale`` is
        ``"none"``), checked, and clipped by the inner optimizer's own ops
        (``KerasLine.clip_by_own_ops``, which clips them all: a global
        norm takes in every one); the fused pass then clips nothing.  So
        too for a clip the kernels do not take (``OWN_CLIP``), with dense
        gradients alone.  Returns the unscale the fused pass applies.
        (Keras 3 clips a sparse gradient's slices as the kernels do, or
        densifies it.)"""
        if self.clip is None or (self.clip is not OWN_CLIP and (
                self.family.line is KERAS_3
                or not any(isinstance(g, tf.IndexedSlices) for g in self.grads))):
            return unscale
        if unscale == "none":
            finite = native_ops.all_finite_grouped(self.grads)
        else:
            self.grads, finite = rule.unscale_and_check(self.grads, scale)
        if self.finite_before_clip is not None:
            finite = tf.logical_and(finite, self.finite_before_clip)
        self.finite_before_clip = finite
        self.grads = self.family.line.clip_by_own_ops(self.inner, self.grads, self.variables)
        self.clip = None
        self.merged_clip = [False] * len(self.grads)
        return "none"

    def run(self, library, should_apply, scale, unscale, accumulation=None):
        """The family's native op over the plan (``prepare_scalars`` first):
        one over the dense gradients, unscaled (and, on the update step of
        an ``accumulation``, averaged with their accumulators) and clipped
        by the op, one over the sparse ones' dense terms; then the family's
        own state, when ``should_apply``.  Under a strategy it runs on this
        replica's device, over the copies there."""
        if any(self.decay_by_ops):
            _step.cond(should_apply, lambda: [
                _decay_like_stock(self.inner, local_copy(self.variables[i]))
                for i, by_ops in enumerate(self.decay_by_ops) if by_ops], lambda: None)
        own = [i for i, form in enumerate(self.forms) if form is BY_OWN_UPDATE]
        if self.family.name in OWN_OP_FAMILIES:
            rest = [i for i in range(len(self.forms)) if i not in own]
            if rest:
                launch = (self._launch_adafactor if self.family.name == "adafactor"
                          else self._launch_lamb)
                launch(library, should_apply, scale, unscale, rest)
            self._run_own_updates(should_apply, own, scale, unscale)
            return
        native = self.family.name in NATIVE_SPARSE
        dense = [i for i, form in enumerate(self.forms)
                 if form is None or (form is DENSIFIED_BY_CLIP and native)]
        densified = [i for i, form in enumerate(self.forms)
                     if (form is DENSIFIED_BY_CLIP and not native)
                     or form in (SUMMED_BY_ROW, DENSIFIED_BY_ACCUMULATION)]
        sparse = [i for i, form in enumerate(self.forms)
                  if form is not None and form not in (
                      DENSIFIED_BY_CLIP, SUMMED_BY_ROW, DENSIFIED_BY_ACCUMULATION, BY_OWN_UPDATE)]
        if accumulation is not None and len(dense) + len(densified) != len(self.forms):
            # decide() densifies every sparse gradient with accumulation.
            raise ValueError("gradient accumulation takes dense or densified gradients only")
        if dense:
            self._launch_dense(library, should_apply, dense, [self.grads[i] for i in dense],
                               scale, unscale, accumulation)
        if densified:
            self._launch_dense(library, should_apply, densified,
                               self._densified(densified, scale, unscale), scale, "none",
                               accumulation)
        if sparse:
            form = self.forms[sparse[0]]
            factor = form.slice_factor(self.learning_rate) if form.slice_factor else None
            self._launch(library, should_apply, sparse, [self.grads[i] for i in sparse], scale,
                         form.learning_rate(self.learning_rate), unscale, form.hyper,
                         clip=self.clip, slice_factor=factor, scalars=self.sparse_scalars,
                         family=form.family)
        for variable, value in self.state:
            variable = local_copy(variable)
            variable.assign(tf.where(should_apply, value, variable.read_value()))
        # After the family's own state moves, as Keras moves it before any
        # update_step (Nadam's u_product).
        self._run_own_updates(should_apply, own, scale, unscale)

    def _densified(self, which, scale, unscale):
        """The sparse gradients ``which`` (positions in the plan) dense, after
        the slices' checks: unscaled as stock unscales them, then densified
        as TensorFlow converts them (``_densify``)."""
        with tf.control_dependencies(self.checks):
            return [_densify(_unscaled_slices(self.grads[i], self.variables[i], scale, unscale))
                    for i in which]

    def _run_own_updates(self, should_apply, which, scale, unscale):
        if which:
            _step.cond(should_apply, lambda: self._update_by_own_ops(which, scale, unscale),
                       lambda: None)

    def _update_by_own_ops(self, which, scale, unscale):
        """The inner optimizer's own update of the variables ``which``
        (``BY_OWN_UPDATE``), after the slices' checks: each sparse gradient
        unscaled as stock unscales it and clipped as the inner optimizer
        clips it (a clip of its own: clipnorm or clipvalue)."""
        line = self.family.line
        with tf.control_dependencies(self.checks):
            for i in which:
                variable = self.variables[i]
                grad = _unscaled_slices(self.grads[i], variable, scale, unscale)
                if self.clip is not None:
                    grad = line.clip_by_own_ops(self.inner, [grad], [variable])[0]
                line.update_by_own_ops(self.inner, grad, variable, self.learning_rate)

    def _launch_adafactor(self, library, should_apply, scale, unscale, which):
        """Adafactor's op over the variables ``which`` (positions in the
        plan), their gradients dense (or densified by ``global_clipnorm``).
        The op divides float32 gradients by the scale; a clip, another
        unscale, another dtype or slices are Keras' own ops on the gradients
        unscaled as stock unscales them (a slice at a time), cast as
        Adafactor casts them (the op then unscales nothing).  Under a global
        clip, whose norm takes in every gradient, ``which`` is every
        variable: it densifies the sparse ones, which then take the op."""
        inner = self.inner
        variables = [self.variables[i] for i in which]
        grads, unscale = self._own_op_gradients(which, scale, unscale)
        factored = [i for i, v in enumerate(variables) if len(v.shape) >= 2]

        def handles(kind, which):
            return [local_copy(s).handle for s in self.family.line.slots(
                inner, kind, [variables[i] for i in which])]

        rho, beta, rest = self.scalars
        library.loss_scale_apply_adafactor(
            should_apply, [local_copy(v).handle for v in variables],
            handles("adafactor_r", factored), handles("adafactor_c", factored),
            handles("adafactor_v", range(len(variables))), grads, scale,
            tf.cast(rho, tf.float32), tf.cast(beta, tf.float32), tf.cast(rest, tf.float32),
            factored=factored, epsilon_1=float(inner.epsilon_1),
            epsilon_2=float(inner.epsilon_2), clip_threshold=float(inner.clip_threshold),
            rsqrt=bool(_rsqrt_form()), unscale=unscale)

    def _decayed_by(self, variables, decay, should_apply, launch):
        """``launch(decay, weight_decay)``, an op that decays ``variables`` as
        their plan's forms ``decay`` say.  Where a variable decays by the
        factor (``_DECAY_FACTOR``) and the probe's chain was not one factor,
        those variables decay by Keras' own ops first (when
        ``should_apply``), the op decaying nothing of them."""
        if _DECAY_FACTOR not in decay:
            launch(decay, self.weight_decay)
            return
        factored = [v for v, d in zip(variables, decay) if d == _DECAY_FACTOR]

        def by_ops():
            _step.cond(should_apply, lambda: [
                _decay_like_stock(self.inner, local_copy(v)) for v in factored], lambda: None)
            launch([0 if d == _DECAY_FACTOR else d for d in decay], self.weight_decay)

        _step.cond(self.decay_factor_taken, lambda: launch(decay, self.decay_factor), by_ops)

    def _own_op_gradients(self, which, scale, unscale, squares=False):
        """The gradients of the variables ``which`` as an op of a family of
        its own (``OWN_OP_FAMILIES``) takes them, and the unscale it then
        applies: float32 ones as they came; a clip, another unscale, another dtype
        or slices by Keras' own ops on the gradients unscaled as stock
        unscales them (a slice at a time) and cast as the family's update
        casts them (the op then unscales nothing).  Under a global clip,
        whose norm takes in every gradient, ``which`` is every variable: it
        densifies the sparse ones, which then take the op.

        With ``squares`` (Lamb's, whose op takes a sparse gradient as its
        slices and densifies them, and their squares, as Keras' ops do): a
        sparse gradient the clip leaves sparse stays so, its values
        float32 (scaled as they came where the op unscales them), after
        the slices' checks; dense float32 gradients, with no clip, as they
        came."""
        variables = [self.variables[i] for i in which]
        grads = [self.grads[i] for i in which]
        sparse = [isinstance(g, tf.IndexedSlices) for g in grads]
        if (self.clip is None and unscale in ("divide", "none")
                and all(g.dtype == tf.float32 and (not s or squares)
                        for g, s in zip(grads, sparse))):
            if not any(sparse):
                return grads, unscale
            with tf.control_dependencies(self.checks):
                return [_after_checks(g) if s else g for g, s in zip(grads, sparse)], unscale
        with tf.control_dependencies(self.checks):
            grads = [_unscaled_slices(g, v, scale, unscale)
                     if isinstance(g, tf.IndexedSlices)
                     else tf.cast(_unscaled_like_stock(g, scale, unscale), tf.float32)
                     for g, v in zip(grads, variables)]
            if self.clip is not None:
                grads = list(_compat.clip_gradients(self.inner, grads))
            if not squares:
                grads = [tf.convert_to_tensor(g) for g in grads]
        return grads, "none"

    def _launch_lamb(self, library, should_apply, scale, unscale, which):
        """Lamb's step of the variables ``which`` (positions in the plan),
        when ``should_apply``: its op decays each variable as Keras' weight
        decay does before any update (the plan's ``decay`` forms), moves m
        and v and makes each variable's u in one pass (gradients taken as
        ``_own_op_gradients`` takes them), then the norms of the variable
        and of u, their ratio and the variable's move by u follow as its
        update_step takes them (``_lamb_moves``)."""
        inner = self.inner
        line = self.family.line
        variables = [self.variables[i] for i in which]
        grads, unscale = self._own_op_gradients(which, scale, unscale, squares=True)
        sparse = [k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        bias_1, bias_2 = self.scalars
        learning_rate = self.learning_rate
        decay = [self.decay[i] for i in which]

        normed = _lamb_native(library, variables, shared_rate=len(self.variables) > 1)

        def update(decay, weight_decay):
            decayed = [k for k, d in enumerate(decay) if d]
            us, sums = library.loss_scale_lamb_moments(
                [local_copy(m).handle for m in line.slots(inner, "m", variables)],
                [local_copy(v).handle for v in line.slots(inner, "v", variables)],
                [g.values if k in sparse else g for k, g in enumerate(grads)], scale,
                tf.cast(bias_1, tf.float32), tf.cast(bias_2, tf.float32),
                [local_copy(variables[k]).handle for k in decayed],
                tf.cast(learning_rate, tf.float32), tf.cast(weight_decay, tf.float32),
                [tf.cast(grads[k].indices, tf.int64) for k in sparse],
                [local_copy(variables[k]).handle for k in normed if k not in decayed],
                decayed=decayed, decay=[decay[k] for k in decayed], sparse=sparse, normed=normed,
                one_minus_beta_1=float(np.float32(1 - inner.beta_1)),
                one_minus_beta_2=float(np.float32(1 - inner.beta_2)),
                epsilon=float(np.float32(inner.epsilon)), unscale=unscale)
            _lamb_moves(library, [local_copy(v) for v in variables], us, learning_rate,
                        inner.iterations, normed, sums)

        with tf.control_dependencies(self.checks):
            _step.cond(should_apply,
                       lambda: self._decayed_by(variables, decay, True, update), lambda: None)

    def accumulate(self, library, scale, unscale, accumulators):
        """A step that only accumulates: each gradient unscaled as stock
        unscales it and added to its accumulator as Keras adds it
        (``var.assign(var + grad)``), in one pass, by the native op's
        ``accumulate`` family (the accumulators its variables); a sparse one
        (``DENSIFIED_BY_ACCUMULATION``), which Keras' add densifies, as its
        slices, after their checks, in an op of its own: the kernel sums
        each named row's slices as TensorFlow's conversion does and adds
        them to that row alone."""
        zero = tf.constant(0.0, tf.float32)
        dense = [i for i, form in enumerate(self.forms) if form is None]
        sparse = [i for i, form in enumerate(self.forms) if form is DENSIFIED_BY_ACCUMULATION]
        if len(dense) + len(sparse) != len(self.forms):
            raise ValueError("gradient accumulation takes dense or densified gradients only")

        def add(which, grads, indices=(), slice_factor=()):
            library.loss_scale_apply_optimizer(
                tf.constant(True), [local_copy(accumulators[i]).handle for i in which], [],
                grads, scale, zero, zero, [], [], [], [], [], list(indices), list(slice_factor),
                [], family="accumulate", hyper=[], decay=[0] * len(which), unscale=unscale,
                sparse=list(range(len(indices))))

        if dense:
            add(dense, [self.grads[i] for i in dense])
        if sparse:
            with tf.control_dependencies(self.checks):
                indices = [tf.cast(self.grads[i].indices, tf.int64) for i in sparse]
                values = [tf.identity(self.grads[i].values) for i in sparse]
            add(sparse, values, indices, [tf.constant(1.0, tf.float32)])

    def _launch_dense(self, library, should_apply, which, grads, scale, unscale,
                      accumulation=None):
        """The native op over dense gradients ``grads`` of the variables
        ``which``, clipped by the plan's clip: those whose global clip the
        graph may reorder (``merged_clip``) in an op of their own."""
        apart = [k for k, i in enumerate(which) if not self.merged_clip[i]]
        merged = [k for k, i in enumerate(which) if self.merged_clip[i]]
        if apart:
            self._launch(library, should_apply, [which[k] for k in apart],
                         [grads[k] for k in apart], scale, self.learning_rate, unscale,
                         clip=self.clip, accumulation=accumulation)
        if merged:
            # Where the graph optimizer reorders `u * factor * learning_rate`
            # to `u * (factor * learning_rate)`, that product is these
            # variables' learning rate and their clip factor 1 (u * 1 is u).
            factor = self.clip_scalars[0]
            reordered = _graph_reorders_clip(factor, self.learning_rate, len(self.grads))
            self._launch(library, should_apply, [which[k] for k in merged],
                         [grads[k] for k in merged], scale,
                         tf.where(reordered, factor * self.learning_rate, self.learning_rate),
                         unscale, clip=self.clip,
                         clip_scalars=[tf.where(reordered, tf.constant(1.0), factor)],
                         accumulation=accumulation)

    def _launch(self, library, should_apply, which, grads, scale, learning_rate, unscale,
                hyper=None, clip=None, clip_scalars=None, slice_factor=None,
                accumulation=None, scalars=None, family=None):
        """One native op over the variables ``which`` (positions in the plan)
        and their ``grads``, clipped as ``clip`` says (with the
        plan's clip scalars, or ``clip_scalars``).  A sparse gradient goes in
        as its slices and their rows, after the checks of its indices (a
        bad index fails there, with the variable's name), each slice value
        times ``slice_factor`` (None: 1) before a row's sum, the family's
        step scalars ``scalars`` (None: the plan's).  With an
        ``accumulation`` the op averages each gradient with its variable's
        accumulator and zeroes it.  ``family``: the core's family to run (None:
        the plan's)."""
        mode, value = clip or ("none", 0.0)
        numbers = [float(h) for h in (hyper or self.family.hyper)(self.inner)]
        # Variables whose numbers differ (the forms the graph optimizer gives
        # their stock steps, Family.variable_hyper) run in ops of their own.
        groups = {}
        for k, i in enumerate(which):
            key = tuple(self.family.variable_hyper(self.inner, self.variables[i], list(numbers)))
            groups.setdefault(key, []).append(k)
        if len(groups) > 1:
            for key, ks in groups.items():
                self._launch(library, should_apply, [which[k] for k in ks],
                             [grads[k] for k in ks], scale, learning_rate, unscale,
                             hyper=lambda inner, key=key: list(key), clip=clip,
                             clip_scalars=(clip_scalars if clip_scalars is None or mode != "norm"
                                           else [clip_scalars[k] for k in ks]),
                             slice_factor=slice_factor, accumulation=accumulation,
                             scalars=scalars, family=family)
            return
        numbers = list(next(iter(groups)))

        def handles(variables):
            return [local_copy(v).handle for v in variables]

        sparse = [k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        indices = []
        if sparse:
            grads = list(grads)
            with tf.control_dependencies(self.checks):
                for k in sparse:
                    indices.append(tf.cast(grads[k].indices, tf.int64))
                    grads[k] = tf.identity(grads[k].values)
            slice_factor = [tf.constant(1.0, tf.float32) if slice_factor is None
                            else tf.cast(slice_factor, tf.float32)]
        else:
            slice_factor = []

        variables = [self.variables[i] for i in which]
        slots = [h for kind in self.family.slots(self.inner)
                 for h in handles(self.family.line.slots(self.inner, kind, variables))]
        if clip_scalars is None:
            clip_scalars = ([self.clip_scalars[i] for i in which] if mode == "norm"
                            else self.clip_scalars if mode == "global" else [])
        averages, ema = [], []
        if self.ema is not None:
            found = self.family.line.slots(self.inner, "average", variables)
            if all(a is not None for a in found):
                averages, ema = handles(found), self.ema
                self.ema_done.extend(variables)
        accumulators, accumulated = [], {}
        if accumulation is not None:
            accumulators = handles([accumulation.accumulators[i] for i in which])
            accumulated = dict(accumulation=accumulation.mode,
                               accumulation_steps=accumulation.steps)

        step_scalars = self.scalars if scalars is None else scalars
        decay = [self.decay[i] for i in which]

        def launch(numbers, decay, weight_decay):
            library.loss_scale_apply_optimizer(
                should_apply, handles(variables), slots, grads, scale, learning_rate,
                weight_decay, step_scalars, clip_scalars, [], averages, ema, indices,
                slice_factor, accumulators, family=family or self.family.name, hyper=numbers,
                decay=decay, unscale=unscale, clip=mode, clip_value=float(np.float32(value)) if mode in ("norm", "value")
                else 0.0, sparse=sparse, **accumulated)

        def run(numbers):
            self._decayed_by(variables, decay, should_apply,
                             lambda decay, weight_decay: launch(numbers, decay, weight_decay))

        # Forms of the stock step's graph that only its run tells: the
        # probes made here, outside any cond, where stock's step is made;
        # the kernel of each choice, the probes' choice run.
        _run_chosen(run, numbers, [(index, other, probe()) for index, other, probe
                                   in self.family.run_time_forms(self.inner, numbers)])

    def prepare_scalars(self):
        """The step's scalars, computed as Keras computes them, and the
        checks that must pass before any state moves (``self.checks``); made
        before the loss scale moves."""
        inner = self.inner
        line = self.family.line
        name = line.name_of(inner)
        lr = line.learning_rate(inner)
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
        wd = line.weight_decay(inner)
        self.learning_rate = lr
        self.weight_decay = tf.constant(0.0 if wd is None else float(wd), tf.float32)
        if _DECAY_FACTOR in self.decay:
            self.decay_factor, self.decay_factor_taken = decay_factor_probe(inner)
        state = list(self.family.state(inner))
        self.scalars = list(self.family.scalars(inner, lr, *[v for _, v in state]))
        sparse = [form for form in self.forms
                  if isinstance(form, SparseForm) and form.scalars is not None]
        self.sparse_scalars = list(sparse[0].scalars(inner, lr)) if sparse else None
        self.state = line.learning_rate_state(inner, lr) + state
        if line.folds_moving_average(inner):
            self.ema = list(line.moving_average_numbers(inner))
        return self.checks

    def check_finite(self, scale, unscale):
        """Whether every gradient is finite (a bool tensor), and the clip's
        numbers for the op (``clip_scalars``), from the gradients as they
        were made, before the loss scale moves.

        Without a norm to take, the read-only check of the gradients.  With
        one, the norms are the check: a finite sum of squares has only
        finite terms, so only a non-finite sum (an overflow, or a sum too
        large for float32) runs the read-only check, under a ``cond``.
        """
        mode = self.clip[0] if self.clip else None
        if mode not in ("norm", "global"):
            finite = native_ops.all_finite_grouped(self.grads)
            if self.finite_before_clip is not None:
                finite = tf.logical_and(finite, self.finite_before_clip)
            return finite
        clipnorm = self.clip[1]
        if mode == "norm":
            sums = tf.stack(_squared_norms(self.grads, scale, unscale, self.variables, mode))
            # Every variable's divisor in one chain of ops over the vector
            # of sums: element by element the same numbers as a chain per
            # variable, in a few ops where that made five per variable.
            self.clip_scalars = tf.unstack(_clip_by_norm_divisor(sums, clipnorm),
                                           num=len(self.grads))
        else:
            factor, sums = self.family.line.global_clip_factor(self.grads, scale, unscale,
                                                               self.variables, clipnorm)
            self.clip_scalars = [factor]
            sums = tf.stack(sums)
        sums_finite = tf.reduce_all(tf.math.is_finite(sums))
        return tf.cond(sums_finite, lambda: tf.constant(True),
                       lambda: native_ops.all_finite_grouped(self.grads))


class Accumulation:
    """The update step of Keras' gradient accumulation as the fused op takes
    it: ``accumulators``, each plan variable's (by position), read and
    zeroed in the op's pass; the average ``(g + accumulator) / steps`` of
    each unscaled gradient ``g`` as the stock step computes it: ``mode``
    ``"divide"`` (Keras' division, eagerly) or ``"multiply"`` (times
    float32(1 / steps): in a graph TensorFlow's constant folding turns the
    division by a constant into that product, ``_average_mode``)."""

    def __init__(self, accumulators, mode, steps):
        self.accumulators = accumulators
        self.mode = mode
        self.steps = int(steps)


def _average_mode():
    """How the stock step built here divides an accumulated sum by the
    steps: ``"multiply"`` (by the float32 reciprocal, rounded once) where
    TensorFlow's graph optimizer folds its constants, else ``"divide"``.
    (The same bits for a power of two.)"""
    return "multiply" if _grappler_folds_constants() else "divide"


def _run_chosen(run, numbers, choices):
    """``run(numbers)``, each ``(index, other, taken)`` of ``choices`` that
    is not taken (a bool tensor) putting ``other`` at ``index``."""
    if not choices:
        run(numbers)
        return
    (index, other, taken), rest = choices[0], choices[1:]
    off = list(numbers)
    off[index] = other
    tf.cond(taken, lambda: _run_chosen(run, numbers, rest),
            lambda: _run_chosen(run, off, rest))


class KerasLine:
    """Where Keras 3's optimizers keep what a fused step reads; a ``tf_keras``
    line (``tf_keras_families``) answers the same questions for its own."""

    def same_update_as(self, inner, cls):
        return _compat.same_update_as(inner, cls)

    def slots(self, inner, kind, variables):
        return _compat.optimizer_slots(inner, kind, variables)

    def name_of(self, inner):
        return inner.name

    def learning_rate(self, inner):
        """This step's learning rate, a float32 tensor, as the update reads it."""
        return tf.cast(inner.learning_rate, tf.float32)

    def learning_rate_state(self, inner, learning_rate):
        """``[(variable, value)]``: where the optimizer records this step's
        learning rate when the step applies."""
        del inner, learning_rate
        return []

    def learning_rate_is_variable(self, inner):
        """Whether the update reads its learning rate from a variable (not
        by evaluating a schedule)."""
        return _compat.optimizer_learning_rate_variable(inner) is not None

    def weight_decay(self, inner):
        return inner.weight_decay

    def variables_reason(self, inner, variables):
        """Why the optimizer cannot update ``variables`` itself, or None."""
        del inner, variables
        return None

    def densifies(self, clip):
        """Whether the clip ``clip`` (``clip_of``) makes a sparse gradient
        dense (Keras 3's ``global_clipnorm``: ``_densifies``)."""
        return _densifies(clip)

    def folds_moving_average(self, inner):
        """Whether the op moves each variable's EMA right after its update
        (Keras 3's ``use_ema`` without accumulation, whose average moves on
        steps that only accumulate too)."""
        return bool(getattr(inner, "use_ema", False)) and not _accumulation_steps(inner)

    def moving_average_numbers(self, inner):
        """This step's EMA momentum and ``1 - momentum``, float32 tensors,
        as the optimizer moves each average with them."""
        return _compat.moving_average_numbers(inner)

    def move_averages(self, inner, variables, done):
        """Moves the EMA of what the optimizer moves after an applied step
        (``variables``: the step's), but for the variables in ``done``
        (moved by the fused op), by Keras' own ops."""
        del variables
        _compat.update_moving_averages(inner, done)

    def overwrite_with_averages(self, inner, variables):
        """Assigns what the optimizer overwrites every
        ``ema_overwrite_frequency`` steps its EMA (``variables``: the
        step's)."""
        del variables
        _compat.overwrite_with_moving_averages(inner)

    def clip_of(self, inner):
        """The optimizer's clip as the native op takes it (``clip_of``), or
        the reason the step is left to the stock path."""
        return clip_of(inner)

    def clip_by_own_ops(self, inner, grads, variables):
        """``grads`` (unscaled) clipped by the optimizer's own ops."""
        del variables
        return list(_compat.clip_gradients(inner, grads))

    def update_by_own_ops(self, inner, grad, variable, learning_rate):
        """``variable`` updated by ``grad`` (unscaled, clipped) with the
        optimizer's own ops (``BY_OWN_UPDATE``)."""
        inner.update_step(grad, variable, learning_rate)

    def global_clip_factor(self, grads, scale, unscale, variables, clip_norm):
        """The factor of a global-norm clip, and the sums whose finiteness
        shows that every gradient is finite: Keras' ``clip_by_global_norm``,
        its squared norms as stock sums them (``_squared_norms``)."""
        sums = _squared_norms(grads, scale, unscale, variables, "global")
        return _global_clip_factor(sums, clip_norm), sums


KERAS_3 = KerasLine()


def _slices_checks(name, grad, variable):
    """The run-time checks of a sparse gradient against its variable: every
    index a row of it, one slice per index, each slice a row's shape.  A
    mismatch the static shapes show raises the same error at once, before
    any op is made (a scatter's shape inference would fail first, with no
    variable named)."""
    where = f"{name}: the gradient of {variable.name}"
    after = "; no variable was changed"
    _static_slices_check(where, after, grad, variable)
    var = _step.tf_variable(variable)
    var_shape = tf.shape(var, out_type=tf.int64)
    values_shape = tf.shape(grad.values, out_type=tf.int64)
    indices = tf.cast(grad.indices, tf.int64)
    return [
        tf.debugging.assert_equal(
            tf.rank(grad.values), tf.rank(var),
            message=f"{where} {_OTHER_RANK}{after}"),
        tf.debugging.assert_equal(
            values_shape[1:], var_shape[1:],
            message=f"{where} {_OTHER_SHAPE}{after}"),
        tf.debugging.assert_equal(
            tf.size(indices, out_type=tf.int64), values_shape[0],
            message=f"{where} {_NOT_ONE_INDEX}{after}"),
        tf.debugging.assert_non_negative(
            indices, message=f"{where} has a negative index{after}"),
        tf.debugging.assert_less(
            indices, var_shape[0],
            message=f"{where} has an index past its last row{after}"),
    ]


_OTHER_RANK = "has slices of another rank than its rows"
_OTHER_SHAPE = "has slices of another shape than its rows"
_NOT_ONE_INDEX = "has not one index per slice"


def _static_slices_check(where, after, grad, variable):
    values = tf.TensorShape(grad.values.shape)
    rows = tf.TensorShape(variable.shape)
    count = tf.TensorShape(grad.indices.shape).num_elements()
    why = None
    if values.rank is not None and rows.rank is not None:
        if values.rank != rows.rank:
            why = _OTHER_RANK
        elif not values[1:].is_compatible_with(rows[1:]):
            why = _OTHER_SHAPE
    if why is None and count is not None and values.rank and values[0] is not None \
            and values[0] != count:
        why = _NOT_ONE_INDEX
    if why is not None:
        raise tf.errors.InvalidArgumentError(None, None, f"{where} {why}{after}")


def _unscaled_like_stock(g, scale, unscale):
    """A dense gradient unscaled as the stock step unscales it: ``"divide"``,
    ``g / scale`` in float32 (Keras 3's ``ops.divide``); ``"multiply"``,
    ``g * (1 / scale)`` in g's dtype (TensorFlow 2.4); ``"none"``, as it is."""
    if unscale == "divide":
        return tf.math.divide(tf.cast(g, tf.float32), scale)
    if unscale == "multiply":
        return g * tf.cast(1.0 / scale, g.dtype)
    return g


def _unscaled_slices(grad, variable, scale, unscale):
    """``grad`` (a ``tf.IndexedSlices``) with its values unscaled as the
    stock step unscales them -- ``"divide"``: ``g / scale`` in float32 (Keras
    3's ``ops.divide``), ``"multiply"``: times ``1 / scale`` in their own
    dtype (TensorFlow 2.4), ``"none"``: as they are -- then float32, as the
    inner ``update_step`` casts them."""
    values = _unscaled_like_stock(grad.values, scale, unscale)
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


def _after_checks(slices):
    """``slices`` as they are, read after the ops in the context's control
    dependencies (the slices' checks)."""
    return tf.IndexedSlices(tf.identity(slices.values), tf.identity(slices.indices),
                            slices.dense_shape)


# ------------------------------------------------------------- families
# Each family's numbers in the order of its family_<name>.h.

def _by_own_update(why):
    """``BY_OWN_UPDATE`` on one replica; under several, the reason ``why``
    no kernel takes the sparse gradient, and the step is stock."""
    if _replicas() > 1:
        return why + ", and its own update does not run under several replicas"
    return BY_OWN_UPDATE


def _sgd_slots(inner):
    return ("momentum",) if float(inner.momentum) != 0 else ()


def _sgd_hyper(inner):
    return [inner.momentum, 1.0 if inner.nesterov else 0.0]


def _sgd_reason(inner):
    # The plan runs SGD's global clip in the graph's own order
    # (``Plan.merged_clip``), a learning rate of `factor * lr`, which leaves
    # no room for a weight decay's `wd * lr`.
    if _sgd_merges_global_clip(inner) and getattr(inner, "weight_decay", None) is not None:
        return ("global_clipnorm and weight decay with SGD in a graph (TensorFlow's graph "
                "optimizer reorders their products)")
    return None


def _sgd_merges_global_clip(inner):
    """Whether the stock step built here may multiply SGD's gradients by
    ``global_clipnorm``'s factor times the learning rate: SGD's only use of
    a gradient is `gradient * learning_rate` (Nesterov's second one merged
    with the first), which with the factor makes the chain `u * factor *
    learning_rate`; in a graph the graph optimizer may reorder it to `u *
    (factor * learning_rate)` (``_graph_reorders_clip`` tells when)."""
    clip = clip_of(inner)
    # Under several replicas the all-reduce's sum ends that chain: each
    # replica clips before it (``Plan.sum_replicas``), the sum is then
    # multiplied by the learning rate as written.
    return (_grappler_reassociates_products() and isinstance(clip, tuple)
            and clip[0] == "global" and _replicas() == 1)


def _sgd_sparse(inner, variable):
    # Keras' SGD.update_step on an IndexedSlices, with momentum:
    # ops.subtract(m * momentum, ops.multiply(g, lr)) densifies the
    # products (each slice times lr, then a row's slices summed): the
    # kernel takes those sums as its gradient, at a learning rate of 1
    # (x * 1 is x).  Without momentum Keras subtracts slice by slice
    # (scatter_sub, duplicates apart), and a weight decay's wd * lr has no
    # place beside that learning rate of 1: both run as Keras' own
    # update_step of the variable (BY_OWN_UPDATE) on one replica.
    if float(inner.momentum) == 0:
        return _by_own_update("Keras' SGD without momentum applies a sparse gradient slice "
                              f"by slice (scatter_sub) to {variable.name}")
    if _decay_form(inner, variable, False):
        return _by_own_update(f"SGD's weight decay of {variable.name}, whose gradient is sparse")
    return SparseForm(slice_factor=lambda lr: lr,
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
    return SparseForm()


def _adagrad_sparse(inner, variable):
    # Keras' Adagrad.update_step on an IndexedSlices: the squared slices
    # scatter-added to the accumulator, then ops.divide(lr * g, sqrt(acc +
    # eps)) -- the divisor dense, over the whole table, and checked whole
    # for zeros and NaNs -- scatter-subtracted from the variable.  The
    # accumulator starts at initial_accumulator_value and only ever adds
    # squares, so with that value >= 0 and epsilon a positive normal float32
    # no row of the divisor is 0 or NaN: stock takes its slices' own rows
    # (func_for_x1_indices), whose divisors are the same elementwise sqrt of
    # those rows alone.
    if not 0.0 <= float(inner.initial_accumulator_value) < float("inf"):
        return ("Keras' Adagrad with a sparse gradient and a negative or non-finite "
                f"initial_accumulator_value ({variable.name})")
    if not float(np.float32(inner.epsilon)) >= float(np.finfo(np.float32).tiny):
        return ("Keras' Adagrad with a sparse gradient and an epsilon that is not a "
                f"positive normal float32 number ({variable.name})")
    # The core's row family: the op scatters the slices as Keras does, and
    # divides by the square root itself (never TensorFlow's Rsqrt: stock
    # divides by a Gather of its Sqrt, which the graph optimizer leaves).
    return SparseForm(hyper=lambda inner: [inner.epsilon, 0.0])


def _rmsprop_sparse(inner, variable):
    # Keras' RMSprop.update_step on an IndexedSlices, without momentum, not
    # centered: ops.square and the product by 1 - rho map the slices,
    # ops.add(rho * v, ...) densifies them (a row's slices added in their
    # order onto 0: TensorFlow's conversion), then ops.divide(lr * g,
    # sqrt(v + eps)) -- the divisor dense, over the whole table, and
    # checked whole for zeros and NaNs -- is scatter-subtracted from the
    # variable.  With rho and 1 - rho positive finite float32 numbers and
    # epsilon a positive normal one, a velocity that starts at 0 only
    # ever takes non-negative sums (never 0 * inf), so no row of the
    # divisor is 0 or NaN: stock takes its slices' own rows
    # (func_for_x1_indices), whose divisors are the same elementwise sqrt
    # of those rows alone.  The core's row family takes them so, dividing
    # by the square root itself (never TensorFlow's Rsqrt: stock divides
    # by a Gather of its Sqrt, which the graph optimizer leaves).
    # Momentum adds the step densified into a dense slot, and the
    # centered form subtracts a densified average: those run Keras' own.
    if float(inner.momentum) > 0 or inner.centered:
        return _by_own_update(
            f"Keras' RMSprop with {'momentum' if float(inner.momentum) > 0 else 'centered'} "
            f"densifies each step of a sparse gradient ({variable.name}) into its slots, a "
            "form the fused kernel does not take")
    rho, rest = np.float32(inner.rho), np.float32(1 - inner.rho)
    if not (0.0 < rho < np.inf and 0.0 < rest < np.inf):
        return _by_own_update(
            f"Keras' RMSprop with a sparse gradient ({variable.name}) and rho = {inner.rho} "
            "(rho and 1 - rho must be positive for its velocity never to be 0 or NaN)")
    if not float(np.float32(inner.epsilon)) >= float(np.finfo(np.float32).tiny):
        return _by_own_update(
            f"Keras' RMSprop with a sparse gradient ({variable.name}) and an epsilon that is "
            "not a positive normal float32 number")
    # The core's row family: no momentum, not centered, a true division.
    return SparseForm(hyper=lambda inner: _rmsprop_hyper(inner)[:_RMSPROP_RSQRT] + [0.0, 0.0])


def _decay_like_stock(inner, variable):
    """Keras' ``_apply_weight_decay`` of one variable (its TensorFlow
    backend's), its own ops: in a graph, rewritten as stock's are."""
    variable.assign_sub(_decay_product(inner, variable))


def _decay_product(inner, x):
    """Keras' weight-decay product `x * wd * lr`, its ops as Keras makes
    them (the schedule evaluated anew)."""
    lr = tf.cast(inner.learning_rate, x.dtype)
    wd = tf.cast(inner.weight_decay, x.dtype)
    return x * wd * lr


# ls_decay's LS_DECAY_FACTOR: var - var * weight_decay, the op's weight
# decay the whole factor.
_DECAY_FACTOR = 3


def decay_factor_probe(inner):
    """The factor the graph optimizer makes of Keras 3's weight decay
    ``var * wd * lr`` with a learning-rate schedule, and whether the chain
    is that one product (two float32 tensors: the factor, a bool).

    The graph optimizer merges the schedule's own products into the chain
    and folds its constants with ``wd`` (ExponentialDecay: ``var * (pow *
    (initial_rate * wd))``), in an order the schedule's ops set.  The probe
    is the same chain, made by ``_decay_product`` as stock's decay is, on a
    variable-sized tensor the optimizer cannot fold: rewritten as stock's
    chains are, its value at 1 is the factor, and its other lanes say
    whether every value is multiplied by that factor alone (a chain left
    as written rounds differently on them, unless both orders agree on
    every value)."""
    lanes = tf.constant(_FACTOR_LANES) + _run_time_zero(inner.iterations)
    product = _decay_product(inner, lanes)
    factor = product[0]
    return factor, tf.reduce_all(tf.equal(product, lanes * factor))


def _run_time_zero(iterations):
    """0.0, a float32 tensor only the run knows (the ``iterations`` are never
    negative): a probe's constants plus it are not folded by the graph
    optimizer."""
    return tf.minimum(tf.cast(iterations, tf.float32), 0.0)


def _more_than_one(variable):
    """Whether ``variable`` has a known shape of more than one element."""
    n = variable.shape.num_elements()
    return n is not None and n > 1


_ADAM = dict(slots=_adam_slots, numbers=("beta_1", "beta_2", "epsilon"), hyper=_adam_hyper,
             scalars=_adam_scalars, supports=_AROUND_UPDATE, scales_gradient=False,
             sparse=_adam_sparse)


# The rmsprop family's numbers at LS_RMSPROP_RSQRT and LS_RMSPROP_PUSH_DOWN,
# and the step's forms there (family_rmsprop.h's ls_rmsprop_form).
_RMSPROP_RSQRT, _RMSPROP_PUSH_DOWN = 6, 7
_RMSPROP_LR_G, _RMSPROP_LR_RSQRT, _RMSPROP_G_RSQRT = 1.0, 2.0, 3.0


def _rsqrt_form():
    """1.0 where the stock step built here divides by TensorFlow's Rsqrt:
    the arithmetic optimizer, which reorders the products, also turns
    ``x / sqrt(y)`` into ``x * rsqrt(y)``."""
    return 1.0 if _grappler_reassociates_products() else 0.0


def _push_down_form():
    """1.0 where the stock step built here has a constant added to a
    difference pushed down, ``(v - s) + eps`` -> ``(eps - s) + v``: in a
    graph, by the graph optimizer's constant folding."""
    return 1.0 if _grappler_folds_constants() else 0.0


# Lanes (a, b) whose `(a - b) + eps` and `(eps - b) + a` round differently
# for some lanes at every epsilon but the special ones where both orders
# are exact on every value: b over many binades, a just above b.
_PUSH_DOWN_RNG = np.random.default_rng(0)
_PUSH_DOWN_B = np.exp2(_PUSH_DOWN_RNG.uniform(-30, 24, 256)).astype(np.float32)
_PUSH_DOWN_A = (_PUSH_DOWN_B + np.exp2(_PUSH_DOWN_RNG.uniform(-40, 8, 256))).astype(np.float32)


def _graph_pushes_down(epsilon, one):
    """Whether the graph optimizer's constant folding turned the stock step's
    `(v - s) + epsilon` into `(epsilon - s) + v`, as a bool tensor: it does
    in a tf.function whose outputs it knows, not in one that returns
    nothing.  A probe of the same chain on tensors it cannot fold (times
    ``one``, a run-time 1) is rewritten as stock's is, and reads back which
    form ran."""
    a = tf.constant(_PUSH_DOWN_A) * one
    b = tf.constant(_PUSH_DOWN_B) * one
    pushed = (tf.constant(np.float32(epsilon)) - b) + a
    return tf.reduce_all(tf.equal(a - b + epsilon, pushed))


def _run_time_one(inner):
    """1.0, a float32 tensor the graph optimizer cannot fold."""
    return tf.cast(tf.math.is_finite(tf.cast(inner.iterations, tf.float32)), tf.float32)


def _rmsprop_run_time_forms(inner, numbers):
    # Centered RMSprop's denominator v - a * a + epsilon.
    if not inner.centered or not numbers[_RMSPROP_PUSH_DOWN]:
        return []
    return [(_RMSPROP_PUSH_DOWN, 0.0,
             lambda: _graph_pushes_down(inner.epsilon, _run_time_one(inner)))]


def _rsqrt_reason(inner):
    del inner
    return _tf_rsqrt_reason() if _rsqrt_form() else None


def _tf_rsqrt_reason():
    """Why TensorFlow's Rsqrt here is not the one the kernels reproduce, or None."""
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
    return SparseForm()


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
    def hyper(inner):
        h = _lion_hyper(inner)
        h[1] = 1.0
        return h

    return SparseForm(slice_factor=lambda lr: tf.constant(_float32_complement(inner.beta_1),
                                                          tf.float32),
                      hyper=hyper)


def _adafactor_scalars(inner, lr):
    """Adafactor's rho_t, beta_2_t and 1 - beta_2_t, with Keras' own ops in
    its update_step's order (so a graph rewrites them as it rewrites
    stock's)."""
    from keras import ops

    # ``iterations``: under gradient accumulation, the update steps made.
    local_step = ops.cast(inner.iterations + 1, "float32")
    lr = ops.cast(lr, "float32")
    if not callable(inner._learning_rate) and inner.relative_step:  # pylint: disable=protected-access
        lr = ops.minimum(lr, 1 / ops.sqrt(local_step))
    rho = ops.minimum(lr, 1 / ops.sqrt(local_step))
    beta = ops.subtract(1, ops.power(local_step, inner.beta_2_decay))
    return [rho, beta, ops.subtract(1, beta)]


def _lamb_scalars(inner, lr):
    """Lamb's 1 - beta_1 ** step and 1 - beta_2 ** step, with Keras' own
    ops in its update_step's order."""
    from keras import ops

    del lr
    local_step = ops.cast(inner.iterations + 1, "float32")
    beta_1_power = ops.power(ops.cast(inner.beta_1, "float32"), local_step)
    beta_2_power = ops.power(ops.cast(inner.beta_2, "float32"), local_step)
    return [1.0 - beta_1_power, 1.0 - beta_2_power]


def _lamb_move(variable, update, learning_rate):
    """The rest of Keras' Lamb.update_step, its lines on the step's ``update``
    (u, made by LossScaleLambMoments): the norms of the variable and of u by
    TensorFlow's reductions, their ratio, the variable moved by it.

    Its ``ratio * lr * update`` is (ratio * lr) * u as written, and so in a
    graph: the graph optimizer sorts a chain's factors by size (two scalars
    before u), and where u has one element too, ties by the names of their
    tensors, which in Keras' step put lr's and the ratio's (``.../Cast``,
    ``.../ReadVariableOp`` or a schedule's scope; ``.../SelectV2``) before
    u's (``.../truediv``).  A one-element u of rank 1 or more is taken at
    rank 0 here, where nothing broadcasts and no name reorders it."""
    from keras import ops

    lr = ops.cast(learning_rate, variable.dtype)
    w_norm = ops.sqrt(ops.sum(ops.power(variable, 2)))
    g_norm = ops.sqrt(ops.sum(ops.power(update, 2)))
    ratio = ops.where(
        ops.greater(w_norm, 0),
        ops.where(ops.greater(g_norm, 0), (w_norm / g_norm), 1.0),
        1.0,
    )
    shape = tf.TensorShape(variable.shape)
    if shape.rank and shape.num_elements() == 1:
        variable.assign_sub(tf.reshape(ratio * lr * tf.reshape(update, []), shape))
    else:
        variable.assign_sub(ratio * lr * update)


def _lamb_native(library, variables, shared_rate):
    """The positions of ``variables`` whose Lamb lines after the update run
    natively (``_lamb_native_moves``): in a graph, those of more than one
    float32 element, where the native sums agree with TensorFlow's here.
    ``shared_rate``: whether stock's step hands its learning rate to more
    than one update (then the graph optimizer keeps it out of each chain
    of products, as here)."""
    if not (shared_rate and not tf.executing_eagerly() and _grappler_reassociates_products()
            and _native_norms_agree(library)):
        return []
    return [k for k, v in enumerate(variables)
            if _more_than_one(v) and tf.as_dtype(v.dtype) == tf.float32]


def _lamb_moves(library, variables, updates, learning_rate, iterations, native, sums):
    """``_lamb_move`` for every variable and its update, the variables
    ``native`` (``_lamb_native``) by native ops where these compute stock's
    bits (``_lamb_native_moves``, on their ``sums``); the rest by Keras'
    own ops.  ``iterations``: the optimizer's step counter, which the
    probe reads."""
    for k, (variable, update) in enumerate(zip(variables, updates)):
        if k not in native:
            _lamb_move(variable, update, learning_rate)
    if native:
        _lamb_native_moves(library, [variables[k] for k in native],
                           [updates[k] for k in native], learning_rate, iterations, sums)


def _lamb_native_moves(library, variables, updates, learning_rate, iterations, sums):
    """Keras' Lamb lines after its update (``_lamb_move``) for variables of
    more than one element, in a graph: the squares of every variable and
    update summed in TensorFlow's Sum order, ``sums`` (a row per variable,
    [variable's, update's]: LossScaleLambMoments takes them in its pass,
    each leaf while in cache), and each variable moved by its ``ratio *
    lr`` times its update (LossScaleApplyOptimizer's SGD at a learning
    rate of 1, the factor its variable's clip scalar: w - (u * c) * 1 is w
    - u * c), one read of each pair.  Stock's Keras ops make four passes
    more over each.  The norms and ratios are Keras' ops on the sums,
    element for element the same float32 operations.

    Both rest on the graph optimizer's rewrites of stock's lines, which a
    probe in the step reads: ``power(x, 2)`` must become ``Square`` (x *
    x: TensorFlow's Pow differs from it on many values), and ``ratio * lr
    * update`` must run as ``(ratio * lr) * update`` (``_lamb_move``).
    Should either not hold, every variable moves by Keras' own ops."""
    from keras import ops

    count = len(variables)
    w_norm = ops.sqrt(sums[:, 0])
    g_norm = ops.sqrt(sums[:, 1])
    ratio = ops.where(
        ops.greater(w_norm, 0),
        ops.where(ops.greater(g_norm, 0), (w_norm / g_norm), 1.0),
        1.0,
    )
    lr = ops.cast(learning_rate, "float32")
    factors = tf.unstack(ratio * lr)

    def by_native():
        one = tf.constant(1.0, tf.float32)
        library.loss_scale_apply_optimizer(
            tf.constant(True), [v.handle for v in variables], [], list(updates), one, one,
            tf.constant(0.0, tf.float32), [], factors, [], [], [], [], [], [],
            family="sgd", hyper=[0.0, 0.0], decay=[0] * count, unscale="none",
            clip="global", clip_value=0.0)

    _step.cond(_lamb_probe(lr, iterations), by_native,
               lambda: [_lamb_move(v, u, learning_rate) for v, u in zip(variables, updates)])


def _lamb_probe(lr, iterations):
    """Whether the graph optimizer rewrites this step's Lamb lines as
    ``_lamb_native_moves`` computes them (a bool tensor): ``power(x, 2)``
    on lanes where TensorFlow's Pow and x * x differ, and ``ratio * lr *
    x`` (a ratio only the run knows, ``lr`` the step's own) on lanes where
    its orders round differently, against ``(ratio * lr) * x``."""
    from keras import ops

    zero = _run_time_zero(iterations)
    checks = []
    pow_lanes = _pow_lanes()
    if pow_lanes.size:
        x = tf.constant(pow_lanes) + zero
        checks.append(tf.reduce_all(tf.equal(ops.power(x, 2), x * x)))
    lanes = tf.constant(_FACTOR_LANES) + zero
    ratio = tf.constant(np.float32(1.0 + 2.0**-7 + 2.0**-19)) + zero
    product = ratio * lr * lanes
    checks.append(tf.reduce_all(tf.equal(product, lanes * product[0])))
    return tf.reduce_all(tf.stack(checks))


_POW_LANES = []


def _pow_lanes():
    """Up to 64 float32 values whose TensorFlow Pow(x, 2) is not x * x
    (its float32 pow is not correctly rounded), found once per process,
    eagerly, among values across many binades; empty where none is."""
    if not _POW_LANES:
        rng = np.random.default_rng(11)
        values = (rng.uniform(1.0, 2.0, 4096) * np.exp2(rng.integers(-60, 60, 4096))).astype(
            np.float32)
        with tf.init_scope(), tf.device("/cpu:0"):
            x = tf.constant(values)
            differ = tf.not_equal(tf.pow(x, tf.constant(2.0, tf.float32)), x * x).numpy()
        _POW_LANES.append(values[differ][:64])
    return _POW_LANES[0]


def _adafactor_reason(inner):
    """Why Adafactor's step built here is not the one LossScaleApplyAdafactor
    reproduces, or None: its u = g / sqrt(v) is TensorFlow's Rsqrt in a
    graph, and its means are TensorFlow's Mean in this build's order."""
    reason = _rsqrt_reason(inner)
    if reason is not None:
        return reason
    library = native_ops.native_library_for([])
    if library is None or not _adafactor_agrees(library):
        return ("TensorFlow's Mean here does not add in the order LossScaleApplyAdafactor "
                "reproduces")
    return None


_ADAFACTOR_AGREES = {}


def _adafactor_agrees(library):
    """Whether the op's means are TensorFlow's here: once per process,
    eagerly, one step of the op against Keras' Adafactor arithmetic in
    TensorFlow's ops, on shapes that take each order (a middle axis with
    packets inside and across its slices and one unrolled by 4, a last axis
    over a tree, a full reduction over two shards)."""
    if "agree" not in _ADAFACTOR_AGREES:
        with tf.init_scope(), tf.device("/cpu:0"):
            rng = np.random.default_rng(11)
            shapes = [(3, 21, 13), (18, 40), (2, 9000), (700, 450)]
            agree = True
            for shape in shapes:
                w0 = rng.standard_normal(shape).astype(np.float32)
                g = tf.constant(rng.standard_normal(shape).astype(np.float32))
                r0 = rng.uniform(0.5, 2.0, shape[:-1]).astype(np.float32)
                c0 = rng.uniform(0.5, 2.0, shape[:-2] + shape[-1:]).astype(np.float32)
                rho, beta, rest, e1, e2, clip = 0.01, 0.75, 0.25, 1e-30, 1e-3, 1.0
                s = tf.square(g) + e1
                r = beta * tf.constant(r0) + rest * tf.reduce_mean(s, axis=-1)
                c = beta * tf.constant(c0) + rest * tf.reduce_mean(s, axis=-2)
                v = (tf.expand_dims(r / tf.reduce_mean(r, axis=-1, keepdims=True), -1)
                     * tf.expand_dims(c, -2))
                u = g / tf.sqrt(v)
                alpha = tf.maximum(e2, tf.sqrt(tf.reduce_mean(tf.square(w0)))) * rho
                m = tf.maximum(1.0, tf.sqrt(tf.reduce_mean(tf.square(u))) / clip)
                want = w0 - alpha * (u / m)
                # Plain resource variables: a strategy's scope would mirror tf.Variable's.
                made = [_compat.plain_resource_variable(x)
                        for x in (w0, r0, c0, np.zeros(shape, np.float32))]
                library.loss_scale_apply_adafactor(
                    tf.constant(True), [made[0].handle], [made[1].handle], [made[2].handle],
                    [made[3].handle], [g], tf.constant(1.0), tf.constant(rho),
                    tf.constant(beta), tf.constant(rest), factored=[0], epsilon_1=e1,
                    epsilon_2=e2, clip_threshold=clip, rsqrt=False, unscale="none")
                agree = agree and bool(tf.reduce_all(tf.equal(
                    tf.bitcast(want, tf.int32), tf.bitcast(made[0].read_value(), tf.int32))))
        _ADAFACTOR_AGREES["agree"] = agree
    return _ADAFACTOR_AGREES["agree"]


# Most derived class first: AdamW is an Adam.
FAMILIES = (
    Family("adam", keras.optimizers.AdamW, **_ADAM),
    Family("adam", keras.optimizers.Adam, **_ADAM),
    Family("sgd", keras.optimizers.SGD, slots=_sgd_slots, numbers=("momentum",),
           hyper=_sgd_hyper, unsupported=_sgd_reason, supports=_AROUND_UPDATE,
           sparse=_sgd_sparse, merges_global_clip=_sgd_merges_global_clip),
    Family("rmsprop", keras.optimizers.RMSprop, slots=_rmsprop_slots,
           numbers=("rho", "momentum", "epsilon"), hyper=_rmsprop_hyper,
           unsupported=_rsqrt_reason, supports=_AROUND_UPDATE,
           run_time_forms=_rmsprop_run_time_forms, sparse=_rmsprop_sparse),
    Family("adagrad", keras.optimizers.Adagrad, slots=lambda inner: ("accumulator",),
           numbers=("epsilon",), hyper=_adagrad_hyper, unsupported=_rsqrt_reason,
           supports=_AROUND_UPDATE, sparse=_adagrad_sparse),
    Family("adamax", keras.optimizers.Adamax, slots=lambda inner: ("adamax_m", "u"),
           numbers=("beta_1", "beta_2", "epsilon"), hyper=_adamax_hyper,
           scalars=_adamax_scalars, supports=_AROUND_UPDATE, scales_gradient=False,
           sparse=_adamax_sparse),
    Family("nadam", keras.optimizers.Nadam, slots=lambda inner: ("m", "v"),
           numbers=("beta_1", "beta_2", "epsilon"), hyper=_nadam_hyper,
           scalars=_nadam_scalars, state=_nadam_state, supports=_AROUND_UPDATE,
           sparse=lambda inner, v: _by_own_update(
               "Keras' Nadam takes a row's sum of ((1 - u_t) * slice) / (1 - u_product) "
               "for a sparse gradient, a term the fused kernel does not take")),
    Family("lion", keras.optimizers.Lion, slots=lambda inner: ("m",),
           numbers=("beta_1", "beta_2"), hyper=_lion_hyper, supports=_AROUND_UPDATE,
           sparse=_lion_sparse),
    # Its own op (LossScaleLambMoments, Plan.run): its update takes the
    # norms of each variable and of its u between the moments and the move.
    Family("lamb", keras.optimizers.Lamb, slots=lambda inner: ("m", "v"),
           numbers=("beta_1", "beta_2", "epsilon"), hyper=lambda inner: [],
           scalars=_lamb_scalars, supports=_AROUND_UPDATE, scales_gradient=False,
           sparse=lambda inner, v: DENSIFIED_WITH_SQUARES),
    # Its own op (LossScaleApplyAdafactor, Plan.run): r, c and v are not
    # shaped as the variable, and its update takes means over each one.
    Family("adafactor", keras.optimizers.Adafactor,
           slots=lambda inner: ("adafactor_r", "adafactor_c", "adafactor_v"),
           numbers=("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold"),
           hyper=lambda inner: [], scalars=_adafactor_scalars, supports=_AROUND_UPDATE,
           unsupported=_adafactor_reason, scales_gradient=False,
           sparse=lambda inner, v: _by_own_update(
               "Keras' Adafactor squares a sparse gradient's slices before it densifies "
               "them (a row's duplicates' squares summed), which the fused op does not take")),
)


# ------------------------------------------------------ tf_keras families

class _TfKerasLine(KerasLine):
    """``tf_keras``' current optimizers (``tf_keras.optimizers``): slots in
    lists indexed by the variable's key, a learning-rate schedule recorded
    in ``_current_learning_rate`` by each applied step before the updates."""

    def same_update_as(self, inner, cls):
        return _compat.tf_keras_same_update_as(inner, cls)

    def slots(self, inner, kind, variables):
        return _compat.tf_keras_optimizer_slots(inner, kind, variables)

    def learning_rate(self, inner):
        schedule, _ = _compat.tf_keras_learning_rate_schedule(inner)
        if schedule is None:
            return tf.cast(inner.learning_rate, tf.float32)
        return tf.cast(schedule(inner.iterations), tf.float32)

    def learning_rate_state(self, inner, learning_rate):
        _, recorded = _compat.tf_keras_learning_rate_schedule(inner)
        return [] if recorded is None else [(recorded, learning_rate)]

    def learning_rate_is_variable(self, inner):
        # A schedule's value is read back from _current_learning_rate.
        return True

    def variables_reason(self, inner, variables):
        unknown = _compat.tf_keras_unknown_variable(inner, variables)
        return None if unknown is None else \
            f"the inner optimizer was not built with {unknown.name}"

    def folds_moving_average(self, inner):
        # No accumulation: every applied step moves the averages.
        return bool(inner.use_ema)

    def moving_average_numbers(self, inner):
        # Its _update_model_variables_moving_average: ema_momentum * average
        # + (1 - ema_momentum) * var, the numbers Python floats made float32
        # (no momentum 0 on the first step, unlike Keras 3's).
        momentum = float(inner.ema_momentum)
        return (tf.constant(np.float32(momentum)), tf.constant(np.float32(1 - momentum)))

    def move_averages(self, inner, variables, done):
        # Its EMA moves the averages of the step's variables alone (those
        # with a gradient), after every update.
        done = {_compat.variable_key(inner, v) for v in done}
        rest = [v for v in variables if _compat.variable_key(inner, v) not in done]
        if rest:
            _compat.tf_keras_update_moving_averages(inner, rest)

    def overwrite_with_averages(self, inner, variables):
        _compat.tf_keras_overwrite_with_moving_averages(inner, variables)

    def densifies(self, clip):
        # tf.clip_by_global_norm clips a sparse gradient's slices (its norm
        # is their l2_loss): the gradient stays sparse.
        del clip
        return False

    def global_clip_factor(self, grads, scale, unscale, variables, clip_norm):
        # Its _clip_gradients is tf.clip_by_global_norm, as the legacy ones'.
        del variables
        return _tf_global_clip_factor(grads, scale, unscale, clip_norm)


class _TfKerasLegacyLine(KerasLine):
    """``tf_keras``' legacy optimizers (``tf_keras.optimizers.legacy``):
    slots by ``get_slot``, the learning rate of ``_decayed_lr``, every other
    number read from its hyperparameter variable at every step (the
    ``legacy_*`` kernels take them as scalars), no weight decay."""

    def same_update_as(self, inner, cls):
        return _compat.tf_keras_legacy_same_update_as(inner, cls)

    def slots(self, inner, kind, variables):
        return [inner.get_slot(v, kind) for v in variables]

    def name_of(self, inner):
        return type(inner).__name__

    def learning_rate(self, inner):
        return _compat.tf_keras_legacy_learning_rate(inner)

    def weight_decay(self, inner):
        return None

    def folds_moving_average(self, inner):
        return False

    def densifies(self, clip):
        # TensorFlow's clip_by_global_norm keeps a tf.IndexedSlices sparse.
        return False

    def clip_of(self, inner):
        """Its ``_transform_gradients`` clips by every option that is not
        None: by 0 too (every gradient 0, or NaN), and by ``clipvalue``
        before a norm when both are set.  Those run as its own ops before
        the fused pass (``OWN_CLIP``: ``Plan.clip_by_own_ops``); each value
        other than 0 must be a positive finite number, as for one clip."""
        given = [attr for attr, _ in _CLIP_OPTIONS if getattr(inner, attr, None) is not None]
        zero = [attr for attr in given
                if isinstance(getattr(inner, attr), (int, float, np.number))
                and not isinstance(getattr(inner, attr), bool) and getattr(inner, attr) == 0]
        if len(given) > 1 or zero:
            for attr in given:
                if attr not in zero:
                    reason = _clip_value(inner, attr)
                    if isinstance(reason, str):
                        return reason
            return OWN_CLIP
        return clip_of(inner)

    def global_clip_factor(self, grads, scale, unscale, variables, clip_norm):
        del variables
        return _tf_global_clip_factor(grads, scale, unscale, clip_norm)

    def clip_by_own_ops(self, inner, grads, variables):
        return _compat.tf_keras_legacy_transform_gradients(inner, grads, variables)

    def update_by_own_ops(self, inner, grad, variable, learning_rate):
        # Its apply_gradients hands the slices to this method, duplicates
        # and all; it prepares its own learning rate (as ``learning_rate``).
        del learning_rate
        _compat.tf_keras_legacy_apply_sparse(inner, grad.values, variable, grad.indices)


def _tf_global_clip_factor(grads, scale, unscale, clip_norm):
    """``tf.clip_by_global_norm``'s factor (tf_keras' clip, current and
    legacy), as its ``global_norm`` takes it: each gradient's ``l2_loss``
    (TensorFlow's own op, on the gradient unscaled as stock unscales it,
    whose sum is not in the order of the native sums), their sum times 2,
    its root; and the halves, whose finiteness shows every gradient's."""
    halves = [tf.nn.l2_loss(_unscaled_like_stock(g, scale, unscale)) for g in grads]
    use_norm = tf.sqrt(tf.reduce_sum(tf.stack(halves)) * tf.constant(2.0, tf.float32))
    scale_for_finite = clip_norm * tf.minimum(1.0 / use_norm,
                                              tf.constant(1.0, tf.float32) / clip_norm)
    return scale_for_finite + (use_norm - use_norm), halves


TF_KERAS = _TfKerasLine()
TF_KERAS_LEGACY = _TfKerasLegacyLine()


def _tf_keras_optimizers(legacy=False):
    import tf_keras  # pylint: disable=import-outside-toplevel

    return tf_keras.optimizers.legacy if legacy else tf_keras.optimizers


def _first_reason(*checks):
    """The reason of the first ``(holds, reason)`` pair that holds, or None."""
    return next((reason for holds, reason in checks if holds), None)


def _tf_keras_reason(inner):
    return _first_reason(
        (inner.jit_compile, "the inner optimizer compiles its update with XLA (jit_compile)"),
        (_compat.tf_keras_uses_dtensor(inner), "the inner optimizer runs under DTensor"),
        (inner.use_ema and (isinstance(inner.ema_momentum, bool)
                            or not isinstance(inner.ema_momentum, (int, float, np.number))),
         "the inner optimizer's ema_momentum is not a number"),
        # Under a strategy tf_keras moves each average on each device (the
        # strategy's update of every copy, the arithmetic of one device),
        # which the op does over each replica's copies; its overwrite is
        # the strategy's update calls, which a replica's step cannot make.
        (inner.use_ema and bool(inner.ema_overwrite_frequency) and tf.distribute.has_strategy(),
         "tf_keras' EMA with ema_overwrite_frequency under a tf.distribute strategy (it "
         "overwrites the variables by the strategy's update calls)"))


def _tf_keras_sgd_sparse(inner, variable):
    # tf_keras' SGD.update_step on a row's summed slices s (SUMMED_BY_ROW):
    # m = m * momentum, s * -lr scatter-added, then w + m (momentum 0 too:
    # tf_keras keeps the slot) -- the dense m * mu - g * lr of the densified
    # sums, a row without slices subtracting 0 * lr, which changes no value.
    # Nesterov then adds s * -lr to w before m * momentum, (w - s * lr) +
    # m * momentum where the dense update rounds w + (m * momentum - s * lr):
    # the core's summed family tf_keras_sgd (family_tf_keras_sgd.h), with
    # the dense numbers.  (A clip runs before, as its own ops:
    # Plan.clip_by_own_ops.)
    del variable
    return SparseForm(family="tf_keras_sgd") if inner.nesterov else SUMMED_BY_ROW


def _tf_keras_adam_sparse(inner, variable):
    # tf_keras' Adam.update_step (AdamW's alike, after _apply_weight_decay)
    # on a row's summed slices s: m.assign_add(-m * (1 - beta_1)) on every
    # row, s * (1 - beta_1) scatter-added (v alike, of tf.square(s)), then
    # amsgrad and the variable as the dense update: the core's summed
    # family tf_keras_adam, with Adam's numbers (family_tf_keras_adam.h).
    del inner, variable
    return SparseForm(family="tf_keras_adam")


def _tf_keras_rmsprop_sparse(inner, variable):
    # tf_keras' RMSprop.update_step on a row's summed slices s: velocity
    # (and average_gradient) times rho on every row, s's terms scatter-added,
    # the denominator of every row, lr * s * rsqrt(d) of the named rows'
    # denominators gathered (TensorFlow's Rsqrt rounding an element by where
    # it falls in that tensor), then scattered to the momentum or the
    # weight: the core's summed family tf_keras_rmsprop, with the dense
    # numbers (family_tf_keras_rmsprop.h).  In a graph, the arithmetic
    # optimizer regroups that chain as a larger variable's dense one, lr
    # with rsqrt(d) first, but for a one-element variable's, whose three
    # factors tie in size and are ordered by the names of their tensors.
    del inner
    if (_grappler_reassociates_products()
            and tf.TensorShape(variable.shape).num_elements() == 1):
        return (f"a sparse (IndexedSlices) gradient of a one-element variable ({variable.name}) "
                "in a graph (TensorFlow's graph optimizer orders tf_keras RMSprop's "
                "lr * g * rsqrt(d) of the gathered rows by the names of its tensors)")
    return SparseForm(family="tf_keras_rmsprop")


def _tf_keras_adam_reason(inner):
    if getattr(inner, "adaptive_epsilon", False):
        return "the inner optimizer sets adaptive_epsilon"
    return _tf_keras_reason(inner)


def _tf_keras_rmsprop_hyper(inner):
    # tf_keras multiplies by tf.math.rsqrt, eagerly too: lr * g * rsqrt(d),
    # the kernel's LS_RMSPROP_LR_G.  In a graph, the arithmetic optimizer
    # regroups that chain (_tf_keras_rmsprop_variable_hyper).
    return [inner.rho, 1 - inner.rho, inner.epsilon, inner.momentum,
            1.0 if inner.momentum > 0 else 0.0, 1.0 if inner.centered else 0.0,
            _RMSPROP_LR_RSQRT if _grappler_reassociates_products() else _RMSPROP_LR_G,
            _push_down_form()]


def _tf_keras_rmsprop_variable_hyper(inner, variable, numbers):
    """The graph optimizer's lr * g * rsqrt(d) of ``variable`` (its
    MinimizeBroadcasts: the chain's factors stably sorted by size, the
    first two multiplied first).  A rank-0 variable's has nothing to
    broadcast: as written.  A larger one's takes lr, the one scalar, with
    rsqrt(d): g * (lr * rsqrt(d)).  A one-element one's three factors tie,
    and stay in their canonical order, by the names of their tensors:
    rsqrt(d) (``.../Rsqrt_<k>``, before the ``.../mul_<k>`` of lr * g),
    then lr or g, whichever sorts first.  Unclipped, g comes into the
    stock step's cond from outside it, under a name its lowering gives it
    (``_graph_orders_gradient_first``).  Clipped, g is the clip's output,
    made in the same name scope as lr's read (``.../ReadVariableOp_<k>``;
    not so under a MirroredStrategy, ``_tf_keras_rmsprop_variables_reason``),
    and named after the clip (``.../clip_by_value_<k>``,
    ``.../clip_by_norm_<k>/truediv``, ``.../clip_by_global_norm/mul_<k>``),
    which sorts after it: lr first, g * (lr * rsqrt(d)), as a larger
    variable's."""
    if numbers[_RMSPROP_RSQRT] == _RMSPROP_LR_RSQRT:
        if len(variable.shape) == 0:
            numbers[_RMSPROP_RSQRT] = _RMSPROP_LR_G
        elif (tf.TensorShape(variable.shape).num_elements() == 1
              and not isinstance(clip_of(inner), tuple)):
            numbers[_RMSPROP_RSQRT] = _RMSPROP_G_RSQRT
    return numbers


def _tf_keras_rmsprop_run_time_forms(inner, numbers):
    forms = _rmsprop_run_time_forms(inner, numbers)
    if numbers[_RMSPROP_RSQRT] == _RMSPROP_G_RSQRT:
        forms.append((_RMSPROP_RSQRT, _RMSPROP_LR_RSQRT,
                      lambda: _graph_orders_gradient_first(_run_time_one(inner))))
    return forms


def _graph_orders_gradient_first(one):
    """Whether the graph optimizer turns a one-element variable's
    lr * g * rsqrt(d) in tf_keras' step into (rsqrt(d) * g) * lr, rather
    than (rsqrt(d) * lr) * g, as a bool tensor.

    It orders the factors by the names of their tensors, a commutative
    op's inputs sorted (its canonical form): tf_keras reads lr inside
    the stock step's cond, and g comes into that cond from an IdentityN
    (the gradients' all-reduce) outside it, under a name the cond's
    lowering gives it, which sorts before lr's or after it by the name
    scope the cond is made in and by how the function is called.
    Tracing cannot tell which: a probe of the same chain, in a cond of its
    own made here, its g from an IdentityN outside it, is named and
    rewritten as stock's is, and reads back which order ran."""
    # Eight of _PROBE_LANES as g: at rsqrt(3) and lr 0.001, the two orders
    # round five of them differently.
    lanes = tf.identity_n([tf.constant(_PROBE_LANES[k:k + 1]) * one for k in range(8)])
    lr = tf.constant(np.float32(1e-3)) * one
    d = tf.constant([np.float32(3.0)]) * one

    def chains():
        # lr read, and rsqrt(d) made, inside the cond, as tf_keras' are.
        lr_in, rsqrt = tf.math.abs(lr), tf.math.rsqrt(d)
        return [lr_in * g * rsqrt for g in lanes] + [lr_in, rsqrt]

    def nothing():
        return [tf.zeros([1])] * len(lanes) + [tf.zeros([]), tf.zeros([1])]

    *got, lr_in, rsqrt = tf.cond(one > 0, chains, nothing)
    # Rank 0: nothing to broadcast, nothing regrouped.
    r = tf.reshape(rsqrt, [])
    return tf.reduce_all([tf.equal(tf.reshape(c, []), (r * tf.reshape(g, [])) * lr_in)
                          for c, g in zip(got, lanes)])


def _tf_keras_rmsprop_reason(inner):
    return _tf_keras_reason(inner) or _tf_rsqrt_reason()


def _tf_keras_rmsprop_variables_reason(inner, variables):
    # A clipped one-element variable's lr * g * rsqrt(d) is ordered by the
    # names of lr's read and of the clip's op (_tf_keras_rmsprop_variable_
    # hyper).  A MirroredStrategy (of one replica too) reads lr in its
    # update scope (.../update_<replica>_<k>/), which sorts after replica
    # 0's clip (g * rsqrt(d) first) and before the others' (replica_<r>/...,
    # lr * rsqrt(d) first, by the optimizer's name).
    strategy = tf.distribute.get_strategy()
    if (tf.distribute.has_strategy() and not isinstance(strategy, tf.distribute.OneDeviceStrategy)
            and _grappler_reassociates_products() and isinstance(clip_of(inner), tuple)):
        for v in variables:
            shape = tf.TensorShape(v.shape)
            if shape.rank and shape.num_elements() == 1:
                return (f"{_CLIP_ATTRS[clip_of(inner)[0]]} with a one-element variable "
                        f"({v.name}) under a {type(strategy).__name__} in a graph "
                        "(TensorFlow's graph optimizer orders tf_keras RMSprop's "
                        "lr * g * rsqrt(d) by names the strategy's update scopes change)")
    return None


def _legacy_hyper(inner, name):
    return _compat.tf_keras_legacy_hyper(inner, name)


def _legacy_epsilon(inner):
    return tf.convert_to_tensor(inner.epsilon, tf.float32)


def _legacy_reason(inner):
    return _first_reason(
        (inner.gradient_transformers, "the inner optimizer has gradient_transformers"),
        (_compat.tf_keras_legacy_aggregates_its_own_way(inner),
         "the inner optimizer has a gradient_aggregator of its own"))


def _legacy_momentum_flag(inner):
    return 1.0 if _compat.tf_keras_legacy_has_momentum(inner) else 0.0


def _legacy_adam_powers(inner):
    """tf_keras' legacy Adam._prepare_local: beta_1, beta_2 and their
    powers at this step."""
    local_step = tf.cast(inner.iterations + 1, tf.float32)
    beta_1_t = _legacy_hyper(inner, "beta_1")
    beta_2_t = _legacy_hyper(inner, "beta_2")
    return beta_1_t, beta_2_t, tf.pow(beta_1_t, local_step), tf.pow(beta_2_t, local_step)


def _legacy_adam_scalars(inner, lr):
    # What ResourceApplyAdam computes from _prepare_local's inputs: 1 - beta
    # in float32, alpha.
    beta_1_t, beta_2_t, beta_1_power, beta_2_power = _legacy_adam_powers(inner)
    alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    return [1 - beta_1_t, 1 - beta_2_t, _legacy_epsilon(inner), alpha]


def _legacy_rmsprop_scalars(inner, lr):
    rho = _legacy_hyper(inner, "rho")
    return [rho, 1.0 - rho, _legacy_hyper(inner, "momentum"), _legacy_epsilon(inner)]


def _legacy_adam_sparse_scalars(inner, lr):
    # tf_keras' legacy Adam._resource_apply_sparse: its own ops, with
    # beta_1 and beta_2 themselves and _prepare_local's
    # lr * (sqrt(1 - beta_2^t) / (1 - beta_1^t)) (family_legacy_adam.h).
    beta_1_t, beta_2_t, beta_1_power, beta_2_power = _legacy_adam_powers(inner)
    alpha = lr * (tf.sqrt(1 - beta_2_power) / (1 - beta_1_power))
    return [beta_1_t, beta_2_t, _legacy_epsilon(inner), alpha]


def _legacy_scalar_first():
    """1.0 where the stock step built here has a sparse gradient's
    ``(g * g) * (1 - beta)`` (legacy Adam's, RMSprop's without momentum)
    regrouped ``((1 - beta) * g) * g``: in a graph that TensorFlow's graph
    optimizer rewrites (MinimizeBroadcasts, the scalar first)."""
    return 1.0 if _grappler_reassociates_products() else 0.0


def _legacy_sparse(inner, variable):
    """How a legacy family takes a sparse gradient of ``variable``.

    tf_keras' ``_resource_apply_sparse_duplicate_indices`` sums the slices
    of each row first (``_deduplicate_indexed_slices``: ``unique``, then
    ``unsorted_segment_sum``, a row's slices added in their order onto 0),
    then updates by TensorFlow's ``ResourceSparseApply*`` kernels, which
    move the rows named alone (SGD's momentum, RMSprop's with momentum,
    Adagrad), or by its own ops (Adam; RMSprop without momentum), which
    decay the slots of every row first.  The core sums the slices so and
    runs each family's sparse form (``family_legacy_<name>.h``).  A clip
    runs before, as its own ops (``Plan.clip_by_own_ops``: it clips the
    slices as they came, duplicates apart).  SGD without momentum adds the
    slices to the variable one by one (``ResourceScatterAdd``, duplicates
    apart): on one replica, that is its own op (``BY_OWN_UPDATE``)."""
    if isinstance(inner, _tf_keras_optimizers(legacy=True).SGD) \
            and not _legacy_momentum_flag(inner):
        return _by_own_update(
            "tf_keras' legacy SGD without momentum adds a sparse gradient's slices to "
            f"{variable.name} one by one (ResourceScatterAdd), duplicates apart")
    if isinstance(inner, _tf_keras_optimizers(legacy=True).Adam):
        return SparseForm(scalars=_legacy_adam_sparse_scalars)
    return SparseForm()


def _legacy_family(name, cls, **kwargs):
    # No EMA (the legacy optimizers have none); a sparse gradient in the
    # legacy forms (_legacy_sparse).
    return Family(name, lambda: getattr(_tf_keras_optimizers(legacy=True), cls), numbers=(),
                  unsupported=_legacy_reason, line=TF_KERAS_LEGACY,
                  **dict(kwargs, supports=(), sparse=_legacy_sparse))


def _tf_keras_family(name, cls, **kwargs):
    # EMA (tf_keras has no gradient accumulation); a sparse gradient as the
    # family's ``sparse`` says.
    kwargs.setdefault("unsupported", _tf_keras_reason)
    return Family(name, lambda: getattr(_tf_keras_optimizers(), cls), line=TF_KERAS,
                  **dict(kwargs, supports=("use_ema",)))


_TF_KERAS_FAMILIES = []


def tf_keras_families():
    """The families of ``tf_keras``' optimizers, most derived class first
    (made on first use: they name ``tf_keras`` classes).  The current ones
    are Keras 3's kernels, the arithmetic being the same op for op, except
    SGD: tf_keras keeps a momentum slot even without momentum and moves it
    (``m = -g * lr + m * 0``), which is ``legacy_sgd``'s momentum step.  They
    take ``use_ema``, and a sparse gradient where their ``sparse`` says how
    (SGD without Nesterov, ``SUMMED_BY_ROW``; with Nesterov, the core's
    ``tf_keras_sgd``; Adam and AdamW, the core's ``tf_keras_adam``; RMSprop,
    the core's ``tf_keras_rmsprop``)."""
    if not _TF_KERAS_FAMILIES:
        _TF_KERAS_FAMILIES.extend([
            _tf_keras_family("adam", "AdamW", **dict(_ADAM, sparse=_tf_keras_adam_sparse)),
            _tf_keras_family("adam", "Adam", **dict(_ADAM, unsupported=_tf_keras_adam_reason,
                                                    sparse=_tf_keras_adam_sparse)),
            _tf_keras_family("legacy_sgd", "SGD", slots=lambda inner: ("momentum",),
                             numbers=(), hyper=lambda inner: [1.0, 1.0 if inner.nesterov else 0.0],
                             scalars=lambda inner, lr: [tf.cast(inner.momentum, tf.float32)],
                             sparse=_tf_keras_sgd_sparse),
            _tf_keras_family("rmsprop", "RMSprop", slots=_rmsprop_slots,
                             numbers=("rho", "momentum", "epsilon"),
                             hyper=_tf_keras_rmsprop_hyper,
                             variable_hyper=_tf_keras_rmsprop_variable_hyper,
                             run_time_forms=_tf_keras_rmsprop_run_time_forms,
                             unsupported=_tf_keras_rmsprop_reason,
                             unsupported_variables=_tf_keras_rmsprop_variables_reason,
                             sparse=_tf_keras_rmsprop_sparse),
            _legacy_family("legacy_sgd", "SGD",
                           slots=lambda inner: ("momentum",) if _legacy_momentum_flag(inner)
                           else (),
                           hyper=lambda inner: [_legacy_momentum_flag(inner),
                                                1.0 if inner.nesterov else 0.0],
                           scalars=lambda inner, lr: [_legacy_hyper(inner, "momentum")]),
            _legacy_family("legacy_adam", "Adam",
                           slots=lambda inner: ("m", "v", "vhat") if inner.amsgrad else ("m", "v"),
                           hyper=lambda inner: [1.0 if inner.amsgrad else 0.0,
                                                _legacy_scalar_first()],
                           scalars=_legacy_adam_scalars),
            _legacy_family("legacy_rmsprop", "RMSprop",
                           slots=lambda inner: (("rms",)
                                                + (("momentum",) if _legacy_momentum_flag(inner)
                                                   else ())
                                                + (("mg",) if inner.centered else ())),
                           hyper=lambda inner: [_legacy_momentum_flag(inner),
                                                1.0 if inner.centered else 0.0,
                                                _legacy_scalar_first()],
                           scalars=_legacy_rmsprop_scalars),
            _legacy_family("legacy_adagrad", "Adagrad", slots=lambda inner: ("accumulator",),
                           hyper=lambda inner: [],
                           scalars=lambda inner, lr: [_legacy_epsilon(inner)]),
        ])
    return _TF_KERAS_FAMILIES


_CLASS_NAMES = sorted({f.keras_class.__name__ for f in FAMILIES}, key=str.lower)
_FAMILY_NAMES = ", ".join(_CLASS_NAMES[:-1]) + " or " + _CLASS_NAMES[-1]


def _families_for(inner):
    """The family table of ``inner``'s Keras and, for the stock-path
    reason, the names of its classes."""
    if _which_keras.is_tf_keras_object(inner):
        families = tf_keras_families()
        names = sorted({f.keras_class.__name__ for f in families}, key=str.lower)
        return families, "tf_keras " + ", ".join(names[:-1]) + " or " + names[-1]
    return FAMILIES, _FAMILY_NAMES


def family_of(inner):
    """The ``Family`` that reproduces ``inner``, or None."""
    return next((f for f in _families_for(inner)[0] if f.reproduces(inner)), None)


# -------------------------------------------------------------- decision

_STOCK = "stock: "


class Decision:
    """``plan`` (a ``Plan``, or None for the stock path) and ``path``, what
    ``step_path`` reports: ``"fused (Adam)"`` or ``"stock: <reason>"``."""

    __slots__ = ("plan", "path")

    def __init__(self, inner, plan=None, reason=None):
        self.plan = plan
        self.path = f"{_STOCK}{reason}" if reason else f"fused ({type(inner).__name__})"


def decide(inner, *, enabled=True, rule_reason=None, grads=None, variables=None,
           unscale="divide"):
    """The fused ``Plan`` for this step, or the reason it takes the stock path.

    ``enabled`` is the optimizer's ``fused`` switch; ``rule_reason`` what
    its loss-scale rule says against fusing (None: nothing); ``unscale``
    how the step will unscale the gradients (as ``apply`` takes it).
    Without ``grads`` it answers for the configuration alone (``step_path``
    before any step) and never holds a plan.  Gradients the inner
    optimizer cannot accumulate, and a clip option that is set but not a
    positive finite number (``clip_of``), raise a ValueError before
    anything moves.  Under several replicas of one process, every
    replica's decision is the same one (``_agreed``).
    """
    decision = _decide_alone(inner, enabled, rule_reason, grads, variables, unscale)
    if grads is None:
        return decision
    return _agreed(inner, decision, grads, variables)


def _decide_alone(inner, enabled, rule_reason, grads, variables, unscale):
    """``decide`` for this replica on its own."""
    def stock(reason):
        return Decision(inner, reason=reason)

    if not enabled:
        return stock("fused=False")
    if rule_reason:
        return stock(rule_reason)
    if not tf.executing_eagerly() and not tf.inside_function():
        # A TensorFlow 1 graph runs what its train op depends on: no
        # automatic control dependencies bring the fused op in.
        return stock("a TensorFlow 1 graph (the fused step runs eagerly and in tf.function)")
    family = family_of(inner)
    if family is None:
        for name, reason in _NOT_FUSED:
            if isinstance(inner, getattr(keras.optimizers, name, ())):
                return stock(reason)
        return stock(f"the inner optimizer ({type(inner).__name__}) is not a stock "
                     f"{_families_for(inner)[1]}")
    for attr, reason, is_set in _OPTIONS:
        if attr not in family.supports and is_set(getattr(inner, attr, None)):
            return stock(reason)
    clip = family.line.clip_of(inner)
    if isinstance(clip, str):
        return stock(clip)
    for attr in family.numbers:
        value = getattr(inner, attr, 0.0)
        if callable(value) or isinstance(value, (tf.Tensor, tf.Variable)):
            return stock(f"the inner optimizer's {attr} is not a number")
    steps = _accumulation_steps(inner)
    if (family.line is not KERAS_3 and family.line.weight_decay(inner) is not None
            and not family.line.learning_rate_is_variable(inner)
            and _grappler_reassociates_products()):
        # Each variable's decay evaluates the schedule anew, and the graph
        # optimizer merges that product into the decay's chain of multiplies,
        # folding the schedule's constants with weight_decay (ExponentialDecay:
        # var * (pow * (initial_rate * wd))): an order set by the schedule's
        # own ops.  Keras 3's families decay by the factor those ops make
        # (``decay_factor_probe``, a probe of Keras 3's own chain), in the
        # fused pass of an update step (with accumulation, on update steps
        # alone, as Keras' update step decays); tf_keras' take the stock
        # path.
        return stock("weight decay with a learning-rate schedule in a graph "
                     "(TensorFlow's graph optimizer reorders its products)")
    if steps and clip is not None and steps & (steps - 1) and _grappler_folds_constants():
        # Keras clips the average (g + acc) / steps of an update step, whose
        # division the graph optimizer turns into a product by 1 / steps and
        # then merges with the clip's own product by a constant (clipnorm's
        # u * c): for a power of two both orders give the same bits.
        return stock(f"clipping with gradient_accumulation_steps={steps} in a graph "
                     f"(TensorFlow's graph optimizer merges the average's 1 / {steps} into "
                     "the clip's products)")
    if (steps and steps & (steps - 1) and family.scales_gradient
            and _grappler_folds_constants() and _grappler_reassociates_products()):
        # The average (g + acc) / steps becomes a product by 1 / steps, which
        # the graph optimizer merges into the update's first product with the
        # gradient (SGD's g * lr: g * (1 / steps * lr)); Adam and Adamax
        # subtract from the gradient, square it or take its absolute value
        # first, which ends the chain of products, and the fused op takes
        # the product by 1 / steps as it is (Accumulation).  A product by a
        # power of two is exact, so for one both orders give the same bits
        # (unless an intermediate falls below float32's normal range, ~1e-38).
        return stock(f"gradient_accumulation_steps={steps} in a graph (TensorFlow's graph "
                     f"optimizer merges the average's 1 / {steps} into the update's products)")
    if grads is None:
        return Decision(inner)
    reason = (family.unsupported(inner)
              or family.unsupported_variables(
                  inner, [v for g, v in zip(grads, variables) if g is not None])
              or family.line.variables_reason(inner, variables)
              or _step_reason(family, inner, grads, variables)
              or _clip_reason(clip, grads, unscale))
    if reason is None and tf.distribute.has_strategy():
        reason = _strategy_around_update_reason(inner, grads, variables)
    if reason is not None:
        return stock(reason)
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if steps and unscale != "divide":
        _check_accumulable(pairs)
    forms = [(DENSIFIED_BY_ACCUMULATION if steps
              else DENSIFIED_BY_CLIP if family.line.densifies(clip) else family.sparse(inner, v))
             if isinstance(g, tf.IndexedSlices) else None
             for g, v in pairs]
    plan = Plan(family, inner, [g for g, _ in pairs], [v for _, v in pairs], forms,
                clip=None if steps else clip)
    if steps:
        # Keras clips the average of an update step (_update_by_averages).
        plan.average_clip = clip
    return Decision(inner, plan=plan)


def _strategy_around_update_reason(inner, grads, variables):
    """Why the EMA or the accumulation of ``inner`` cannot be fused under a
    ``tf.distribute`` strategy, or None.

    What Keras' ops do there on a mirrored variable (an accumulator, an
    average moved by Keras' ops, the variables overwritten with their
    averages) goes through the strategy's merge call, which a ``cond``
    in a ``tf.function`` does not allow (stock Keras' own ``cond`` fails
    there too).  The fused op moves each average of a variable it updates
    on each replica's copy, with no merge call: an EMA fuses where it moves
    every average, and overwrites nothing in a graph."""
    if _accumulation_steps(inner):
        return "gradient accumulation under a tf.distribute strategy"
    if not getattr(inner, "use_ema", False) or _which_keras.is_tf_keras_object(inner):
        # tf_keras moves the averages of the step's variables alone, and
        # its overwrite stays stock under a strategy (_tf_keras_reason).
        return None
    if inner.ema_overwrite_frequency and not tf.executing_eagerly():
        return ("EMA with ema_overwrite_frequency in a tf.function under a tf.distribute "
                "strategy (Keras overwrites the variables by the strategy's merge call, in "
                "a cond)")
    given = {_compat.variable_key(inner, v) for g, v in zip(grads, variables) if g is not None}
    for v in _compat.optimizer_trainable_variables(inner):
        if _compat.variable_key(inner, v) not in given:
            return (f"EMA under a tf.distribute strategy with no gradient for {v.name} "
                    "(Keras moves its average by the strategy's merge call, in a cond)")
    return None


def _check_accumulable(pairs):
    """Gradients unscaled in their own dtype (a ``LossScale`` rule, or
    TensorFlow 2.4's loop) must be float32 to be added to the float32
    accumulators: stock Keras' add of a float16 gradient fails halfway
    through its step."""
    for g, v in pairs:
        dtype = tf.as_dtype(g.dtype)
        if dtype != tf.float32:
            raise ValueError(
                f"gradient_accumulation_steps: the inner optimizer adds each gradient to a "
                f"float32 accumulator, and the gradient of {v.name} is {dtype.name} after "
                "unscaling (unscaled in its own dtype, as TensorFlow 2.4 did); cast the "
                "gradients to float32 first.  No variable was changed.")


def _densifies(clip):
    """Whether Keras' clip ``clip`` (``clip_of``) makes sparse gradients dense."""
    return isinstance(clip, tuple) and clip[0] == "global"


def _step_reason(family, inner, grads, variables):
    """Why these gradients and variables cannot take ``family``'s fused step."""
    reason = _strategy_reason()
    if reason is not None:
        return reason
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if not pairs:
        return "no gradients"
    replicated = _replicas() > 1
    devices = []
    for g, v in pairs:
        if replicated and not isinstance(_step.tf_variable(v), tf.distribute.DistributedValues):
            return f"{v.name} is not mirrored (made outside the strategy's scope)"
        if (isinstance(g, tf.IndexedSlices)
                and not family.line.densifies(family.line.clip_of(inner))
                and not _accumulation_steps(inner)):
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


# -------------------------------------------------------------- clipping
#
# Keras clips the gradients its inner optimizer is given: under Keras 3's
# LossScaleOptimizer the unscaled float32 ``u = float32(g) / scale``, with
# TensorFlow's ops (keras/src/optimizers/base_optimizer.py, the TensorFlow
# backend's _clip_by_norm):
#
#   clipvalue        u' = clip_by_value(u, -v, v)
#   clipnorm         l2sum = reduce_sum(u * u); l2norm = sqrt(l2sum) where
#                    l2sum > 0, else l2sum; u' = (u * c) / maximum(l2norm, c)
#   global_clipnorm  n = sqrt(reduce_sum(stack([reduce_sum(square(u))...])));
#                    f = c * minimum(1 / n, 1 / c) + (n - n);  u' = u * f
#
# The native op applies each u' in its one pass (ls_clip_mode), so what is
# left here is the norms, whose reduction order is Eigen's.  For float32
# gradients (Keras' mixed precision hands the optimizer float32 ones) the
# LossScaleSquaredNorms op makes them in one read of each gradient, adding
# the squares in the order of TensorFlow's Sum kernel on this device
# (lossscale.h, ls_squared_norms_with), a sparse gradient's as the sum of
# its densified squares without making them; ``_native_norms_agree`` checks
# that order against TensorFlow's own ops once per process.  The others'
# norms are TensorFlow's own ops, on values that make the same sums.
#
# Passes: two over the gradients, the norm's read and the fused update's,
# with the finite check folded into the first (Plan.check_finite: only a
# non-finite sum runs the read-only check).  Stock's op chain per gradient
# (and ours where the op does not serve) writes a float32 copy (a Div,
# after a Cast for 16-bit gradients), Square writes another, Sum reads it:
# per element, the gradient read once and 16 bytes of float32 temporaries
# written and read, besides a sparse gradient's dense copy under
# global_clipnorm.  The update then reads the gradient once more with its
# variable and slots and writes those, as without a clip.  clipvalue takes
# no norm: the read-only check, then the update, as without a clip.
#
# On which values: stock squares ``u``; squaring the scaled float32 values
# instead saves the division, and for a power-of-two scale every square and
# partial sum is the stock one times scale**2 exactly, as long as each
# stays a normal float32 number on both sides.  That is decided at run
# time, in the graph (one ``cond``, no retrace), and only where it can be
# decided from the scale alone: float16 gradients, whose nonzero squares
# are at least 2**-48, with a power-of-two scale of at most 2**39 (no
# unscaled square of a nonzero value falls below float32's normal range,
# where TensorFlow flushes it to zero) and every rescaled sum finite.
# Float32 and bfloat16 gradients reach down to 2**-126: an element whose
# unscaled square would be flushed while its scaled one is not changes the
# sum's rounding, whatever the sum's size, and telling takes a pass over
# the data, which costs what the division saves.  Their norms (and float16
# ones outside those bounds) are taken the stock way, on ``g / scale``.

def clip_of(inner):
    """Keras' clip of ``inner`` as the native op takes it: ``(mode, value)``
    (``"norm"``, ``"global"`` or ``"value"``, in the order Keras' own
    ``_clip_gradients`` tests them), None for no clip, or the reason the
    step is left to the stock path (a tensor or a callable).

    Keras clips when the value is set and > 0, and silently ignores a
    negative or NaN one (an infinite clipnorm or global_clipnorm turns
    every gradient into NaN): here any set value that is not a positive
    finite number is a ``ValueError`` that names it, before anything moves.
    """
    for attr, mode in _CLIP_OPTIONS:
        value = getattr(inner, attr, None)
        if value is None or (isinstance(value, (int, float)) and value == 0):
            continue
        value = _clip_value(inner, attr)
        return value if isinstance(value, str) else (mode, value)
    return None


def _clip_value(inner, attr):
    """The clip option ``attr`` of ``inner`` (set, not 0) as a float, or the
    reason the step is left to the stock path; a value that is not a
    positive finite number is a ``ValueError`` that names it."""
    value = getattr(inner, attr)
    if callable(value) or isinstance(value, (tf.Tensor, tf.Variable)):
        return f"the inner optimizer's {attr} is not a number"
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
            or not 0 < float(value) <= _FLOAT32_MAX):
        # tf_keras' legacy optimizers keep their name in _name.
        name = getattr(inner, "name", None) or type(inner).__name__
        raise ValueError(f"{name}: {attr} must be a positive finite number, got "
                         f"{value!r}")
    return float(value)


def _clip_reason(clip, grads, unscale):
    """Why this clip cannot be fused with these gradients: Keras clips
    gradients that are already unscaled in their own dtype, and the native
    op clips in float32."""
    if clip is None or unscale == "divide":
        return None
    for g in grads:
        if g is not None and tf.as_dtype(g.dtype) != tf.float32:
            return (f"clipping {tf.as_dtype(g.dtype).name} gradients (the inner optimizer "
                    f"clips them in {tf.as_dtype(g.dtype).name})")
    return None


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SCALED_NORM_MAX_SCALE_EXPONENT = 39


def _scaled_norm_exact(scale):
    """Whether squares of float16 gradients scaled by ``scale`` sum to the
    unscaled ones' times scale**2 exactly (as far as the scale tells): a
    normal power of two up to 2**39, as a bool tensor."""
    bits = tf.bitcast(scale, tf.int32)
    return tf.logical_and(
        tf.equal(tf.bitwise.bitwise_and(bits, 0x7FFFFF), 0),
        tf.logical_and(bits >= 1 << 23,
                       bits <= (127 + _SCALED_NORM_MAX_SCALE_EXPONENT) << 23))


def _squared_norms(grads, scale, unscale, variables=None, mode="global"):
    """Each gradient's ``reduce_sum(square(u))`` as stock computes it, ``u``
    the unscaled float32 gradient the inner optimizer clips by the norm
    ``mode``.  Of a sparse one: for ``"global"``, Keras'
    ``ops.sum(ops.square(slices))``, the squared slices densified (a row's
    squares added up), then summed whole; for ``"norm"``, TensorFlow's
    clip_by_norm's sum over the slices' values.  (``variables``: those of
    the gradients, for a sparse one without a dense shape.)"""
    def stock_sum(g):
        return tf.reduce_sum(tf.square(_unscaled_like_stock(g, scale, unscale)))

    sums = [None] * len(grads)
    native = _native_squared_norms(grads, scale, unscale, variables, mode)
    for i, s in native.items():
        sums[i] = s
    for i, g in enumerate(grads):
        if sums[i] is not None:
            continue
        if isinstance(g, tf.IndexedSlices):
            unscaled = _unscaled_slices(g, variables and variables[i], scale, unscale)
            sums[i] = (tf.reduce_sum(_densify(_map_values(tf.square, unscaled)))
                       if mode == "global" else tf.reduce_sum(unscaled.values * unscaled.values))
    halves = [i for i, g in enumerate(grads) if unscale == "divide" and g.dtype == tf.float16
              and sums[i] is None]
    for i, g in enumerate(grads):
        if i not in halves and sums[i] is None:
            sums[i] = stock_sum(g)
    if halves:
        inv = 1.0 / scale
        rescaled = [(tf.reduce_sum(tf.square(tf.cast(grads[i], tf.float32))) * inv) * inv
                    for i in halves]
        exact = tf.logical_and(_scaled_norm_exact(scale),
                               tf.reduce_all(tf.math.is_finite(tf.stack(rescaled))))
        taken = tf.cond(exact, lambda: rescaled, lambda: [stock_sum(grads[i]) for i in halves])
        for i, s in zip(halves, taken):
            sums[i] = s
    return sums


def _native_rows(g, variable):
    """The row count of the variable a sparse gradient belongs to, when
    tracing knows it, else None."""
    dense_shape = tf.get_static_value(g.dense_shape) if g.dense_shape is not None else None
    if dense_shape is not None and len(dense_shape) > 0:
        return int(dense_shape[0])
    if variable is not None and len(variable.shape) > 0 and variable.shape[0] is not None:
        return int(variable.shape[0])
    return None


def _native_squared_norms(grads, scale, unscale, variables, mode):
    """``{position: sum}`` for the float32 gradients whose sums the native
    op takes (LossScaleSquaredNorms: the stock sums' bits, in one read of
    each gradient; a sparse one under ``"global"`` summed as its densified
    squares without making them), empty when the op library is not loaded
    or its order is not this TensorFlow's (``_native_norms_agree``)."""
    library = native_ops.native_library_for([])
    if library is None or not _native_norms_agree(library):
        return {}
    taken, values, indices, sparse, rows, names = [], [], [], [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        variable = variables[i] if variables else None
        dense = g.values if isinstance(g, tf.IndexedSlices) else g
        if tf.as_dtype(dense.dtype) != tf.float32:
            continue
        if isinstance(g, tf.IndexedSlices) and mode == "global":
            count = _native_rows(g, variable)
            if count is None:
                continue
            sparse.append(len(taken))
            indices.append(tf.cast(g.indices, tf.int64))
            rows.append(count)
        taken.append(i)
        values.append(dense)
        names.append(getattr(variable, "path", None) or getattr(variable, "name", f"#{i}"))
    if not taken:
        return {}
    scale = tf.constant(1.0, tf.float32) if scale is None else tf.cast(scale, tf.float32)
    out = library.loss_scale_squared_norms(values, indices, scale, sparse=sparse, rows=rows,
                                           names=[str(n) for n in names], unscale=unscale)
    return dict(zip(taken, out))


_NORMS_AGREE = {}


def _native_norms_agree(library):
    """Whether the native sums of squares are TensorFlow's own here: once
    per process, eagerly, the op against TensorFlow's Square and Sum (and
    the densify of a sparse gradient) on sizes that take each part of the
    order: a short tail, one leaf, a tree, two shards.  (The order is that
    of TensorFlow's x86 builds; a build that sums in another keeps the
    stock ops.)"""
    if "agree" not in _NORMS_AGREE:
        with tf.init_scope(), tf.device("/cpu:0"):
            rng = np.random.default_rng(7)
            scale = tf.constant(3.0, tf.float32)
            agree = True
            for n in (13, 8195, 70001, 300007):
                g = tf.constant(rng.standard_normal(n).astype(np.float32))
                want = tf.reduce_sum(tf.square(tf.math.divide(g, scale)))
                got = library.loss_scale_squared_norms([g], [], scale, unscale="divide")[0]
                agree = agree and bool(tf.equal(tf.bitcast(want, tf.int32),
                                                tf.bitcast(got, tf.int32)))
            rows, width = 900, 384
            index = rng.integers(0, rows, 500)
            values = tf.constant(rng.standard_normal((500, width)).astype(np.float32))
            slices = tf.IndexedSlices(tf.square(values), tf.constant(index),
                                      tf.constant([rows, width], tf.int64))
            want = tf.reduce_sum(tf.convert_to_tensor(slices))
            got = library.loss_scale_squared_norms([values], [tf.constant(index, tf.int64)],
                                                   tf.constant(1.0), sparse=[0], rows=[rows],
                                                   unscale="none")[0]
            agree = agree and bool(tf.equal(tf.bitcast(want, tf.int32),
                                            tf.bitcast(got, tf.int32)))
        _NORMS_AGREE["agree"] = agree
    return _NORMS_AGREE["agree"]


def _clip_by_norm_divisor(l2sum, clipnorm):
    """tf.clip_by_norm's ``maximum(l2norm, clip_norm)`` from the sum (each
    element's, of a vector of sums)."""
    pred = l2sum > 0
    l2sum_safe = tf.where(pred, l2sum, tf.ones_like(l2sum))
    l2norm = tf.where(pred, tf.sqrt(l2sum_safe), l2sum)
    return tf.maximum(l2norm, tf.constant(clipnorm, tf.float32))


def _global_clip_factor(sums, clip_norm):
    """Keras' clip_by_global_norm factor from the per-gradient sums, with
    Keras' own ops in its order."""
    use_norm = keras.ops.sqrt(keras.ops.sum(keras.ops.stack(sums)))
    scale_for_finite = clip_norm * keras.ops.minimum(1.0 / use_norm, 1.0 / clip_norm)
    return scale_for_finite + (use_norm - use_norm)


# ------------------------------------------------------------ replicas

def _replicas():
    """How many replicas take this step together (1 outside a strategy)."""
    if not tf.distribute.has_strategy():
        return 1
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


_SERVED_STRATEGIES = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)


def _strategy_reason():
    """Why the strategy the step runs under cannot have it fused, or None.

    Mirrored and MultiWorkerMirrored strategies keep a copy of every
    variable on every replica's device, which the fused op updates there;
    and their cross-device ops, TensorFlow's own, hand every replica the
    same sums, on which the finite check relies.  A cross-device op of
    the user's own promises neither.
    """
    if _replicas() == 1:
        return None
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, _SERVED_STRATEGIES):
        return (f"a {type(strategy).__name__} with several replicas (the fused step serves "
                "MirroredStrategy and MultiWorkerMirroredStrategy)")
    cross_device_ops = _compat.strategy_cross_device_ops(strategy)
    if type(cross_device_ops) not in _compat.tensorflow_cross_device_ops_classes():
        return (f"a cross-device op of its own ({type(cross_device_ops).__name__}): the fused "
                "step checks the all-reduced sums, which only TensorFlow's own cross-device "
                "ops give every replica alike")
    return None


class _Signature:
    """What one replica's step is: its path and, per gradient, the variable,
    None or not, dtype and shape.  A leaf for ``merge_call``, which would
    otherwise take lists of different lengths apart."""

    def __init__(self, path, grads, variables):
        def kind(g):
            shape = tf.TensorShape(g.shape)
            return tf.as_dtype(g.dtype).name, shape.as_list() if shape.rank is not None else None

        self.path = path
        self.variables = list(variables)
        self.grads = [None if g is None else kind(g) for g in grads]

    def difference(self, other):
        """What differs from ``other``'s step, in words, or None."""
        if len(self.variables) != len(other.variables):
            return f"{len(self.variables)} variables, against {len(other.variables)}"
        for i, (v, w) in enumerate(zip(self.variables, other.variables)):
            if v is not w:
                return f"variable {i} {_name(v)!r}, against {_name(w)!r}"
        for i, (g, h) in enumerate(zip(self.grads, other.grads)):
            if g != h:
                def say(x):
                    return "None" if x is None else f"a {x[0]} gradient of shape {x[1]}"
                return f"for {_name(self.variables[i])!r} {say(g)}, against {say(h)}"
        return None


def _name(variable):
    # A Keras variable's path says which layer it is in; its name does not.
    return getattr(variable, "path", None) or variable.name


def _agreed(inner, decision, grads, variables):
    """``decision``, once every replica of this process has made the same
    one for the same variables (MirroredStrategy runs its replicas as
    threads, each deciding for itself): a replica that would take the stock
    path sends them all there, and replicas that pass different variables,
    None gradients in other places, or gradients of other dtypes or shapes,
    raise a ValueError before anything moves.  Checked once, at trace time,
    in ``merge_call``; MultiWorkerMirroredStrategy's workers each run their
    own program and are not compared."""
    strategy = tf.distribute.get_strategy()
    if (_replicas() == 1 or not isinstance(strategy, _SERVED_STRATEGIES)
            or len(strategy.extended.worker_devices) == 1):
        return decision

    def agree(distribution, signature):
        signatures = distribution.experimental_local_results(signature)
        for r, other in enumerate(signatures[1:], 1):
            difference = other.difference(signatures[0])
            if difference is not None:
                raise ValueError(
                    f"The replicas' steps differ: replica {r} applies {difference} on "
                    "replica 0.  Every replica must pass the same variables, in the same "
                    "order, with gradients of the same dtype and shape and None in the same "
                    "places; nothing was changed.")
        for r, other in enumerate(signatures):
            if other.path.startswith(_STOCK):
                return other.path if r == 0 else \
                    f"{_STOCK}on replica {r}, {other.path[len(_STOCK):]}"
        return signatures[0].path

    path = tf.distribute.get_replica_context().merge_call(
        agree, args=(_Signature(decision.path, grads, variables),))
    if path == decision.path:
        return decision
    return Decision(inner, reason=path[len(_STOCK):])


# ------------------------------------------------------------------ run

def _grappler_folds_constants():
    """Whether the stock step built here will have its constants folded: in
    a graph that TensorFlow's graph optimizer rewrites (its constant
    folding, which also turns ``x / c`` into ``x * (1 / c)``), not eagerly."""
    if tf.executing_eagerly():
        return False
    options = tf.config.optimizer.get_experimental_options()
    return (not options.get("disable_meta_optimizer", False)
            and options.get("constant_folding", True))


def local_copy(variable):
    """The ``tf.Variable`` a step on this replica updates: the copy on its
    device of a mirrored variable, else the variable itself."""
    variable = _step.tf_variable(variable)
    if isinstance(variable, tf.distribute.DistributedValues):
        return _compat.on_device_or_primary(variable)
    return variable


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


# Lanes whose products `x * factor * lr` round differently in the two
# orders unless the factor or the learning rate is special (a power of two,
# a factor of 1), where the two orders agree on every value.
_PROBE_LANES = (1.0 + np.arange(1, 257, dtype=np.float64) * (2.0**-9 + 2.0**-17)).astype(
    np.float32)
# A factor probe's lanes: 1, whose product by the chain is the factor itself,
# then _PROBE_LANES, which tell whether the chain is that one product.
_FACTOR_LANES = np.concatenate([[1.0], _PROBE_LANES]).astype(np.float32)


def _graph_reorders_clip(factor, learning_rate, gradients):
    """Whether the graph optimizer reorders the stock SGD step's `u * factor *
    learning_rate` to `u * (factor * learning_rate)`, as a bool tensor.

    In stock's step the clipped gradients `u * factor` pass through the
    default replica context's all-reduce (Keras' _all_reduce_sum_gradients),
    an IdentityN, before SGD multiplies them by the learning rate.  The graph
    optimizer removes that IdentityN, and then reorders the chain, in a
    function whose outputs it knows; in one that returns nothing it keeps
    it, and the chain runs as written.  Tracing cannot tell which: a probe
    of the same chain through the same all-reduce, on lanes that round
    differently in the two orders, is rewritten as stock's is and reads
    back which order ran.  ``gradients``: how many the step has (stock's
    all-reduce takes them all)."""
    lanes = tf.constant(_PROBE_LANES)
    # One tensor where stock's list has one, else two: an IdentityN of one
    # tensor is an Identity, which the graph optimizer removes in any function.
    halves = [lanes] if gradients == 1 else [lanes[:128], lanes[128:]]
    clipped = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, [x * factor for x in halves])
    return tf.reduce_all([tf.reduce_all(tf.equal(c * learning_rate, x * (factor * learning_rate)))
                          for c, x in zip(clipped, halves)])


def _decay_follows_schedule(inner):
    """Whether Keras 3's weight decay of ``inner`` multiplies by a schedule's
    value in a graph the graph optimizer rewrites (then the fused pass decays
    by ``decay_factor_probe``'s factor)."""
    return (not _which_keras.is_tf_keras_object(inner)
            and getattr(inner, "weight_decay", None) is not None
            and not KERAS_3.learning_rate_is_variable(inner)
            and _grappler_reassociates_products())


def _decay_form(inner, variable, reassociated):
    """The core's ls_decay for ``variable``: 0 none, 1 op by op, 2 reordered."""
    if getattr(inner, "weight_decay", None) is None or not _compat.uses_weight_decay(inner,
                                                                                  variable):
        return 0
    # The graph optimizer regroups `var * wd * lr` as `var * (lr * wd)` where
    # the variable has more elements than the scalars.  Where it has one, the
    # three factors tie in size and their tensors' names decide: Keras 3's
    # regroup for every variable of rank 1 or more, tf_keras' keep the
    # product as written; a rank-0 variable's product runs as written in both.
    if not reassociated or len(variable.shape) == 0:
        return 1
    if _which_keras.is_tf_keras_object(inner):
        return 2 if int(np.prod([int(d) for d in variable.shape])) != 1 else 1
    return 2


def apply(plan, *, scale, unscale, should_apply, advance_iterations_always=False):
    """The fused step: when ``should_apply`` (a bool tensor), the inner
    optimizer's update of ``plan``'s variables by its gradients unscaled by
    ``scale`` — ``"divide"`` (Keras 3), ``"multiply"`` (TensorFlow 2.4) or
    ``"none"`` — and ``iterations`` advanced; when not, nothing changes.
    ``plan.prepare_scalars()`` must have run before the loss scale moved.
    With ``advance_iterations_always`` a skipped step advances
    ``iterations`` too, as TensorFlow 2.4's optimizer did.

    With ``gradient_accumulation_steps`` an applied step only adds the
    unscaled gradients to the accumulators, except every ``steps``-th
    (counted by ``iterations``) which updates by their average and zeroes
    them; with ``use_ema`` every applied step then moves the EMA, and
    overwrites the variables with it on Keras' schedule.  Each as Keras'
    ``_backend_apply_gradients`` does, with its ops."""
    scale = tf.convert_to_tensor(scale, tf.float32)
    library = native_ops.native_library_for([])
    inner = plan.inner
    if _accumulation_steps(inner):
        _step.cond(should_apply,
                   lambda: _accumulate_or_update(plan, library, scale, unscale), lambda: None)
    else:
        plan.run(library, should_apply, scale, unscale)
    if getattr(inner, "use_ema", False):
        _step.cond(should_apply,
                   lambda: _moving_average_step(inner, plan.variables, plan.ema_done,
                                                plan.family.line),
                   lambda: None)
    iterations = local_copy(_compat.optimizer_iterations(plan.inner))
    if advance_iterations_always:
        # A bad learning rate or slice fails before iterations moves, in a
        # tf.function too.
        with tf.control_dependencies(plan.checks):
            iterations.assign_add(1)
    else:
        iterations.assign_add(tf.cast(should_apply, iterations.dtype))


def _accumulation_steps(inner):
    """The inner optimizer's ``gradient_accumulation_steps`` (None where its
    Keras has no such option: tf_keras)."""
    return getattr(inner, "gradient_accumulation_steps", None)


def _accumulate_or_update(plan, library, scale, unscale):
    """An applied step of an inner optimizer with gradient accumulation:
    Keras' ``_backend_apply_gradients`` with the fused op as its update."""
    inner = plan.inner
    steps = inner.gradient_accumulation_steps
    accumulators = _compat.gradient_accumulators(inner, plan.variables)
    is_update_step = (_compat.optimizer_iterations(inner) + 1) % steps == 0

    def update():
        if plan.average_clip is None and plan.family.name not in OWN_OP_FAMILIES:
            # One pass: each gradient unscaled, plus its accumulator (Keras'
            # order: the new gradient first), averaged as stock averages, the
            # update, and the accumulator zeroed in its own buffer, so that
            # the next accumulating step adds in place without copying it
            # first.
            plan.run(library, tf.constant(True), scale, unscale,
                     accumulation=Accumulation(accumulators, _average_mode(), steps))
            zeroed, after = [], []
        else:
            zeroed = list(accumulators)
            after = _update_by_averages(plan, library, scale, unscale, accumulators, steps)
        # Keras zeroes every accumulator (assign(zeros)): those of variables
        # without a gradient in this step too, by LossScaleZeroVariables.
        taken = {id(a) for a in accumulators}
        zeroed += [a for a in _compat.all_gradient_accumulators(inner)
                   if a is not None and id(a) not in taken]
        if zeroed:
            with tf.control_dependencies(after):
                library.loss_scale_zero_variables([local_copy(a).handle for a in zeroed])

    def accumulate():
        plan.accumulate(library, scale, unscale, accumulators)

    _step.cond(is_update_step, update, accumulate)


def _update_by_averages(plan, library, scale, unscale, accumulators, steps):
    """Keras' update step under gradient accumulation, by the averages
    themselves: the average ``(g + acc) / steps`` of each gradient unscaled
    as stock unscales it (a sparse one densified, as Keras' add densifies
    it) made by the same ops as Keras', then the update by a plan of the
    averages as unscaled dense gradients.  For a clip (Keras clips the
    averages, not the step's own gradients: their norms in one read, the
    update in one pass) and for Adafactor and Lamb (whose ops take no
    accumulators).  Returns the averages, after which the accumulators may
    be zeroed."""
    with tf.control_dependencies(plan.checks):
        averages = []
        for g, v, a, form in zip(plan.grads, plan.variables, accumulators, plan.forms):
            u = (_densify(_unscaled_slices(g, v, scale, unscale)) if form is not None
                 else _unscaled_like_stock(g, scale, unscale))
            averages.append((u + local_copy(a).read_value()) / steps)
    averaged = Plan(plan.family, plan.inner, averages, plan.variables, [None] * len(averages),
                    clip=plan.average_clip)
    averaged.prepare_scalars()
    if (averaged.clip is not None and averaged.clip[0] in ("norm", "global")
            and plan.family.name not in OWN_OP_FAMILIES):
        # The norms, for the op's clip scalars (Adafactor's and Lamb's clip
        # is Keras' own ops on the averages, Plan._own_op_gradients).
        averaged.check_finite(scale, "none")
    averaged.run(library, tf.constant(True), scale, "none")
    return averages


def _moving_average_step(inner, variables, done=(), line=None):
    """An applied step's EMA of an inner optimizer with ``use_ema``, after
    its update of ``variables``: Keras' ``_backend_apply_gradients``, its
    last part (but for the averages of ``done``, which the fused op moved);
    ``line``, the ``KerasLine`` of ``inner``."""
    line = line or KERAS_3
    line.move_averages(inner, variables, done)
    frequency = inner.ema_overwrite_frequency
    if frequency:
        _step.cond((inner.iterations + 1) % frequency == 0,
                   lambda: line.overwrite_with_averages(inner, variables), lambda: None)


def check_and_apply(plan, *, scale, advance, unscale, advance_iterations_always=False):
    """The whole fused step of ``plan``: the step's scalars and checks, the
    finite check of the gradients (``Plan.check_finite``: as they come, a
    few small ones per op; with a norm to clip by, the norms),
    ``advance(finite)`` (the loss-scale rule: returns should_apply, a bool
    or a bool tensor), then ``apply``.  ``scale`` is the scale the
    gradients were made with, read before the rule moves it."""
    checks = plan.prepare_scalars()
    finite = plan.check_finite(scale, unscale)
    # A bad learning rate fails before the loss scale moves.
    with tf.control_dependencies(checks):
        finite = tf.identity(finite)
    should_apply = advance(finite)
    if isinstance(should_apply, bool):
        should_apply = tf.constant(should_apply)
    apply(plan, scale=scale, unscale=unscale, should_apply=should_apply,
          advance_iterations_always=advance_iterations_always)
