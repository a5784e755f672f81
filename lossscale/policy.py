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
"""

import logging

import keras

from lossscale import _compat, keras_patch
from lossscale import loss_scale as loss_scale_module

__all__ = ["Policy"]

_logger = logging.getLogger(__name__)


def _same_loss_scale(a, b):
    if a is None or b is None:
        return a is b
    return type(a) is type(b) and a.get_config() == b.get_config()


class Policy(keras.DTypePolicy):
    """A dtype policy for a Keras layer, with a loss scale for ``Model.compile``.

    The difference from ``keras.DTypePolicy`` is the ``loss_scale`` field.  The
    loss scale is used only by ``Model.compile`` (with no switch to turn on: a
    policy with a loss scale installs the policy hook of
    ``lossscale.keras_patch``), which wraps a plain optimizer in a
    ``lossscale.LossScaleOptimizer`` following that loss scale; it is only used
    during ``Model.fit``, ``Model.train_on_batch`` and similar methods, never by
    layers.  With a plain ``keras.DTypePolicy``, ``Model.compile`` instead wraps
    the optimizer only if the policy's name is ``"mixed_float16"``.

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
        if isinstance(loss_scale, str) and loss_scale == "auto":
            loss_scale = "dynamic" if name == "mixed_float16" else None
            self._using_default_loss_scale = True
        else:
            self._using_default_loss_scale = False
        self._loss_scale = loss_scale_module.get(loss_scale)
        if self._loss_scale is not None and self.compute_dtype != "float16":
            _logger.warning(
                "Creating a Policy with a loss scale is only useful for float16 "
                "policies. You passed loss_scale=%r for policy %s. Consider not "
                "passing any loss_scale instead.", loss_scale, name)
        if self._loss_scale is not None:
            # Asking for a loss scale is asking Model.compile to follow it.
            keras_patch.install_policy_hook()

    @property
    def loss_scale(self):
        """The loss scale of this policy: a ``lossscale.LossScale``, or None."""
        return self._loss_scale

    def __repr__(self):
        return f'<Policy "{self.name}", loss_scale={self._loss_scale}>'

    def __eq__(self, other):
        return (type(other) is type(self) and self.name == other.name
                and _same_loss_scale(self._loss_scale, other._loss_scale))

    def get_config(self):
        """``{'name': ...}``, plus ``'loss_scale'`` if one was passed explicitly.

        Keras's serializers get ``{'name': ...}`` only: that is what is written
        into a saved model (see the module docstring).
        """
        config = {"name": self.name}
        # Asked by Keras itself: its serializers.
        if not self._using_default_loss_scale and not _compat.caller_is_keras():
            config["loss_scale"] = loss_scale_module.serialize(self._loss_scale)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The policy of ``get_config``'s dict, its loss scale included.

        Args:
          config: ``{'name': ...}``, optionally with ``'loss_scale'`` (a
            serialized loss scale or any ``lossscale.loss_scale.get`` identifier).
          custom_objects: ``{name: class}`` for loss-scale classes of your own.
        """
        if not isinstance(config, dict):
            raise ValueError(f"Policy.from_config: config must be a dict such as "
                             f"{{'name': 'mixed_float16'}}, got {config!r}")
        config = dict(config)
        if isinstance(config.get("loss_scale"), dict):
            config["loss_scale"] = loss_scale_module.deserialize(
                config["loss_scale"], custom_objects=custom_objects)
        return cls(**config)


# Keras writes this class under the public name ``keras.DTypePolicy`` (and
# still reads that name as its own class): see the module docstring.
_compat.register_serialized_name(Policy, keras.DTypePolicy)
