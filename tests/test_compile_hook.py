"""``lossscale._compile_hook`` on a class of its own: installing is idempotent,
uninstalling puts back the very same function, and a method someone else
replaced afterwards is left alone.  (What compile then wraps, with either
Keras, is in test_keras_patch.py, test_tf24_fidelity.py and
tf_keras_cases.py, against stock Keras.)"""

import pytest

from lossscale import _compile_hook


class _Owner:
    def method(self, value):
        return ("original", value)


ORIGINAL = _Owner.__dict__["method"]


def _make_replacement(original):
    def method(self, value):
        return ("replaced",) + original(self, value)

    return method


@pytest.fixture
def patch():
    made = _compile_hook.Patch("test", _Owner, "method", _make_replacement)
    yield made
    _Owner.method = ORIGINAL
    if made in _compile_hook._INSTALLED:  # pylint: disable=protected-access
        _compile_hook._INSTALLED.remove(made)  # pylint: disable=protected-access
    _compile_hook._EXPLICIT.discard("test")  # pylint: disable=protected-access


def test_install_once_uninstall_exactly(patch):
    _compile_hook.install(patch)
    replacement = _Owner.__dict__["method"]
    assert replacement is not ORIGINAL and _Owner().method(1) == ("replaced", "original", 1)
    _compile_hook.install(patch)
    _compile_hook.install(patch, explicit=True)
    assert _Owner.__dict__["method"] is replacement and _compile_hook.is_explicit("test")
    _compile_hook.uninstall_all()
    assert _Owner.__dict__["method"] is ORIGINAL and not _compile_hook.is_explicit("test")
    _compile_hook.uninstall_all()
    assert _Owner.__dict__["method"] is ORIGINAL


def test_a_later_replacement_is_left_alone(patch):
    _compile_hook.install(patch, explicit=True)

    def someone_elses(self, value):
        return ("theirs", value)

    _Owner.method = someone_elses
    with pytest.warns(UserWarning, match="replaced after lossscale patched it"):
        _compile_hook.uninstall_all()
    assert _Owner.__dict__["method"] is someone_elses and _compile_hook.is_explicit("test")
    # Installing again wraps theirs.
    _compile_hook.install(patch)
    assert _Owner().method(2) == ("replaced", "theirs", 2) and patch.original is someone_elses


class _Plain:
    def __init__(self, name):
        self.name = name


class _Ours(_Plain):
    def __init__(self, name, loss_scale):
        super().__init__(name)
        self.loss_scale = loss_scale


setattr(_Ours, _compile_hook.LOSS_SCALE_POLICY, True)


class _LossScale:
    def __init__(self, value):
        self.value = value

    def get_config(self):
        return {"value": self.value}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@pytest.mark.parametrize("keras", ["keras", "tf_keras"])
def test_the_rule(keras):
    # The README's rule: a policy of ours with a loss scale: ours following
    # a fresh copy of it; without: no wrapper where compile follows the
    # policy, else stock; anything else: stock unless patch_keras().
    ours = _Ours("mixed_float16", _LossScale(8))
    wrapper = _compile_hook.wrapper_for(ours, keras)
    fresh = wrapper.fresh_loss_scale()
    assert wrapper.kind == _compile_hook.OURS
    assert fresh is not ours.loss_scale and fresh.value == 8
    bare = _Ours("mixed_float16", None)
    assert _compile_hook.wrapper_for(bare, keras).kind == (
        _compile_hook.NONE if keras == "tf_keras" else _compile_hook.STOCK)
    assert _compile_hook.wrapper_for(_Plain("mixed_float16"), keras).kind == _compile_hook.STOCK
    _compile_hook.follow(bare, keras)
    assert _compile_hook.wrapper_for(bare, keras).kind == _compile_hook.NONE
    _compile_hook._FOLLOWED.pop(keras)  # pylint: disable=protected-access
    _compile_hook._EXPLICIT.add(keras)  # pylint: disable=protected-access
    try:
        assert _compile_hook.wrapper_for(bare, keras).kind == _compile_hook.NONE
        assert _compile_hook.wrapper_for(_Plain("mixed_float16"), keras) == (
            _compile_hook.OURS, None)
        assert _compile_hook.wrapper_for(_Plain("float32"), keras).kind == _compile_hook.NONE
    finally:
        _compile_hook._EXPLICIT.discard(keras)  # pylint: disable=protected-access
