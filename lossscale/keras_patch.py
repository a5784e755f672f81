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
"""

import functools
import inspect
import sys
import warnings
import weakref

import keras

from lossscale import _compat
from lossscale import _which_keras

Trainer = _compat.trainer_class()

__all__ = ["patch_keras", "unpatch_keras", "is_keras_patched"]

_ORIGINAL_COMPILE = None
_PATCHED_COMPILE = None
# Whether patch_keras() asked for the whole wrapper, or only the policy hook
# is installed.
_EXPLICIT = False
# The policies given to experimental.set_policy: compile follows them even
# without a loss scale (then it does not wrap), as TensorFlow 2.4 did.
# Policies define __eq__ and so cannot be hashed: weak references, by identity.
_SET_POLICIES = []


def _loss_scale_optimizer_classes():
    from lossscale.optimizer import LossScaleOptimizer  # pylint: disable=import-outside-toplevel

    return (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer)


def _fresh_copy(loss_scale):
    return type(loss_scale).from_config(loss_scale.get_config())


def _wrap(optimizer, policy):
    """``optimizer`` in our loss-scale optimizer as ``policy`` asks, or None."""
    from lossscale.optimizer import LossScaleOptimizer  # pylint: disable=import-outside-toplevel
    from lossscale.policy import Policy  # pylint: disable=import-outside-toplevel

    if isinstance(policy, Policy):
        if policy.loss_scale is None:
            return None
        return LossScaleOptimizer(optimizer, loss_scale=_fresh_copy(policy.loss_scale),
                                  name="loss_scale_optimizer")
    if policy.name == "mixed_float16":
        return LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
    return None


def _decides(policy):
    """Whether the wrapper, rather than stock Keras, decides for ``policy``."""
    from lossscale.policy import Policy  # pylint: disable=import-outside-toplevel

    if _EXPLICIT:
        return True
    return isinstance(policy, Policy) and (policy.loss_scale is not None
                                           or any(ref() is policy for ref in _SET_POLICIES))


def _compile_with_loss_scale(original, model, args, kwargs):
    if not _decides(model.dtype_policy):
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    optimizer = keras.optimizers.get(arguments["optimizer"])
    wrapped = None
    if (arguments["auto_scale_loss"] and optimizer
            and not isinstance(optimizer, _loss_scale_optimizer_classes())):
        wrapped = _wrap(optimizer, model.dtype_policy)
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


def is_keras_patched():
    """Whether ``patch_keras()`` is in effect."""
    return _EXPLICIT and _installed()


def _install():
    global _ORIGINAL_COMPILE, _PATCHED_COMPILE
    _ORIGINAL_COMPILE = Trainer.__dict__["compile"]
    _PATCHED_COMPILE = _make_patched_compile(_ORIGINAL_COMPILE)
    Trainer.compile = _PATCHED_COMPILE


def _installed():
    return _PATCHED_COMPILE is not None and Trainer.__dict__["compile"] is _PATCHED_COMPILE


def install_policy_hook(policy=None):
    """Have ``Model.compile`` follow ``lossscale.Policy`` loss scales, nothing else.

    Called by ``lossscale.experimental.set_policy`` (with the policy it set,
    which compile then follows even without a loss scale) and by a
    ``lossscale.Policy`` that carries a loss scale.  Does nothing more when
    ``patch_keras()`` is in effect; ``unpatch_keras()`` removes it.
    """
    if policy is not None:
        _SET_POLICIES[:] = [ref for ref in _SET_POLICIES if ref() is not None]
        _SET_POLICIES.append(weakref.ref(policy))
    if not _installed():
        _install()


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
    global _EXPLICIT
    if not _installed():
        _install()
    _EXPLICIT = True
    _hook_tf_keras()


def _hook_tf_keras():
    # tf_keras' compile too, when it is the Keras in use or already loaded.
    if _which_keras.tf_keras_in_use() or "tf_keras" in sys.modules:
        from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

        _tf_keras.hook_compile(wrap_mixed_float16=True)


def unpatch_keras():
    """Undo ``patch_keras()``: ``Model.compile`` is Keras's own again.

    Removes the policy hook of ``lossscale.experimental.set_policy`` and
    ``lossscale.Policy`` as well (until one of them asks for it again).
    Does nothing when Keras is not patched.  If ``Trainer.compile`` was
    replaced again by someone else after ``patch_keras()``, it is left as it
    is, with a warning.
    """
    global _ORIGINAL_COMPILE, _PATCHED_COMPILE, _EXPLICIT
    if "lossscale._tf_keras" in sys.modules:
        sys.modules["lossscale._tf_keras"].unhook_compile()
    if _PATCHED_COMPILE is None:
        return
    if not _installed():
        warnings.warn("keras Trainer.compile was replaced after lossscale.patch_keras(); "
                      "leaving it as it is.", stacklevel=2)
        return
    Trainer.compile = _ORIGINAL_COMPILE
    _ORIGINAL_COMPILE = _PATCHED_COMPILE = None
    _EXPLICIT = False
    _SET_POLICIES.clear()
