"""The tf_keras step layer (``tf_keras_step``): TensorFlow 2.4's custom
loop, ``get_unscaled_gradients`` then ``apply_gradients`` in
``tf.function``, for ``lossscale.LossScaleOptimizer`` on ``tf_keras``
against ``tf_keras``' own ``LossScaleOptimizer`` and torch's nearest
equivalent (``tf_keras_step_child.py`` says what is timed).

``tf_keras`` is ``lossscale``'s Keras line only in a process started with
``TF_USE_LEGACY_KERAS=1``, and this one stays on Keras 3 for every other
layer, so each item here is one case (workload and optimizer) whose peers,
every round of them, a child ``pytest`` with that variable times side by
side, as the step layer times its own; the child's benchmarks enter this
run's raw JSON as they are (layer ``tf_keras_step``).
"""

import os

import pytest

import harness
import tf_keras_step_child as child

LAYER = child.LAYER
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_keras_step_child.py")
# The one "peer" of an item: all of the case's, side by side in the child.
SIDE_BY_SIDE = "side_by_side"


def items(settings):
    return [(c, SIDE_BY_SIDE) for c in child.cases(settings)]


def test_tf_keras_step(case, peer):
    del peer
    from lossscale import _which_keras

    # Found, not imported: tf_keras in this process would change what
    # lossscale does for the Keras 3 layers.
    if not _which_keras.tf_keras_installed():
        pytest.skip("tf_keras step skipped: tf_keras is not installed; pip install tf_keras")
    settings = harness.Settings
    nodes = [f"{CHILD}::test_tf_keras_step[{case}-{p}-r{r}]"
             for r in range(settings.rounds) for p in child.peers(case)]
    benchmarks = harness.child_benchmarks(f"{LAYER} {case}", nodes, settings, settings.rounds,
                                          child.ENV)
    assert benchmarks, f"the child for {LAYER} {case} timed nothing"
    harness.CHILD_BENCHMARKS.extend(benchmarks)
