"""The compile hook's state and rule: what is patched, and which wrapper a policy gets.

``Model.compile`` wraps a plain optimizer in a loss-scale optimizer; this
module decides how, for Keras 3 (``lossscale.keras_patch`` replaces its
``Trainer.compile``) and for ``tf_keras`` (``lossscale._tf_keras`` replaces
its ``Model._get_optimizer``).  Those two modules describe their
replacement as a ``Patch``;
``install`` is the one function that puts a patch in place, once (calling
it again does nothing), and ``uninstall_all`` the one that takes every
patch out again (``lossscale.unpatch_keras``).  Nothing is patched on
import.  What installs a patch, and nothing else does:

* ``lossscale.patch_keras()``, the explicit switch (``explicit=True``: a
  plain ``"mixed_float16"`` policy gets ours too);
* TensorFlow 2.4's ways of asking compile to follow a loss scale, which
  TensorFlow 2.4 honoured with no switch: ``experimental.set_policy``, and
  constructing a ``lossscale.Policy`` with a loss scale (for ``tf_keras``'
  ``Policy``, an explicit one).  Each installs the hook of its own Keras
  only.

``wrapper_for`` is the rule both patched methods follow.  It names no Keras
class: a policy of ours says so itself (``LOSS_SCALE_POLICY``, set by
``lossscale._policy_loss_scale.PolicyLossScale``).  This module imports
nothing from the package, so every other module may import it.
"""

import collections
import dataclasses
import warnings
import weakref

__all__ = ["Patch", "install", "uninstall_all", "is_explicit", "follow",
           "wrapper_for", "Wrapper", "STOCK", "NONE", "OURS", "LOSS_SCALE_POLICY"]

# The attribute a policy class of ours sets to True: compile follows its
# ``loss_scale``.
LOSS_SCALE_POLICY = "_compile_follows_loss_scale"

# What ``wrapper_for`` answers.
STOCK = "stock"  # that Keras's own compile decides, as if not patched
NONE = "none"    # no loss-scale optimizer
OURS = "ours"    # lossscale's loss-scale optimizer


class Wrapper(collections.namedtuple("Wrapper", ["kind", "loss_scale"])):
    """``kind``: ``STOCK``, ``NONE`` or ``OURS``; ``loss_scale``: with ``OURS``,
    the policy's loss scale to follow, or None for the stock Keras arguments."""

    __slots__ = ()

    def fresh_loss_scale(self):
        """A new copy of ``loss_scale`` (or None): every compiled model gets
        its own loss-scale state, made where its optimizer is made."""
        if self.loss_scale is None:
            return None
        return type(self.loss_scale).from_config(self.loss_scale.get_config())


@dataclasses.dataclass(eq=False, repr=False)
class Patch:
    """One method of one Keras class that the hook replaces (compared by
    identity).

    Args:
      keras: ``"keras"`` (Keras 3) or ``"tf_keras"``: the Keras whose rule
        (``wrapper_for``) the replacement follows.
      owner: the class that defines the method.
      attribute: the method's name in ``owner.__dict__``.
      make_replacement: ``original -> replacement``; the replacement calls
        ``original`` for everything it does not decide itself.
    """

    keras: str
    owner: type
    attribute: str
    make_replacement: object
    # While installed: the method replaced, and its replacement.
    original: object = dataclasses.field(default=None, init=False)
    replacement: object = dataclasses.field(default=None, init=False)

    def installed(self):
        """Whether ``owner``'s method is this patch's replacement right now."""
        return (self.replacement is not None
                and self.owner.__dict__.get(self.attribute) is self.replacement)

    def __repr__(self):
        return f"<Patch {self.owner.__qualname__}.{self.attribute} ({self.keras})>"


# The patches in place, in the order they were installed.
_INSTALLED = []
# The Keras names for which patch_keras() asked for the whole rule.
_EXPLICIT = set()
# Per Keras, the policies given to experimental.set_policy: compile follows
# them even without a loss scale (then it does not wrap), as TensorFlow 2.4
# did.  Policies define __eq__ and so cannot be hashed: weak references,
# compared by identity.
_FOLLOWED = collections.defaultdict(list)


def install(patch, explicit=False):
    """Put ``patch`` in place unless it already is; with ``explicit``, apply
    the whole rule of its Keras (``patch_keras()``) until ``uninstall_all``.

    The only function that patches a Keras class.  If someone replaced the
    method after an earlier ``install``, theirs becomes the original.
    """
    if explicit:
        _EXPLICIT.add(patch.keras)
    if patch.installed():
        return
    patch.original = patch.owner.__dict__[patch.attribute]
    patch.replacement = patch.make_replacement(patch.original)
    setattr(patch.owner, patch.attribute, patch.replacement)
    if patch not in _INSTALLED:
        _INSTALLED.append(patch)


def is_explicit(keras):
    """Whether ``patch_keras()`` asked for the whole rule for ``keras``."""
    return keras in _EXPLICIT


def follow(policy, keras):
    """Have ``keras``'s compile follow ``policy`` even without a loss scale
    (``experimental.set_policy``'s promise); takes effect once its patch is
    installed."""
    followed = _FOLLOWED[keras]
    followed[:] = [ref for ref in followed if ref() is not None]
    followed.append(weakref.ref(policy))


def uninstall_all():
    """Put every original method back: the very same function objects.

    A method that someone replaced again after ``install`` is left as it is,
    with a warning, and its patch's state is kept.
    """
    for patch in list(_INSTALLED):
        if not patch.installed():
            warnings.warn(f"{patch.owner.__qualname__}.{patch.attribute} was replaced after "
                          "lossscale patched it; leaving it as it is.", stacklevel=3)
            continue
        setattr(patch.owner, patch.attribute, patch.original)
        patch.original = patch.replacement = None
        _INSTALLED.remove(patch)
        _EXPLICIT.discard(patch.keras)
        _FOLLOWED.pop(patch.keras, None)


def _is_loss_scale_policy(policy):
    return getattr(type(policy), LOSS_SCALE_POLICY, False) is True


def _followed(policy, keras):
    return any(ref() is policy for ref in _FOLLOWED.get(keras, ()))


def wrapper_for(policy, keras):
    """Which loss-scale optimizer ``keras``'s patched compile wraps a plain
    optimizer in, for a model whose dtype policy is ``policy``.

    * A policy of ours with a loss scale: ``OURS`` following it (TensorFlow
      2.4's ``Policy``).  Without one: ``NONE`` when compile follows the
      policy (given to ``set_policy``, under ``patch_keras()``, and always
      under ``tf_keras``), else ``STOCK``.
    * Under ``patch_keras()``, any other policy: ``OURS`` with the stock
      arguments for ``"mixed_float16"``, else ``NONE``.
    * Otherwise ``STOCK``: models that did not ask keep stock compile.

    Loss-scale optimizers and ``auto_scale_loss=False`` are the caller's to
    leave alone.
    """
    explicit = keras in _EXPLICIT
    if _is_loss_scale_policy(policy):
        if policy.loss_scale is not None:
            return Wrapper(OURS, policy.loss_scale)
        if explicit or keras == "tf_keras" or _followed(policy, keras):
            return Wrapper(NONE, None)
        return Wrapper(STOCK, None)
    if explicit:
        if policy.name == "mixed_float16":
            return Wrapper(OURS, None)
        return Wrapper(NONE, None)
    return Wrapper(STOCK, None)
