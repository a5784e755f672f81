"""The finite check alone, on gradients made inside the graph
(``tfgraph.py``), as the optimizer step does it before anything else.

Peers, each in ``tf.function`` and ending in one bool:

* ``composite``       -- what stock Keras' ``check_finite`` does:
                         ``is_finite`` + ``reduce_all`` per tensor, then
                         ``reduce_all`` over the flags;
* ``ours_per_tensor`` -- ``lossscale.ops.all_finite([g])`` per tensor, the
                         flags combined the same way;
* ``ours_list``       -- ``lossscale.ops.all_finite(grads)``: one op for the
                         whole list;
* ``ours_grouped``    -- ``lossscale.ops.all_finite_grouped(grads)``, where
                         the package has it: small tensors grouped into one
                         op, large ones one op each.

Making the gradients alone (the ``producer``) is timed before every sample
and subtracted by the report.  The check only reads, so no peer can gain
from writing in place.
"""

import harness
from tfgraph import GraphCase

LAYER = "check"
PEERS = ["composite", "ours_per_tensor", "ours_list", "ours_grouped"]


def has_grouped():
    from lossscale import ops

    return hasattr(ops, "all_finite_grouped")


def cases(settings):
    return ["resnet50/float32", "tiny_2000x64/float32"]


def items(settings):
    peers = [p for p in PEERS if p != "ours_grouped" or has_grouped()]
    return [(c, p) for c in cases(settings) for p in peers]


def check(peer):
    """``grads -> bool tensor`` for a peer."""
    tf = harness.tensorflow()
    from lossscale import ops

    if peer == "composite":
        return lambda gs: tf.reduce_all(tf.stack(
            [tf.reduce_all(tf.math.is_finite(g)) for g in gs]))
    if peer == "ours_per_tensor":
        return lambda gs: tf.reduce_all(tf.stack([ops.all_finite([g]) for g in gs]))
    if peer == "ours_list":
        return ops.all_finite
    if peer == "ours_grouped":
        return ops.all_finite_grouped
    raise ValueError(peer)


class Data(GraphCase):
    layer = LAYER

    def _make(self, peer):
        fn = check(peer)
        return self.graph.wrap(lambda gs: (None, fn(gs)))


def test_check(benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    fn = data.method(peer)
    harness.timed(benchmark, (LAYER, case, peer), fn,
                  data.info(peer, rnd, gradients="made in the graph"),
                  baseline=data.graph.producer)
    if rnd == 0:
        assert bool(fn()[1]), f"{peer} found a non-finite gradient in finite data"
