"""Test-wide set-up: quiet TensorFlow on machines without a GPU."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


# make test's workers each take a whole module (a whole class of
# test_tf_keras.py: one child run) at a time, in the order collected
# (--dist loadscope --no-loadscope-reorder).  These modules take minutes; they
# start first, so that the workers finish together rather than one of them
# starting the longest module last.
FIRST = ("test_tf_keras.py", "test_wheel.py", "test_fused_step.py", "test_fused_ema_accum.py",
         "test_fused_clip.py", "test_fused_sparse.py", "test_fused_distributed.py",
         "test_fused_distributed_sparse.py", "test_core_optim.py")


def pytest_collection_modifyitems(items):
    """The modules of ``FIRST`` first, in its order; the rest as collected."""
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)


def pytest_terminal_summary(terminalreporter):
    """Lines a test asked to show at the end of the run, through
    ``record_property("terminal_summary", line)`` (the bad-input matrix size)."""
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == "terminal_summary":
                    terminalreporter.write_line(str(value))


@pytest.fixture
def stock_keras_compile():
    """Stock Keras's ``compile`` and the global policy around a test; yields
    that ``compile``.  A ``lossscale.Policy`` with a loss scale made by an
    earlier test has installed compile's policy hook (TensorFlow 2.4's
    documented behaviour, see ``lossscale._compile_hook``), so
    ``unpatch_keras()``, which takes out every hook, runs first."""
    import keras  # pylint: disable=import-outside-toplevel

    import lossscale  # pylint: disable=import-outside-toplevel
    from lossscale import _compat  # pylint: disable=import-outside-toplevel

    trainer = _compat.trainer_class()
    lossscale.unpatch_keras()
    stock = trainer.__dict__["compile"]
    before = keras.mixed_precision.global_policy()
    yield stock
    lossscale.unpatch_keras()
    keras.mixed_precision.set_global_policy(before)
    assert trainer.__dict__["compile"] is stock
