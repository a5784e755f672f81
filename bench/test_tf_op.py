"""The TensorFlow layer: one step's loss-scale work on a gradient list --
unscale every gradient, check them all, update the scale -- done by the
lossscale ops and by their peers.

Peers (TensorFlow's pools and torch pinned to the same thread count):

* ``ours``            -- ``ops.unscale_and_check`` + ``ops.update_loss_scale``
                         in ``tf.function``: two ops for the whole list;
* ``composite``       -- stock TensorFlow in ``tf.function``:
                         ``g * tf.cast(1 / scale, g.dtype)`` per tensor, then
                         ``tf.compat.v1.mixed_precision.DynamicLossScale.update``
                         (``is_finite`` + ``reduce_all`` per tensor, the update);
* ``ours_eager``, ``composite_eager`` -- the same two, called eagerly;
* ``torch``           -- ``torch._amp_foreach_non_finite_check_and_unscale_``
                         + ``torch._amp_update_scale_``, in place on CPU tensors;

In-graph methods also time making the gradients alone (the ``producer``,
see ``tfgraph.py``) just before every sample; the report subtracts it.

In ``tf.function`` the gradients are made inside the graph (fresh buffers,
as a backward pass leaves them: the native op writes over them).  The eager
methods, and every method of the size sweep, take ready-made tensors that
the caller keeps, so both TensorFlow methods write fresh outputs.  The
scale is 2**8, so unscaled values stay normal in every dtype, and never
grows (the increment period is 10**9): every call does the same work.
"""

import warnings

import numpy as np

import harness
import workloads

LAYER = "tf_op"
SCALE = 2.0 ** 8
PERIOD = 10 ** 9
GRAPH_PEERS = ["ours", "composite", "torch", "ours_eager", "composite_eager"]
SWEEP_PEERS = ["ours", "composite", "torch", "ours_eager", "composite_eager"]


def cases(settings):
    if settings.quick:
        return (["resnet50/float32"],
                [f"{workloads.sweep_name(b)}/float32" for b in workloads.QUICK_SWEEP_BYTES[:2]])
    lists = [f"{w}/{d}" for w in workloads.LISTS for d in ("float32", "float16", "bfloat16")]
    return (lists + [f"{workloads.BIG}/float32"],
            [f"{workloads.sweep_name(b)}/float32" for b in workloads.SWEEP_BYTES
             if b < workloads.GIB])


def items(settings):
    graph, sweep = cases(settings)
    return ([(c, p) for c in graph for p in GRAPH_PEERS]
            + [(c, p) for c in sweep for p in SWEEP_PEERS])


def loss_scale_steps():
    """``(ours, composite)``: each maps gradients to ``(unscaled, should_apply)``
    and keeps its own loss-scale state."""
    tf = harness.tensorflow()
    from lossscale import ops

    scale = tf.Variable(SCALE)
    counter = tf.Variable(0, dtype=tf.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=SCALE, increment_period=PERIOD)

    def ours(gs):
        outs, finite = ops.unscale_and_check(gs, scale)
        return outs, ops.update_loss_scale(finite, scale, counter, increment_period=PERIOD)

    def composite(gs):
        inv = 1.0 / reference()
        outs = [g * tf.cast(inv, g.dtype) for g in gs]
        return outs, reference.update(outs)[1]

    return ours, composite


class Data(harness.CaseData):
    layer = LAYER

    def __init__(self, case):
        super().__init__(case)
        tf = harness.tensorflow()
        self.in_graph = not self.name.startswith("sweep_")
        self.tensors = [tf.constant(a) for a in self.arrays]

    def _make(self, peer):
        tf = harness.tensorflow()
        if peer == "torch":
            return torch_step(harness.torch_or_skip(), self.arrays)
        ours, composite = loss_scale_steps()
        step = ours if peer.startswith("ours") else composite
        tensors = self.tensors
        if peer.endswith("_eager"):
            return lambda: step(tensors)
        if not self.in_graph:
            fn = tf.function(step)
            return lambda: fn(tensors)
        from tfgraph import GraphGradients

        if "graph" not in self.methods:
            self.methods["graph"] = GraphGradients(self.arrays)
        return self.methods["graph"].wrap(step)

    def baseline(self, peer):
        """What the report takes off this peer's time: making the gradients."""
        if self.in_graph and peer in ("ours", "composite"):
            return self.methods["graph"].producer
        return None

    def info(self, peer, rnd):
        return super().info(peer, rnd, gradients=(
            "made in the graph" if self.in_graph and not peer.endswith("_eager")
            else "ready-made tensors"))


def torch_step(torch, arrays):
    """torch's unscale + check + update, in place on its own copy of the data;
    the inverse scale alternates between 1/2 and 2 (exact both ways)."""
    if arrays[0].dtype == workloads.DTYPES["bfloat16"]:
        tensors = [torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) for a in arrays]
    else:
        tensors = [torch.from_numpy(a.copy()) for a in arrays]
    found_inf = torch.zeros(1)
    invs = [torch.tensor([0.5]), torch.tensor([2.0])]
    scale = torch.tensor([SCALE])
    tracker = torch.zeros(1, dtype=torch.int32)
    flip = harness.Flip()
    unscale, update = torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_

    def step():
        found_inf.zero_()
        unscale(tensors, found_inf, invs[flip()])
        update(scale, tracker, found_inf, 2.0, 0.5, PERIOD)

    return step


def test_tf_op(benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    fn = data.method(peer)
    harness.timed(benchmark, (LAYER, case, peer), fn, data.info(peer, rnd),
                  baseline=data.baseline(peer))
    if rnd == 0 and peer != "torch":
        assert bool(fn()[1]), f"{peer} found a non-finite gradient in finite data"
