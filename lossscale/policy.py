"""TensorFlow 2.4's experimental dtype policy: a Keras ``DTypePolicy`` with a loss scale.

``Policy(name, loss_scale='auto')`` behaves as ``keras.DTypePolicy(name)`` for
every layer (compute and variable dtypes come from ``name`` alone) and carries
a ``loss_scale`` for ``Model.compile`` to use (see ``lossscale.patch_keras``):
layers never look at it.  The loss scale is a recipe, not training state:
each model compiled under the policy gets a fresh copy of it in its optimizer.

Serialization follows TensorFlow 2.4: ``get_config`` has ``loss_scale`` only
when one was passed explicitly and ``Policy.from_config`` restores it, while
generic Keras deserialization yields a plain ``keras.DTypePolicy`` of the same
name with the loss scale dropped, so a model saved with this policy loads
where ``lossscale`` is not installed.  Keras 3 cannot drop the key on the
reading side (``DTypePolicy.from_config`` rejects unknown keys), so it is
dropped on the writing side: when Keras's own serialization asks for the
config, it gets exactly what it would write for ``keras.DTypePolicy(name)``,
under the public name ``keras.DTypePolicy``.

The loss-scale half is shared with the ``tf_keras`` policy of
``lossscale._tf_keras`` (``lossscale._policy_loss_scale``); the dtype half is
Keras 3's own.
"""

import keras

from lossscale import _compat, keras_patch
from lossscale._policy_loss_scale import PolicyLossScale

__all__ = ["Policy"]


class Policy(PolicyLossScale, keras.DTypePolicy):
    """A dtype policy for a Keras layer, with a loss scale for ``Model.compile``.

    The difference from ``keras.DTypePolicy`` is the ``loss_scale`` field.  The
    loss scale is used only by ``Model.compile``, which wraps a plain
    optimizer in a ``lossscale.LossScaleOptimizer`` following that loss scale;
    it is only used during ``Model.fit``, ``Model.train_on_batch`` and similar
    methods, never by layers.  With a plain ``keras.DTypePolicy``,
    ``Model.compile`` instead wraps the optimizer only if the policy's name is
    ``"mixed_float16"``.

    As in TensorFlow 2.4 there is no switch to turn this on: constructing a
    policy that has a loss scale installs the compile hook of
    ``lossscale.keras_patch`` (once; later policies find it in place), which
    wraps for models whose policy asks and leaves every other model's
    ``compile`` stock.  ``lossscale.unpatch_keras()`` removes it.

    Deserializing an object that holds this policy with Keras's generic
    functions (``keras.saving.deserialize_keras_object``,
    ``keras.dtype_policies.deserialize``, ``keras.saving.load_model``) gives a
    plain ``keras.DTypePolicy`` of the same name and silently drops the loss
    scale, so saved models load without this package.

    Args:
      name: A string.  Any dtype name, such as ``'float32'`` or ``'float64'``
        (the variable and compute dtypes are both that dtype), or
        ``'mixed_float16'`` / ``'mixed_bfloat16'`` (compute dtype float16 /
        bfloat16, variable dtype float32).
      loss_scale: A ``lossscale.LossScale``, an int or float (a
        ``FixedLossScale``), the string ``"dynamic"`` (a ``DynamicLossScale``),
        None (no loss scale), or ``"auto"`` (the default): ``"dynamic"`` if
        ``name`` is ``"mixed_float16"``, else None.  A loss scale on a policy
        whose compute dtype is not float16 is allowed but logs a warning.
    """

    def __init__(self, name, loss_scale="auto"):
        super().__init__(name)
        self._init_loss_scale(name, loss_scale)
        if self.loss_scale is not None:
            # TensorFlow 2.4's documented contract: compile follows the loss scale.
            keras_patch.install_policy_hook()


# Keras writes this class under the public name ``keras.DTypePolicy`` (and
# still reads that name as its own class): see the module docstring.
_compat.register_serialized_name(Policy, keras.DTypePolicy)
