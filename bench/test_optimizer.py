"""The Keras layer: ``optimizer.apply(grads, variables)`` in ``tf.function``,
``lossscale.LossScaleOptimizer`` against the stock
``keras.optimizers.LossScaleOptimizer`` it replaces.

Both wrap the same inner optimizer (SGD) over float32 variables of the
workload's shapes, with the scale fixed (growth period 10**9) so that every
call does the same work; the gradients are made inside the step
(``tfgraph.py``), as a backward pass hands them over.  Also timed: the inner
SGD alone (``sgd``), the part an unfused step shares with stock -- what even
a loss-scaling step that cost nothing would take, unless the SGD update is
fused into it (``extra_info["step_path"]`` says which path ours took).
Making the gradients alone (the
``producer``) is timed before every sample and subtracted by the report.
Mixed-precision Keras keeps float32 variables and so float32 gradients:
the 16-bit gradient lists of the other layers do not arise here.
"""

import numpy as np

import harness
import workloads
from tfgraph import GraphCase

LAYER = "optimizer"
PEERS = ["ours", "stock", "sgd"]


def cases(settings):
    if settings.quick:
        return ["resnet50/float32"]
    return [f"{w}/float32" for w in workloads.LISTS]


def items(settings):
    return [(c, p) for c in cases(settings) for p in PEERS]


class Data(GraphCase):
    layer = LAYER

    def __init__(self, case):
        super().__init__(case)
        self.optimizers = {}

    def _make(self, peer):
        import keras

        variables = [keras.Variable(np.zeros_like(a), name=f"w{i}")
                     for i, a in enumerate(self.arrays)]
        inner = keras.optimizers.SGD(1e-3)
        if peer == "sgd":
            opt = inner
        else:
            if peer == "stock":
                cls = keras.optimizers.LossScaleOptimizer
            else:
                from lossscale import LossScaleOptimizer as cls
            opt = cls(inner, initial_scale=2.0 ** 8, dynamic_growth_steps=10 ** 9)
        opt.build(variables)

        def step(gs):
            opt.apply(gs, variables)
            # Read the variables, not the gradients: a later reader of the
            # gradients would stop the native op from writing over them.
            return [v.value for v in variables], None

        self.optimizers[peer] = opt
        return self.graph.wrap(step)


def test_optimizer_apply(benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    fn = data.method(peer)
    harness.timed(benchmark, (LAYER, case, peer), fn, data.info(peer, rnd),
                  baseline=data.graph.producer)
    if peer == "ours":
        opt = data.optimizers[peer]
        benchmark.extra_info["step_path"] = getattr(opt, "step_path", "unfused")
