"""The TensorFlow 2.4 API layer: ``DynamicLossScale.update(grads)`` -- check
every (already unscaled) gradient and step the scale -- ours against
``tf.compat.v1.mixed_precision.DynamicLossScale.update``, the class it
brings back.

In ``tf.function`` (``ours``, ``stock``) the gradients are made inside the
graph (``tfgraph.py``; making them alone, the ``producer``, is timed before
every sample and subtracted by the report); eagerly (``ours_eager``,
``stock_eager``) they are ready-made tensors.  The update only reads the gradients, so neither side can gain
from writing in place: the difference is one all-finite op and one update
op against an ``is_finite`` + ``reduce_all`` per tensor and a graph of
conditionals.
"""

import warnings

import harness
import workloads

LAYER = "loss_scale"
PEERS = ["ours", "stock", "ours_eager", "stock_eager"]
PERIOD = 10 ** 9


def cases(settings):
    if settings.quick:
        return ["resnet50/float32"]
    return [f"{w}/{d}" for w in workloads.LISTS for d in ("float32", "float16", "bfloat16")]


def items(settings):
    return [(c, p) for c in cases(settings) for p in PEERS]


def make_loss_scale(kind):
    tf = harness.tensorflow()
    if kind == "ours":
        import lossscale

        return lossscale.DynamicLossScale(initial_loss_scale=2.0 ** 15, increment_period=PERIOD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=2.0 ** 15, increment_period=PERIOD)


class Data(harness.CaseData):
    layer = LAYER

    def __init__(self, case):
        super().__init__(case)
        tf = harness.tensorflow()
        self.tensors = [tf.constant(a) for a in self.arrays]
        self.graph = None

    def _make(self, peer):
        from tfgraph import GraphGradients

        if self.graph is None:
            self.graph = GraphGradients(self.arrays)
        loss_scale = make_loss_scale(peer.split("_")[0])
        if peer.endswith("_eager"):
            tensors = self.tensors
            return lambda: loss_scale.update(tensors)
        return self.graph.wrap(lambda gs: (None, loss_scale.update(gs)[1]))


def test_loss_scale_update(benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    fn = data.method(peer)
    harness.timed(benchmark, (LAYER, case, peer), fn, data.info(peer, rnd),
                  baseline=None if peer.endswith("_eager") else data.graph.producer)
    if rnd == 0:
        assert bool(fn()[1]), f"{peer} found a non-finite gradient in finite data"
