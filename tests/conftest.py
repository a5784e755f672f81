"""Test-wide set-up: quiet TensorFlow on machines without a GPU."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


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
