"""The loss-scale half of TensorFlow 2.4's experimental ``Policy``, for either Keras.

``lossscale.Policy`` (a ``keras.DTypePolicy``) and its ``tf_keras`` twin
(a ``tf_keras.mixed_precision.Policy``, in ``lossscale._tf_keras``) differ
only in their dtype half, which is their Keras's own.  What they add to it
lives here, once: how ``loss_scale='auto'`` and the other identifiers
resolve (and the warning for a loss scale on a policy that is not float16),
the ``loss_scale`` property, ``__repr__``, ``__eq__`` and the
serialization.  The class also declares to the compile hook
(``lossscale._compile_hook``) that compile follows its loss scale.  Neither
Keras is imported here.
"""

import logging

from lossscale import _compat
from lossscale import _compile_hook
from lossscale import loss_scale as loss_scale_module

__all__ = ["PolicyLossScale"]

# Both policies log under the public module's name.
_logger = logging.getLogger("lossscale.policy")


def _same_loss_scale(a, b):
    if a is None or b is None:
        return a is b
    return type(a) is type(b) and a.get_config() == b.get_config()


class PolicyLossScale:
    """Mixin before a Keras dtype-policy class: a ``loss_scale`` field.

    The subclass's ``__init__`` calls its Keras's ``__init__(name)`` and then
    ``_init_loss_scale(name, loss_scale)``.
    """

    __hash__ = None

    def _init_loss_scale(self, name, loss_scale):
        """Resolves ``loss_scale`` as TensorFlow 2.4 does: ``"auto"`` is
        ``"dynamic"`` for ``"mixed_float16"`` and None otherwise; anything
        else goes through ``lossscale.get``.  Needs ``compute_dtype`` set."""
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

        Keras 3's serializers get ``{'name': ...}`` only: that is what is
        written into a saved model (see ``lossscale.policy``).
        """
        config = {"name": self.name}
        # Asked by Keras 3 itself: its serializers.
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


# The declaration the compile hook's rule reads (it names no class of ours).
setattr(PolicyLossScale, _compile_hook.LOSS_SCALE_POLICY, True)
