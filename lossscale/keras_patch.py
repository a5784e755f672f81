"""Compile-time wrapping: ``Model.compile`` picks ``lossscale.LossScaleOptimizer``.

Keras 3's ``Trainer.compile`` wraps a plain optimizer in the stock
``keras.optimizers.LossScaleOptimizer`` when the model's dtype policy is named
``"mixed_float16"`` (and ``auto_scale_loss`` is true).  ``patch_keras()``
replaces ``Trainer.compile`` -- the one method every Keras model's
``compile`` is -- by a wrapper that makes that decision itself and then runs
the original with ``auto_scale_loss=False``:

* a ``lossscale.Policy``: wrap in ``lossscale.LossScaleOptimizer`` following
  the policy's loss scale (a fresh copy of it, so that every compiled model
  has its own loss-scale state, made where the optimizer is made); no loss
  scale, no wrapping -- even for ``"mixed_float16"``;
* any other policy named ``"mixed_float16"``: wrap in
  ``lossscale.LossScaleOptimizer`` with the arguments stock Keras uses;
* an optimizer that already is a loss-scale optimizer (stock or ours), or
  ``auto_scale_loss=False``: left alone.

Everything else ``compile`` does is the original's, including what it
records for ``get_compile_config`` (the unwrapped optimizer, as stock
Keras records it).  Under ``tf_keras`` (the Keras in use, or loaded),
``patch_keras()`` hooks its ``Model.compile`` the same way (see
``lossscale._tf_keras``).  ``unpatch_keras()`` puts the original methods
back, the very same function objects.  Both are idempotent.  Nothing is
patched on import.  Besides ``patch_keras()``, the TensorFlow 2.4 way of
asking installs the same wrapper for ``lossscale`` policies only
(``install_policy_hook``): ``lossscale.experimental.set_policy``, or a
``lossscale.Policy`` made with a loss scale, after which ``compile`` follows
that policy's loss scale as TensorFlow 2.4's did; every other model's
``compile`` stays stock.

The rule (``wrapper_for``) and the record of what is patched live in
``lossscale._compile_hook``, shared with ``tf_keras``' hook; this module is
Keras 3's side of it and the public switch.
"""

import functools
import inspect
import sys

import keras

from lossscale import _compat, _compile_hook, _which_keras
from lossscale.optimizer import LossScaleOptimizer

__all__ = ["patch_keras", "unpatch_keras", "is_keras_patched"]

_LOSS_SCALE_OPTIMIZERS = (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer)


def _compile_with_loss_scale(original, model, args, kwargs):
    wrapper = _compile_hook.wrapper_for(model.dtype_policy, "keras")
    if wrapper.kind == _compile_hook.STOCK:
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    optimizer = keras.optimizers.get(arguments["optimizer"])
    wrapped = None
    if (wrapper.kind == _compile_hook.OURS and arguments["auto_scale_loss"] and optimizer
            and not isinstance(optimizer, _LOSS_SCALE_OPTIMIZERS)):
        wrapped = LossScaleOptimizer(optimizer, loss_scale=wrapper.fresh_loss_scale(),
                                     name="loss_scale_optimizer")
    arguments["optimizer"] = optimizer
    arguments["auto_scale_loss"] = False
    result = original(*bound.args, **bound.kwargs)
    if wrapped is not None:
        model.optimizer = wrapped
    return result


def _make_patched_compile(original):
    @functools.wraps(original)
    @_compat.no_automatic_dependency_tracking
    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
        return _compile_with_loss_scale(original, self, args, kwargs)

    return compile


# Keras 3's Trainer.compile, as the compile hook patches it.
COMPILE = _compile_hook.Patch("keras", _compat.trainer_class(), "compile",
                              _make_patched_compile)


def is_keras_patched():
    """Whether ``patch_keras()`` is in effect."""
    return _compile_hook.is_explicit("keras") and COMPILE.installed()


def install_policy_hook(policy=None):
    """Have ``Model.compile`` follow ``lossscale.Policy`` loss scales, nothing else.

    Called by ``lossscale.experimental.set_policy`` (with the policy it set,
    which compile then follows even without a loss scale) and by a
    ``lossscale.Policy`` that carries a loss scale.  Does nothing more when
    the hook is in already (or ``patch_keras()`` is in effect);
    ``unpatch_keras()`` removes it.
    """
    if policy is not None:
        _compile_hook.follow(policy, "keras")
    _compile_hook.install(COMPILE)


def patch_keras():
    """Make ``Model.compile`` wrap optimizers in ``lossscale.LossScaleOptimizer``.

    After this call, compiling a model whose dtype policy is a
    ``lossscale.Policy`` wraps a plain optimizer in
    ``lossscale.LossScaleOptimizer(optimizer, loss_scale=<a copy of the
    policy's loss scale>)``, or leaves it alone when the policy has no loss
    scale; any other ``"mixed_float16"`` policy gets
    ``lossscale.LossScaleOptimizer(optimizer)`` where stock Keras would use
    its own ``LossScaleOptimizer``.  Loss-scale optimizers and
    ``compile(..., auto_scale_loss=False)`` are left alone.  Models compiled
    before the call keep their optimizer.  Calling it again does nothing;
    ``unpatch_keras()`` undoes it.
    """
    _compile_hook.install(COMPILE, explicit=True)
    # tf_keras' compile too, when it is the Keras in use or already loaded.
    if _which_keras.tf_keras_in_use() or "tf_keras" in sys.modules:
        from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

        _compile_hook.install(_tf_keras.GET_OPTIMIZER, explicit=True)


def unpatch_keras():
    """Undo ``patch_keras()``: ``Model.compile`` is Keras's own again.

    Removes the policy hook of ``lossscale.experimental.set_policy`` and
    ``lossscale.Policy`` as well (until one of them asks for it again), and
    ``tf_keras``' hook.  Does nothing when Keras is not patched.  If
    ``Trainer.compile`` was replaced again by someone else after
    ``patch_keras()``, it is left as it is, with a warning.
    """
    _compile_hook.uninstall_all()
